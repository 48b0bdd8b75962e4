"""``benchx study``: the baseline-versus-SynthX study, the project's main job (MLproject ``main``).

Parses the command line into :class:`synthx.study.StudySettings` and runs :func:`synthx.study.run_study`
(the steps and their resumability are described there).

Example::

    benchx study --recipe recipes/unet.yaml --profile cpu
    benchx study --recipe recipes/unet.yaml --profile cpu --target need:40 trainer.max_steps=4000
    benchx study --painter phantom --out outputs/study-phantom-painter   # the positive control
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lightning_modules.commands.common import add_overrides_argument, split_overrides
from synthx.painters import PAINTERS
from synthx.study import StudySettings, run_study


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchx study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=StudySettings.recipe, help="backbone recipe (default: %(default)s)")
    parser.add_argument("--profile", default=StudySettings.profile, help="recipe profile (default: %(default)s)")
    parser.add_argument("--synthx-recipe", default=StudySettings.synthx_recipe, help="SynthX recipe (default: %(default)s)")
    parser.add_argument("--synthx-override", action="append", default=[], help="key=value for the SynthX recipe (repeatable)")
    parser.add_argument("--cases", type=int, default=None,
                        help="phantom cases when the cohort is generated (default: the phantom's own, matching splits/phantom.csv)")
    parser.add_argument("--ratio", type=float, default=StudySettings.ratio, help="synthesis ratio r of the augmented run")
    parser.add_argument("--target", default=StudySettings.target,
                        help="targeting rule: need:B (default %(default)s: B cases where the baseline's validation "
                             "sensitivity falls short), min_positives:k, match:val, match:uniform, counts:<table>")
    parser.add_argument("--target-phases", default=None,
                        help="comma-separated contrast phases the targeting may fill (default: all), e.g. arterial "
                             "to spend the budget on a scarcity gap only")
    parser.add_argument("--budget", type=int, default=None, help="total synthetic cases for match:* rules")
    parser.add_argument("--synthesis-steps", type=int, default=None,
                        help="denoising steps per synthetic case (default: the SynthX recipe's sampling.num_inference_steps)")
    parser.add_argument("--painter", choices=PAINTERS, default=StudySettings.painter,
                        help="who paints the targeted tumors: synthx (default: the SynthX generator, trained in the "
                             "study) or phantom (the positive control: the embedded phantom's own renderer paints "
                             "real-appearance tumors into the same canvases; phantom cohorts only)")
    parser.add_argument("--locked-cases", type=int, default=StudySettings.locked_cases,
                        help="scans of the locked test cohort, a phantom of another seed (default: %(default)s, sized "
                             "by `python -m synthx.power`; 0: test on the split's test set)")
    parser.add_argument("--locked-seed", type=int, default=None,
                        help="the locked phantom's seed (default: the development phantom's seed + 1000)")
    parser.add_argument("--experiment", default=StudySettings.experiment, help="MLflow experiment (default: %(default)s)")
    parser.add_argument("--out", default=StudySettings.output_dir, help="output folder (default: %(default)s)")
    add_overrides_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments and run the study; returns 0 when it finished."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    settings = StudySettings(
        recipe=args.recipe, profile=args.profile, overrides=split_overrides(args.overrides),
        synthx_recipe=args.synthx_recipe, synthx_overrides=args.synthx_override, cases=args.cases,
        ratio=args.ratio, target=args.target, budget=args.budget, synthesis_steps=args.synthesis_steps,
        experiment=args.experiment, output_dir=args.out, painter=args.painter,
        locked_cases=args.locked_cases, locked_seed=args.locked_seed,
        target_phases=[p.strip() for p in args.target_phases.split(",") if p.strip()] if args.target_phases else None,
    )
    run_study(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
