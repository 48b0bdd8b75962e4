"""Benchmark: whole-volume inference through the SegmentationModule against MONAI's ``sliding_window_inference`` called directly.

One full-size volume (266 x 266 x 300 voxels: a typical abdominal CT at Touchstone's 1.5 mm), one
network (a recipe's backbone, the CPU profile by default), the same window, overlap, window batch
and Gaussian blending, in one process and alternating: ``module.predict_volume`` (what validation,
``benchx evaluate`` and ``benchx predict`` run) against a direct call. Reports seconds and peak
memory above the level before the call (CUDA allocator peak on a GPU; sampled resident memory on
CPU); target ratio <= 1.0 (the module adds nothing), and that both give the same logits.

Run::

    .venv/bin/python benchmarks/bench_sliding_window.py
    .venv/bin/python benchmarks/bench_sliding_window.py --shape 128 128 128 --device cuda

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from monai.inferers import sliding_window_inference  # noqa: E402

from benchmarks.peak_memory import PeakMemory  # noqa: E402
from benchmarks.record import Row, add_record_argument, record  # noqa: E402
from lightning_modules.recipe import load_recipe  # noqa: E402
from lightning_modules.models.checkpoints import build_module  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/unet.yaml")
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--shape", type=int, nargs=3, default=(266, 266, 300))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    add_record_argument(parser)
    args = parser.parse_args(argv)

    recipe = load_recipe(args.recipe, [f"profile={args.profile}"])
    device = torch.device(args.device)
    torch.manual_seed(0)
    module = build_module(recipe).to(device).eval()
    hp = module.hparams
    roi = tuple(int(p) for p in (hp.sw_roi_size or hp.patch_size))
    volume = torch.rand((1, 1, *args.shape), generator=torch.Generator().manual_seed(0)).to(device)
    print(f"{recipe.name} ({args.profile}) on {device}: volume {tuple(args.shape)}, window {roi}, overlap {hp.sw_overlap}, "
          f"window batch {hp.sw_batch_size}, torch threads {torch.get_num_threads()}")

    def direct():
        return sliding_window_inference(volume, roi, int(hp.sw_batch_size), module.network,
                                        overlap=float(hp.sw_overlap), mode="gaussian")

    def through_module():
        return module.predict_volume(volume)

    times = {"module.predict_volume": [], "MONAI directly": []}
    peaks = {name: [] for name in times}
    outputs = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, call in (("MONAI directly", direct), ("module.predict_volume", through_module)):
                with PeakMemory(device) as peak:
                    started = time.perf_counter()
                    outputs[name] = call()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times[name].append(time.perf_counter() - started)
                peaks[name].append(peak.mib)
                outputs[name] = outputs[name].cpu()
    for name in times:
        print(f"{name}: {min(times[name]):.2f} s (best of {args.repeats}), peak +{max(peaks[name]):.0f} MiB")
    ratio = min(times["module.predict_volume"]) / min(times["MONAI directly"])
    same = torch.allclose(outputs["module.predict_volume"], outputs["MONAI directly"], atol=1e-6)
    print(f"ratio module / direct: {ratio:.3f} (target <= 1.0, within timing noise); same logits: {same}")
    shape = " x ".join(map(str, args.shape))
    record(args.record, Row(
        label=f"sliding-window inference, {shape}, {'x'.join(map(str, roi))} windows, overlap {hp.sw_overlap}, "
              f"{args.device}", script="bench_sliding_window.py",
        figures={"module": (min(times["module.predict_volume"]), ".2f"), "direct": (min(times["MONAI directly"]), ".2f"),
                 "ratio": (ratio, ".3f")},
        text="`module.predict_volume` {module} s, MONAI directly {direct} s" + ("; same logits" if same else
                                                                               "; the logits differ"),
        ratio="module / direct {ratio}", target="<= 1.02, same logits", met=ratio <= 1.02 and same))
    return 0 if ratio <= 1.02 and same else 1


if __name__ == "__main__":
    sys.exit(main())
