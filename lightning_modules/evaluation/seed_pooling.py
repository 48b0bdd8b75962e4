"""Seeds as the unit of inference: K paired replicates of a study pooled, subgroup by subgroup
(docs/explanation/detection-and-statistics.md "Seeds as the unit of inference").

A replicate is one training seed running every arm of a study (baseline, sham, SynthX, ...), each
arm evaluated on the same test patients. For an arm pair (new minus reference, e.g. SynthX minus
sham) each seed gives a paired difference per subgroup and metric; the pooled estimate is their
mean across seeds. Its interval is Student's t over the seeds (:func:`seed_t_interval`): the mean
plus or minus t(K-1) times the standard error of the K per-seed differences. Each seed's
difference already carries its patients' sampling noise and its training noise, so their spread
across seeds is the variance of the mean, and the t quantile carries the uncertainty of
estimating it from K values: on simulated null studies this interval holds its 5% level where
the two-level bootstrap beside it does not (``python -m
lightning_modules.evaluation.pooling_level``).

The two-level bootstrap is kept as a secondary column (``boot_ci_low``, ``boot_ci_high``,
``p_bootstrap``): a resample draws K seeds with replacement, then patients with replacement, and
the pooled difference is recomputed on both draws. The seeds share their test patients, so one
patient draw is applied to every seed of a resample (the patients' draws are those of
:mod:`~lightning_modules.evaluation.bootstrap`, from the evaluation set's seed). The seed level is
a sample of K: its bootstrap spread is the plug-in (K-1)/K of the variance, so the seed-level
deviation of each resample is scaled by sqrt(K/(K-1)). With K = 5 its percentile interval is too
narrow when the seeds differ much (it cannot carry the heavier tails of a five-value mean).

Per row: the mean difference, its t-interval and p, the bootstrap's interval and p, how many seeds found
the difference above and below 0, and each seed's own difference. Pure functions: records in,
table out (the study's replicates workflow reads the replicates from MLflow).

Example::

    replicates = {"0": {"sham": ArmRecords(sham_0, 150.0), "synthx": ArmRecords(synthx_0, 120.0)},
                  "1": {"sham": ArmRecords(sham_1, 180.0), "synthx": ArmRecords(synthx_1, 90.0)}}
    table = pool_seeds(replicates, [("synthx", "sham")], n_resamples=2000)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import scipy.stats

from lightning_modules.evaluation.bootstrap import (
    DEFAULT_MEMORY_BUDGET_MB,
    _block_size,
    _check_settings,
    _defined,
    _exact_float_dtype,
    _resolve_seed,
    evaluation_set_hash,
    patient_weight_blocks,
    percentile_interval,
)
from lightning_modules.evaluation.paired_comparison import (
    _check_same_evaluation_set,
    _comparison_columns,
    bootstrap_p_values,
)
from lightning_modules.evaluation.detection import WeightedSubgroupEvaluator
from lightning_modules.evaluation.records import ATTRIBUTES
from lightning_modules.evaluation.subgroups import supported

POOLED_METRICS = ("sensitivity", "specificity", "auc")
# The seed draws get a stream of their own, apart from the patients' (SeedSequence spawn keys).
_SEED_STREAM = 2**32


@dataclass(frozen=True)
class ArmRecords:
    """One arm of one replicate: its per-case test records and its operating point m."""

    records: pd.DataFrame
    threshold: float


def comparison_name(arm: str, reference: str) -> str:
    """``synthx - sham``: the label of an arm pair (the difference is arm minus reference)."""
    return f"{arm} - {reference}"


def _evaluators(replicates: Mapping[str, Mapping[str, ArmRecords]], arms: Sequence[str], score: str,
                attributes: Sequence[str]) -> dict[tuple[str, str], WeightedSubgroupEvaluator]:
    """One evaluator per (seed, arm), all on the subgroups and patients of the first."""
    seeds = list(replicates)
    first = replicates[seeds[0]][arms[0]]
    reference = WeightedSubgroupEvaluator(first.records, first.threshold, score=score, attributes=attributes)
    columns = _comparison_columns(first.records, attributes)
    evaluators = {}
    for seed in seeds:
        for arm in arms:
            if arm not in replicates[seed]:
                raise ValueError(f"replicate {seed} has no arm {arm!r} (it has {', '.join(replicates[seed])})")
            given = replicates[seed][arm]
            try:
                _check_same_evaluation_set(first.records, given.records, attributes, reference=columns)
            except ValueError as error:
                raise ValueError(f"replicate {seed}, arm {arm}: {error}") from error
            evaluators[seed, arm] = WeightedSubgroupEvaluator.on_same_cases(reference, given.records, given.threshold)
    return evaluators


def seed_counts(n_seeds: int, n_resamples: int, seed: int) -> np.ndarray:
    """How often each of the K seeds is drawn in each resample: (n_resamples x K), rows summing to K."""
    rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(_SEED_STREAM, n_seeds)))
    return rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=n_resamples)


def pooled_resamples(deltas: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The pooled difference of each resample from per-seed differences on its patient draw.

    Args:
        deltas: (resamples x K seeds x rows) each seed's difference on the resample's patients,
            NaN where undefined.
        counts: (resamples x K) how often each seed is drawn (:func:`seed_counts`).

    Returns:
        (resamples x rows): the mean over all seeds plus sqrt(K/(K-1)) times the deviation of the
        drawn seeds' weighted mean from it (NaN where no drawn seed defines the difference).
    """
    n_seeds = deltas.shape[1]
    defined = ~np.isnan(deltas)
    values = np.where(defined, deltas, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        everyone = values.sum(axis=1) / defined.sum(axis=1)
        weights = counts[:, :, None] * defined
        drawn = (weights * values).sum(axis=1) / weights.sum(axis=1)
    scale = np.sqrt(n_seeds / (n_seeds - 1)) if n_seeds > 1 else 1.0
    return everyone + scale * (drawn - everyone)


def seed_t_interval(per_seed: np.ndarray, confidence: float = 0.95) -> dict[str, np.ndarray]:
    """Student's t interval and two-sided p of the mean of per-seed differences, per row.

    Args:
        per_seed: (K seeds x rows) each seed's difference, NaN where undefined (left out of its row).
        confidence: CI level.

    Returns:
        per row: ``seeds`` (defined values k), ``mean_delta``, ``ci_low``, ``ci_high`` (mean -+
        t(k-1) quantile x sd / sqrt(k)) and ``p_value`` (the one-sample t-test of mean 0). NaN
        with fewer than two defined seeds. Seeds that all agree have no spread to estimate the
        variance from: at a difference of 0 the interval is [0, 0] with p = 1; at any other
        difference the interval and p are NaN (the t-test cannot judge it).
    """
    per_seed = np.asarray(per_seed, dtype=float)
    defined = ~np.isnan(per_seed)
    count = defined.sum(axis=0)
    values = np.where(defined, per_seed, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = values.sum(axis=0) / count
        squares = np.where(defined, (per_seed - mean) ** 2, 0.0).sum(axis=0)
        error = np.sqrt(squares / (count - 1) / count)
        quantile = scipy.stats.t.ppf(0.5 + confidence / 2, count - 1)
        statistic = np.abs(mean) / error
        p = 2 * scipy.stats.t.sf(statistic, count - 1)
    spreadless = error <= 1e-12 * np.maximum(1.0, np.abs(mean))
    p = np.where(spreadless, np.where(np.abs(mean) <= 1e-12, 1.0, np.nan), p)
    half = np.where(spreadless, np.where(np.abs(mean) <= 1e-12, 0.0, np.nan), quantile * error)
    enough = count >= 2
    return {"seeds": count, "mean_delta": np.where(count > 0, mean, np.nan),
            "ci_low": np.where(enough, mean - half, np.nan), "ci_high": np.where(enough, mean + half, np.nan),
            "p_value": np.where(enough, p, np.nan)}


def pool_deltas(per_seed: np.ndarray, resampled: np.ndarray, counts: np.ndarray,
                confidence: float = 0.95) -> dict[str, np.ndarray]:
    """The pooled statistics of per-seed paired differences (arrays in, arrays out).

    Args:
        per_seed: (K seeds x rows) each seed's difference on all patients, NaN where undefined.
        resampled: (resamples x K x rows) each seed's difference on each resample's patient draw.
        counts: (resamples x K) the seed draws (:func:`seed_counts`).
        confidence: CI level.

    Returns:
        per row: ``seeds`` (seeds defining the difference), ``mean_delta``, ``ci_low``, ``ci_high``
        and ``p_value`` (the headline: :func:`seed_t_interval`, or the bootstrap's where the seeds
        all agree on a difference other than 0, e.g. replicates that are one model),
        ``interval`` (``t`` or ``bootstrap``: which one the headline is), ``boot_ci_low``, ``boot_ci_high``
        (percentile interval of :func:`pooled_resamples`; NaN where the mean is undefined),
        ``defined_fraction``, ``p_bootstrap``
        (:func:`~lightning_modules.evaluation.paired_comparison.bootstrap_p_values`), ``seeds_up`` and ``seeds_down``.
    """
    pooled = seed_t_interval(per_seed, confidence)
    mean = pooled["mean_delta"]
    samples = pooled_resamples(resampled, counts)
    low, high = percentile_interval(samples, confidence)
    undefined = np.isnan(mean)
    boot_low, boot_high = np.where(undefined, np.nan, low), np.where(undefined, np.nan, high)
    p_bootstrap = bootstrap_p_values(samples, mean)
    agree = (pooled["seeds"] >= 2) & np.isnan(pooled["p_value"])  # every seed the same difference, not 0
    return {
        **pooled,
        "ci_low": np.where(agree, boot_low, pooled["ci_low"]),
        "ci_high": np.where(agree, boot_high, pooled["ci_high"]),
        "p_value": np.where(agree, p_bootstrap, pooled["p_value"]),
        "interval": np.where(agree, "bootstrap", "t"),
        "boot_ci_low": boot_low,
        "boot_ci_high": boot_high,
        "defined_fraction": (~np.isnan(samples)).mean(axis=0),
        "p_bootstrap": p_bootstrap,
        "seeds_up": (per_seed > 0).sum(axis=0),
        "seeds_down": (per_seed < 0).sum(axis=0),
    }


def pool_seeds(
    replicates: Mapping[str, Mapping[str, ArmRecords]],
    comparisons: Sequence[tuple[str, str]],
    n_resamples: int = 2000,
    confidence: float = 0.95,
    score: str = "volume",
    metrics: Sequence[str] = POOLED_METRICS,
    attributes: Sequence[str] = ATTRIBUTES,
    seed: int | None = None,
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
) -> pd.DataFrame:
    """Pool K paired replicates: per arm pair, subgroup and metric, the mean difference across seeds.

    Args:
        replicates: seed label -> arm name -> :class:`ArmRecords`; every arm of every seed evaluated
            on the same cases (same patients, labels and attributes).
        comparisons: ``(arm, reference)`` pairs; the difference is arm minus reference, per seed.
        n_resamples: resamples of the secondary two-level bootstrap.
        confidence: CI level.
        score: ``volume`` or ``max_prob``.
        metrics: metrics to pool (among sensitivity, specificity, f1, auc, auc_binary).
        attributes: attributes to split by.
        seed: an explicit bootstrap seed instead of the evaluation set's.
        memory_budget_mb: bound on the working memory of one block of resamples.

    Returns:
        One row per (comparison, attribute, group, metric): ``comparison``, ``arm``, ``reference``,
        the key, ``n_patients``, ``positives``, ``negatives``, ``seeds`` (replicates whose
        difference is defined), ``mean_delta``, ``ci_low``, ``ci_high`` and ``p_value`` (the
        t-interval over seeds; the bootstrap's where the seeds all agree on a difference other
        than 0), ``interval`` (which of the two), ``boot_ci_low``, ``boot_ci_high``, ``defined_fraction`` and
        ``p_bootstrap`` (the two-level bootstrap), ``seeds_up`` / ``seeds_down`` (seeds whose
        difference is above / below 0), ``supported`` and ``significant`` (the t-interval excludes
        0 and the subgroup supports it), then ``delta <seed>`` per replicate.

    Raises:
        ValueError: fewer than two replicates, an arm missing from a replicate, or replicates or
            arms evaluated on different sets.
    """
    _check_settings(n_resamples, confidence)
    seeds = [str(s) for s in replicates]
    replicates = {str(s): arms for s, arms in replicates.items()}
    if len(seeds) < 2:
        raise ValueError(f"pooling needs at least two replicates (seeds), got {len(seeds)}")
    if not comparisons:
        raise ValueError("name at least one arm pair to compare, e.g. ('synthx', 'sham')")
    arms = list(dict.fromkeys(arm for pair in comparisons for arm in pair))
    evaluators = _evaluators(replicates, arms, score, attributes)
    first = evaluators[seeds[0], arms[0]]
    ones = np.ones(first.n_patients)
    points = {key: evaluator.evaluate(ones) for key, evaluator in evaluators.items()}

    seed = _resolve_seed(first.case_ids, seed)
    counts = seed_counts(len(seeds), int(n_resamples), seed)
    n_rows = len(first.rows)
    # resamples x seeds x rows, per (comparison, metric)
    deltas = {(pair, metric): np.empty((n_resamples, len(seeds), n_rows)) for pair in comparisons for metric in metrics}
    block_size = _block_size(list(evaluators.values()), n_resamples, memory_budget_mb)
    for start, block in patient_weight_blocks(first.n_patients, n_resamples, seed, block_size, _exact_float_dtype(first)):
        stop = start + block.shape[1]
        statistics = {key: evaluator.evaluate_columns(block) for key, evaluator in evaluators.items()}
        for (arm, reference) in comparisons:
            for metric in metrics:
                for index, name in enumerate(seeds):
                    deltas[(arm, reference), metric][start:stop, index] = (
                        _defined(statistics[name, arm], metric) - _defined(statistics[name, reference], metric))

    frames = []
    for arm, reference in comparisons:
        for metric in metrics:
            per_seed = np.stack([_defined(points[name, arm], metric)[0] - _defined(points[name, reference], metric)[0]
                                 for name in seeds])  # seeds x rows
            pooled = pool_deltas(per_seed, deltas[(arm, reference), metric], counts, confidence)
            frame = first.rows.copy()
            frame.insert(0, "comparison", comparison_name(arm, reference))
            frame.insert(1, "arm", arm)
            frame.insert(2, "reference", reference)
            frame["metric"] = metric
            frame["n_patients"] = first.row_patients
            base = points[seeds[0], reference]
            frame["positives"] = np.rint(base["positives"][0]).astype(np.int64)
            frame["negatives"] = np.rint(base["negatives"][0]).astype(np.int64)
            for column, values in pooled.items():
                frame[column] = values
            frame["supported"] = supported(frame["n_patients"], frame["positives"], frame["negatives"], metric)
            frame["significant"] = ((frame["ci_low"] > 0) | (frame["ci_high"] < 0)) & frame["supported"]
            for index, name in enumerate(seeds):
                frame[f"delta {name}"] = per_seed[index]
            frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    table.attrs.update({"seeds": seeds, "n_resamples": int(n_resamples), "confidence": float(confidence),
                        "score": score, "evaluation_set_sha256": evaluation_set_hash(first.case_ids)})
    return table


def format_pooled(table: pd.DataFrame) -> str:
    """A plain-text table: per comparison, subgroup and metric the mean difference [CI], seeds up/down."""
    seeds = [c[len("delta "):] for c in table.columns if c.startswith("delta ")]
    header = ["comparison", "subgroup", "metric", "pat", "pos", "neg", "mean [95% CI]", "p", "seeds +/-",
              *[f"seed {s}" for s in seeds]]
    lines = []
    for row in table.to_dict("records"):
        if np.isnan(row["mean_delta"]):
            pooled, p = "-", "-"
        else:
            mark = "*" if row["significant"] else ("~" if (row["ci_low"] > 0 or row["ci_high"] < 0) else "")
            method = " b" if row.get("interval") == "bootstrap" else ""
            pooled = f"{row['mean_delta']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]{method}{mark}"
            p = f"{row['p_value']:.3f}"
        cells = [row["comparison"], f"{row['attribute']}:{row['group']}", row["metric"], str(row["n_patients"]),
                 str(row["positives"]), str(row["negatives"]), pooled, p, f"{row['seeds_up']}/{row['seeds_down']}"]
        cells += ["-" if np.isnan(row[f"delta {s}"]) else f"{row[f'delta {s}']:+.3f}" for s in seeds]
        lines.append(cells)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *lines)]
    shown = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in [header, *lines])
    notes = [f"mean: the difference averaged over {len(seeds)} seeds; CI and p: Student's t over the seeds' differences "
             "(k - 1 degrees of freedom for the k seeds that define a row; docs/explanation/detection-and-statistics.md \"Seeds as the unit of inference\").",
             "b: the seeds all agree on one difference, so the CI and p are the two-level bootstrap's.",
             "* the CI excludes 0 and the subgroup supports it; ~ the CI excludes 0 below the support rule.",
             "seeds +/-: seeds whose own difference is above / below 0."]
    return "\n".join([shown, "", *notes])
