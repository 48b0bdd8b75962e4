"""How large the locked test cohort must be, and what the study can detect on it (docs/design.md
"The locked test cohort").

The primary endpoint is a difference in arterial sensitivity (docs/design.md "The primary endpoint").
Its precision is limited by the arterial tumors of the test cohort: K seeds average the training
noise away, but every seed is evaluated on the same patients, so the patients' sampling variance
stays whatever K is. The detectable difference is computed for two independent proportions on n
arterial positives (Cohen's h, statsmodels' ``NormalIndPower``); pairing the arms on the same
patients can only lower the variance, so the figure is conservative for a paired design of any K.
The seed level adds a second condition: with K seeds as the unit, a one-sample t-test at 80% power
detects a mean difference of ``seed_effect_sd(K)`` standard deviations of the per-seed differences
(statsmodels' ``TTestPower``).

Run::

    python -m synthx.power                 # the table of docs/design.md
"""

from __future__ import annotations

import argparse
import math

import pandas as pd

ALPHA = 0.05
POWER = 0.8


def arterial_positive_share(seed: int, cases: int) -> float:
    """The share of scans that are arterial-phase tumor scans in a phantom cohort of that seed and size."""
    from lightning_modules.cohorts.phantom import sample_phantom_metadata

    table = sample_phantom_metadata(cases, seed)
    return float(((table["phase"] == "arterial") & (table["tumor"] == 1)).mean())


def detectable_difference(positives: int, baseline: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest rise from ``baseline`` sensitivity detectable on ``positives`` tumors per arm."""
    from statsmodels.stats.power import NormalIndPower

    h = NormalIndPower().solve_power(effect_size=None, nobs1=positives, alpha=alpha, power=power, ratio=1.0)
    angle = 2 * math.asin(math.sqrt(baseline)) + h
    return (math.sin(min(angle, math.pi) / 2) ** 2) - baseline


def positives_needed(effect: float, baseline: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Tumors per arm for a rise of ``effect`` from ``baseline`` sensitivity to be detectable."""
    from statsmodels.stats.power import NormalIndPower
    from statsmodels.stats.proportion import proportion_effectsize

    h = proportion_effectsize(baseline + effect, baseline)
    needed = NormalIndPower().solve_power(effect_size=h, nobs1=None, alpha=alpha, power=power, ratio=1.0)
    return math.ceil(round(float(needed), 3))  # the solver's root lands a hair above a whole number


def seed_effect_sd(seeds: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The mean per-seed difference, in standard deviations of those differences, a K-seed t-test detects."""
    from statsmodels.stats.power import TTestPower

    return float(TTestPower().solve_power(effect_size=None, nobs=seeds, alpha=alpha, power=power))


def locked_cohort_plan(effect: float, baseline: float, seed: int, seeds: int = 5, reference_cases: int = 2000) -> dict:
    """The locked cohort's size for ``effect`` (the positive control's) and what it then detects.

    The arterial-positive share is read from the phantom's own plan for ``seed`` (``reference_cases``
    planned scans, nothing rendered).
    """
    share = arterial_positive_share(seed, reference_cases)
    positives = positives_needed(effect, baseline)
    cases = math.ceil(positives / share)
    return {"arterial_positive_share": share, "positives_needed": positives, "cases": cases,
            "detectable_difference": detectable_difference(positives, baseline), "seeds": seeds,
            "seed_effect_sd": seed_effect_sd(seeds)}


def power_table(baseline: float, seed: int, cases: list[int], seeds: int = 5) -> pd.DataFrame:
    """Per cohort size: expected arterial positives and the smallest detectable sensitivity difference."""
    share = arterial_positive_share(seed, 2000)
    rows = []
    for n in cases:
        positives = max(1, int(round(n * share)))
        rows.append({"cases": n, "arterial_positives": positives,
                     "detectable_difference": round(detectable_difference(positives, baseline), 3), "seeds": seeds})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--effect", type=float, default=5 / 11,
                        help="the positive control's rise in arterial sensitivity to detect (default 5 of 11 tumors)")
    parser.add_argument("--baseline", type=float, default=0.1, help="the baseline's arterial sensitivity")
    parser.add_argument("--seed", type=int, default=1000, help="the locked cohort's phantom seed")
    parser.add_argument("--seeds", type=int, default=5, help="K, the seeds of the replicated study")
    args = parser.parse_args(argv)
    plan = locked_cohort_plan(args.effect, args.baseline, args.seed, args.seeds)
    print(f"arterial tumor scans: {plan['arterial_positive_share']:.1%} of the phantom's scans (seed {args.seed})")
    print(f"to detect +{args.effect:.2f} from {args.baseline:.2f} (alpha {ALPHA}, power {POWER:.0%}): "
          f"{plan['positives_needed']} arterial tumors, {plan['cases']} scans")
    print(f"with K = {args.seeds} seeds: the mean per-seed difference must reach {plan['seed_effect_sd']:.2f} "
          "standard deviations of the per-seed differences")
    print(power_table(args.baseline, args.seed, [100, 200, plan["cases"], 400, 600], args.seeds).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
