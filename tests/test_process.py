"""The process around a run: the code version (git) and SIGTERM/SIGINT turned into Terminated."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from conftest import REPO_ROOT
from lightning_modules.infrastructure.process import Terminated, deferred_signals, git_commit, raise_if_signalled, terminating_signals


def test_git_commit_names_the_checkout_and_says_unknown_outside_one(tmp_path):
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", git_commit(REPO_ROOT))
    assert git_commit(tmp_path) == "unknown"


def test_a_signal_inside_terminating_signals_raises_terminated_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as stopped:
        with terminating_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert stopped.value.exit_code == 143 and "SIGTERM" in str(stopped.value)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_deferred_signal_waits_for_the_safe_point():
    with terminating_signals():
        with pytest.raises(Terminated) as stopped:
            with deferred_signals():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
                reached = True  # recorded only: the block goes on
        assert reached and stopped.value.exit_code == 130
    raise_if_signalled()  # nothing pending once raised
