"""How large the locked test cohort must be, and what the study can detect on it (docs/explanation/study.md
"The locked test cohort").

The primary endpoint is the paired difference in arterial sensitivity, SynthX minus sham, on the
locked cohort's arterial tumors, decided by the exact McNemar test (two-sided, alpha 0.05); the
secondary, pre-specified claim is non-inferiority: the lower limit of Newcombe's 95% interval of
SynthX minus sham above -10 percentage points. Both are conditional on each arm's detections, so
their power is simulated with the same tests
(:mod:`lightning_modules.evaluation.small_counts`): each of n tumors falls in one cell of the
paired 2x2 table (both arms find it, sham only, SynthX only, neither) with probabilities set by the
two sensitivities and the correlation phi of the arms' detections on one tumor
(:func:`paired_cells`), and the power is the share of simulated tables the test decides in SynthX's
favour. K seeds average the training noise away, but every seed is evaluated on the same patients,
so the tumors, not the seeds, bound what one replicate can show.

The effect to detect is the positive control's: 5 more of 11 arterial tumors found than the
baseline (+0.45, the low end of what it showed on the development test split). The sham arm finds
far more than the baseline (67-83% of the arterial tumors on the locked cohort), so against sham
the same rise ends at a SynthX that finds every tumor; a SynthX closing half of the sham's misses
(the positive control closed half of the baseline's) is shown beside it.

The older figures against the baseline's sensitivity (Cohen's h for two independent proportions,
statsmodels' ``NormalIndPower``) and the seed-level t-test (``TTestPower``) are kept as
:func:`detectable_difference`, :func:`positives_needed` and :func:`seed_effect_sd`.

Run::

    python -m synthx.analysis.power                 # the tables of docs/design.md
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import lru_cache
from typing import Callable

import numpy as np
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



MARGIN = 0.10  # the non-inferiority margin, SynthX minus sham, pre-specified
DESIGNED_EFFECT = 5 / 11  # the positive control's rise in arterial sensitivity
SHAM_SENSITIVITIES = (0.67, 0.72, 0.78, 0.83)  # the sham arm's arterial sensitivity on the locked cohort, seeds 0-4
LOCKED_SEED = 1000  # the locked phantom's seed for the development seed 0 (the study's LOCKED_SEED_OFFSET)
LOCKED_CASES = 307  # the study's locked cohort size now (the study's LOCKED_CASES)
N_SIMULATIONS = 20_000


def paired_cells(sham: float, synthx: float, phi: float = 0.0) -> np.ndarray:
    """The paired 2x2 table's cell probabilities of one tumor: (both, sham only, SynthX only, neither).

    phi is the correlation of the two arms' detections of one tumor (0: independent given the
    sensitivities; above 0: a tumor one arm misses tends to be missed by the other too).

    Raises:
        ValueError: a sensitivity outside [0, 1], or a phi those sensitivities cannot have.
    """
    for name, value in (("sham", sham), ("synthx", synthx)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} sensitivity must lie in [0, 1], got {value}")
    both = sham * synthx + phi * math.sqrt(sham * (1 - sham) * synthx * (1 - synthx))
    cells = np.array([both, sham - both, synthx - both, 1.0 - sham - synthx + both])
    if (cells < -1e-12).any():
        raise ValueError(f"sensitivities {sham} (sham) and {synthx} (SynthX) cannot have a correlation of {phi}")
    return np.clip(cells, 0.0, 1.0) / np.clip(cells, 0.0, 1.0).sum()


def simulate_tables(tumors: int, cells: np.ndarray, n_simulations: int = N_SIMULATIONS, seed: int = 0) -> np.ndarray:
    """(n_simulations x 4) paired tables of ``tumors`` tumors, columns as in :func:`paired_cells`."""
    if tumors < 1:
        raise ValueError(f"the number of tumors must be at least 1, got {tumors}")
    return np.random.default_rng(seed).multinomial(int(tumors), cells, size=int(n_simulations))


@lru_cache(maxsize=None)
def _mcnemar_p(sham_only: int, synthx_only: int, exact: bool) -> float:
    if exact:
        from lightning_modules.evaluation.small_counts import mcnemar_exact_p

        return mcnemar_exact_p(sham_only, synthx_only)
    if sham_only + synthx_only == 0:
        return 1.0
    from statsmodels.stats.contingency_tables import mcnemar

    return float(mcnemar([[0, sham_only], [synthx_only, 0]], exact=False, correction=False).pvalue)


def mcnemar_p_values(sham_only: np.ndarray, synthx_only: np.ndarray, exact: bool = True) -> np.ndarray:
    """McNemar's p of each table from its discordant counts: exact (the study's,
    ``small_counts.mcnemar_exact_p``) or the asymptotic chi-square without continuity correction."""
    pairs, inverse = np.unique(np.stack([sham_only, synthx_only], axis=1), axis=0, return_inverse=True)
    values = np.array([_mcnemar_p(int(b), int(c), exact) for b, c in pairs])
    return values[inverse.reshape(-1)]


def superiority_power(sham: float, synthx: float, tumors: int, phi: float = 0.0, alpha: float = ALPHA,
                      n_simulations: int = N_SIMULATIONS, seed: int = 0, exact: bool = True) -> float:
    """The share of simulated tables in which McNemar's test rejects at ``alpha`` with SynthX ahead."""
    tables = simulate_tables(tumors, paired_cells(sham, synthx, phi), n_simulations, seed)
    p = mcnemar_p_values(tables[:, 1], tables[:, 2], exact)
    return float(np.mean((p < alpha) & (tables[:, 2] > tables[:, 1])))


