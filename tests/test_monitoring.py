"""Training progress lines for log files: step, loss, speed and the time left."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightning_modules.infrastructure.monitoring import LogProgress, format_duration


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def trainer_at(step: int, max_steps: int = 100) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, max_steps=max_steps, is_global_zero=True,
                           callback_metrics={"train/loss": torch.tensor(0.5), "train/device/samples_per_sec": torch.tensor(8.0)})


def test_the_progress_line_shows_the_time_left_at_the_pace_so_far(capsys):
    clock = FakeClock()
    progress = LogProgress(every=10, clock=clock)
    progress.on_train_start(trainer_at(20), None)  # resumed at step 20
    clock.now += 30.0  # 10 steps in 30 s
    progress.on_train_batch_end(trainer_at(30), None, None, None, 0)
    line = capsys.readouterr().out.strip()
    assert line == "[train] step 30/100, train/loss 0.5000, 8.0 samples/s, ETA 3 min 30 s"


def test_no_line_between_reports_and_no_eta_before_a_step(capsys):
    clock = FakeClock()
    progress = LogProgress(every=10, clock=clock)
    progress.on_train_batch_end(trainer_at(15), None, None, None, 0)
    assert capsys.readouterr().out == ""
    progress.on_train_start(trainer_at(10), None)
    progress.on_train_batch_end(trainer_at(10), None, None, None, 0)
    assert "ETA" not in capsys.readouterr().out


def test_durations_read_as_people_write_them():
    assert format_duration(42.4) == "42 s"
    assert format_duration(185) == "3 min 05 s"
    assert format_duration(3720) == "1 h 02 min"
