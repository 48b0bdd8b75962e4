"""Machine-independent CPU arithmetic: a model trained from one seed has the same weights whatever the
processor's instruction set and thread count (lightning_modules.config.numerics), and the machine's own
paths (BENCHX_NATIVE_CPU=1) are what would differ without the pin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import RECIPES, REPO_ROOT, tiny_overrides
from lightning_modules.config.numerics import PINNED_ENVIRONMENT, native_cpu, pin_cpu_environment

# Another machine of the same kind, emulated: no vectorized ATen kernels, MKL limited to AVX2 (a processor
# without AVX-512) and one thread instead of two.
OTHER_MACHINE = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
TRAIN_AND_HASH = """
import hashlib, json, sys
import lightning_modules
from lightning_modules.recipe import load_recipe
from lightning_modules.workflows.train import train
import torch
result = train(load_recipe(sys.argv[1], sys.argv[2:]))
state = torch.load(result.last_checkpoint, map_location="cpu", weights_only=False)["state_dict"]
digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
print(json.dumps({"weights": digest, "capability": torch.backends.cpu.get_cpu_capability(),
                  "threads": torch.get_num_threads(), "mkldnn": torch.backends.mkldnn.enabled}))
"""


def test_the_environment_is_pinned_unless_the_user_asks_for_native_paths():
    environ = {"ATEN_CPU_CAPABILITY": "avx512"}
    assert pin_cpu_environment(environ) == PINNED_ENVIRONMENT
    assert environ["ATEN_CPU_CAPABILITY"] == "avx2" and environ["MKL_CBWR"] == "AVX2,STRICT"
    native = {"BENCHX_NATIVE_CPU": "1", "ATEN_CPU_CAPABILITY": "avx512"}
    assert native_cpu(native) and pin_cpu_environment(native) == {}
    assert native["ATEN_CPU_CAPABILITY"] == "avx512" and "MKL_CBWR" not in native
    assert not native_cpu({"BENCHX_NATIVE_CPU": "0"})
    # The test process itself imported lightning_modules first: pinned.
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"


def _train(tmp_path, name, root, split, extra_env):
    environment = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS")}
    environment.update(extra_env, PYTHONPATH=str(REPO_ROOT))
    folder = tmp_path / name
    overrides = [o for o in tiny_overrides(root, split, folder, steps=12) if not o.startswith("trainer.val_every")]
    result = subprocess.run([sys.executable, "-c", TRAIN_AND_HASH, str(RECIPES / "unet.yaml"), *overrides,
                             "trainer.val_every_n_steps=0", "data.augment=false"],
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_weights_are_the_same_on_another_instruction_set_and_thread_count(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    here = _train(tmp_path, "here", root, split, {})
    other = _train(tmp_path, "other", root, split, OTHER_MACHINE)
    assert here["capability"] == other["capability"] == "AVX2" and not here["mkldnn"] and not other["mkldnn"]
    assert other["threads"] == 1 and here["threads"] != other["threads"], "two thread counts compared"
    assert here["weights"] == other["weights"]
    # Without the pin the same two machines train different weights: the comparison above can fail.
    native_here = _train(tmp_path, "native-here", root, split, {"BENCHX_NATIVE_CPU": "1"})
    native_other = _train(tmp_path, "native-other", root, split, {"BENCHX_NATIVE_CPU": "1", **OTHER_MACHINE})
    assert native_other["capability"] == "DEFAULT" and native_here["mkldnn"]
    assert native_here["weights"] != native_other["weights"]