def non_inferiority_power(sham: float, synthx: float, tumors: int, phi: float = 0.0, margin: float = MARGIN,
                          confidence: float = 0.95, n_simulations: int = N_SIMULATIONS, seed: int = 0) -> float:
    """The share of simulated tables whose Newcombe interval of SynthX minus sham lies above -``margin``."""
    from lightning_modules.evaluation.small_counts import newcombe_paired_intervals

    tables = simulate_tables(tumors, paired_cells(sham, synthx, phi), n_simulations, seed)
    # Newcombe's table: a both, b only the first (SynthX), c only the second (sham), d neither.
    low, _ = newcombe_paired_intervals(tables[:, 0], tables[:, 2], tables[:, 1], tables[:, 3], confidence)
    return float(np.mean(low > -margin))


def tumors_needed(power_at: Callable[[int], float], target: float = POWER, limit: int = 20_000) -> int | None:
    """The smallest number of tumors from which ``power_at`` reaches ``target`` (None beyond ``limit``).

    The exact test's power is a sawtooth in n, so the number returned is one whose next two counts
    also reach the target: doubling finds a count that does, bisection the first, and a step up
    follows while that count or one of the next two falls short.
    """
    high = 4
    while power_at(high) < target:
        if high >= limit:
            return None
        high = min(2 * high, limit)
    low = high // 2 if high > 4 else 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if power_at(middle) >= target else (middle, high)
    while high <= limit and not all(power_at(n) >= target for n in (high, high + 1, high + 2)):
        high += 1
    return high if high <= limit else None


def arterial_tumors(cases: int, seed: int = LOCKED_SEED) -> int:
    """The arterial tumor scans of a phantom cohort of that seed and size (its plan; nothing rendered)."""
    from lightning_modules.cohorts.phantom import sample_phantom_metadata

    table = sample_phantom_metadata(int(cases), int(seed))
    return int(((table["phase"] == "arterial") & (table["tumor"] == 1)).sum())


def locked_cases_for(tumors: int, seed: int = LOCKED_SEED) -> int:
    """The smallest locked cohort (scans) of phantom seed ``seed`` holding ``tumors`` arterial tumors.

    A smaller phantom cohort is a prefix of a larger one of the same seed, so the answer is where
    the running count of arterial tumors of one long plan reaches ``tumors``.
    """
    from lightning_modules.cohorts.phantom import sample_phantom_metadata

    cases = max(64, 2 * math.ceil(tumors / 0.05))
    while True:
        table = sample_phantom_metadata(cases, int(seed))
        running = ((table["phase"] == "arterial") & (table["tumor"] == 1)).cumsum().to_numpy()
        if running[-1] >= tumors:
            return int(np.argmax(running >= tumors)) + 1
        cases *= 2


def synthx_scenarios(sham: float, effect: float = DESIGNED_EFFECT) -> dict[str, float]:
    """SynthX's arterial sensitivity per scenario: the designed rise (capped at 1) and half the sham's misses closed."""
    return {f"+{effect:.2f} (designed, capped at 1)": min(1.0, sham + effect), "half of sham's misses": sham + (1 - sham) / 2}


def power_against_sham(shams=SHAM_SENSITIVITIES, phis=(0.0, 0.3), tumors: int | None = None,
                       effect: float = DESIGNED_EFFECT, margin: float = MARGIN, seed: int = LOCKED_SEED,
                       n_simulations: int = N_SIMULATIONS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The primary test's and the non-inferiority claim's power against sham, now and sized for 80%.

    Returns:
        (superiority, non_inferiority): per sham sensitivity, SynthX scenario and phi, the power on
        ``tumors`` arterial tumors (default: those of the locked cohort now), the tumors needed for
        80% and the locked cohort's scans holding them. Non-inferiority is powered at SynthX equal to sham.
    """
    tumors = arterial_tumors(LOCKED_CASES, seed) if tumors is None else int(tumors)
    superiority, non_inferiority = [], []
    for sham in shams:
        for scenario, synthx in synthx_scenarios(sham, effect).items():
            for phi in (phis if synthx < 1.0 else phis[:1]):  # a SynthX that finds every tumor has no phi
                def power_at(n, sham=sham, synthx=synthx, phi=phi):
                    return superiority_power(sham, synthx, n, phi, n_simulations=n_simulations)
                needed = tumors_needed(power_at)
                superiority.append({"sham": sham, "synthx": round(synthx, 3), "scenario": scenario, "phi": phi,
                                    f"power at {tumors}": power_at(tumors), "tumors_for_80%": needed,
                                    "scans_for_80%": None if needed is None else locked_cases_for(needed, seed)})
        for phi in phis:
            def ni_power_at(n, sham=sham, phi=phi):
                return non_inferiority_power(sham, sham, n, phi, margin, n_simulations=n_simulations)
            needed = tumors_needed(ni_power_at)
            non_inferiority.append({"sham": sham, "synthx": sham, "phi": phi, f"power at {tumors}": ni_power_at(tumors),
                                    "tumors_for_80%": needed,
                                    "scans_for_80%": None if needed is None else locked_cases_for(needed, seed)})
    return pd.DataFrame(superiority), pd.DataFrame(non_inferiority)


def recommended_locked_cases(shams=SHAM_SENSITIVITIES, effect: float = DESIGNED_EFFECT, seed: int = LOCKED_SEED,
                             n_simulations: int = N_SIMULATIONS) -> dict:
    """The locked cohort that gives the primary test 80% power for the designed rise at the
    highest sham sensitivity seen (the hardest case): its arterial tumors and scans."""
    sham = max(shams)
    synthx = min(1.0, sham + effect)
    tumors = tumors_needed(lambda n: superiority_power(sham, synthx, n, n_simulations=n_simulations))
    cases = None if tumors is None else locked_cases_for(tumors, seed)
    return {"sham": sham, "synthx": synthx, "tumors": tumors, "cases": cases, "seed": seed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--effect", type=float, default=DESIGNED_EFFECT,
                        help="the positive control's rise in arterial sensitivity to detect (default 5 of 11 tumors)")
    parser.add_argument("--sham", type=float, nargs="+", default=list(SHAM_SENSITIVITIES),
                        help="the sham arm's arterial sensitivities to plan for (default: those of the locked cohort's seeds)")
    parser.add_argument("--phi", type=float, nargs="+", default=[0.0, 0.3],
                        help="correlations of the two arms' detections of one tumor")
    parser.add_argument("--margin", type=float, default=MARGIN, help="the non-inferiority margin, SynthX minus sham")
    parser.add_argument("--seed", type=int, default=LOCKED_SEED, help="the locked cohort's phantom seed")
    parser.add_argument("--seeds", type=int, default=5, help="K, the seeds of the replicated study")
    parser.add_argument("--simulations", type=int, default=N_SIMULATIONS, help="simulated tables per power")
    args = parser.parse_args(argv)
    problems = [f"--sham {s}" for s in args.sham if not 0 < s < 1] + [f"--phi {p}" for p in args.phi if not -1 < p < 1]
    problems += [f"--{name} {value}" for name, value in (("effect", args.effect), ("margin", args.margin))
                 if not 0 < value < 1] + ([f"--simulations {args.simulations}"] if args.simulations < 100 else [])
    if problems:
        print(f"synthx.analysis.power: out of range: {', '.join(problems)} (sensitivities, effect and margin in (0, 1), "
              "phi in (-1, 1), at least 100 simulations)", file=sys.stderr)
        return 2
    tumors = arterial_tumors(LOCKED_CASES, args.seed)
    try:
        superiority, non_inferiority = power_against_sham(args.sham, tuple(args.phi), tumors, args.effect, args.margin,
                                                          args.seed, args.simulations)
    except ValueError as error:
        print(f"synthx.analysis.power: {error}", file=sys.stderr)
        return 2
    plan = recommended_locked_cases(args.sham, args.effect, args.seed, args.simulations)
    pd.set_option("display.width", 200)
    print(f"locked cohort now: {LOCKED_CASES} scans, {tumors} arterial tumors (phantom seed {args.seed}); "
          f"{args.simulations} simulated tables per power")
    print(f"\nprimary: exact McNemar, SynthX - sham, two-sided alpha {ALPHA}, SynthX ahead")
    print(superiority.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"\nnon-inferiority (secondary): Newcombe 95% lower limit of SynthX - sham above -{args.margin:.2f}, "
          "SynthX as sensitive as sham")
    print(non_inferiority.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if plan["tumors"] is None:
        print(f"\nno locked cohort of a sensible size gives 80% power for the rise at sham {plan['sham']:.2f}")
    else:
        print(f"\nrecommended locked cohort: {plan['cases']} scans ({plan['tumors']} arterial tumors), 80% power "
              f"for the designed rise at sham {plan['sham']:.2f}")
    print(f"with K = {args.seeds} seeds: the mean per-seed difference must reach {seed_effect_sd(args.seeds):.2f} "
          "standard deviations of the per-seed differences")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
