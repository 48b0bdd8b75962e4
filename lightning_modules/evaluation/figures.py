"""Figures of evaluation results: per-subgroup metrics with CI bars, and per-subgroup differences.

Matplotlib with the Agg backend (no display needed); the caller logs and closes the figure.

Example::

    figure = subgroup_figure(table, title="test")
    figure.savefig("subgroups.png"); close(figure)
"""

from __future__ import annotations

import math

import pandas as pd


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def close(figure) -> None:
    """Free a figure's memory once it is saved or logged."""
    _pyplot().close(figure)


def subgroup_figure(table: pd.DataFrame, title: str = "", metrics=("sensitivity", "f1")):
    """Per-subgroup point estimates with CI bars (where the table has them), one panel per metric."""
    plt = _pyplot()
    rows = table[table["attribute"] != "overall"].reset_index(drop=True)
    labels = [f"{a}: {g} (n={int(n)})" for a, g, n in zip(rows["attribute"], rows["group"], rows["n"])]
    figure, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 0.32 * max(len(rows), 4) + 1.5), sharey=True)
    axes = list(axes) if len(metrics) > 1 else [axes]
    positions = list(range(len(rows)))
    for axis, metric in zip(axes, metrics):
        values = rows[metric].astype(float)
        if f"{metric}_ci_low" in rows:
            low = (values - rows[f"{metric}_ci_low"].astype(float)).clip(lower=0)
            high = (rows[f"{metric}_ci_high"].astype(float) - values).clip(lower=0)
            axis.errorbar(values, positions, xerr=[low.fillna(0), high.fillna(0)], fmt="o", capsize=3)
        else:
            axis.plot(values, positions, "o")
        overall = table.loc[table["attribute"] == "overall", metric]
        if len(overall) and not math.isnan(float(overall.iloc[0])):
            axis.axvline(float(overall.iloc[0]), color="grey", linestyle="--", linewidth=1, label="overall")
            axis.legend(loc="lower left")
        axis.set_xlim(-0.02, 1.02)
        axis.set_xlabel(metric)
        axis.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(positions)
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def comparison_figure(comparison: pd.DataFrame, metric: str = "f1", operating_point: str | None = None):
    """Per-subgroup difference (other minus baseline) of one metric with its paired CI.

    Args:
        comparison: the table of ``runs.compare``.
        metric: the metric to plot.
        operating_point: plot only this operating point's rows (default: all, labelled).
    """
    rows = comparison[comparison["metric"] == metric]
    if operating_point is not None and "operating_point" in rows:
        rows = rows[rows["operating_point"] == operating_point]
    label = rows["run"].astype(str)
    if operating_point is None and "operating_point" in rows:
        label = label + " @ " + rows["operating_point"].astype(str)
    table = pd.DataFrame(
        {
            "attribute": rows["attribute"],
            "group": rows["group"].astype(str) + " [" + label + "]",
            "n": rows["n"],
            metric: rows["delta"],
            f"{metric}_ci_low": rows["ci_low"],
            f"{metric}_ci_high": rows["ci_high"],
        }
    )
    figure = subgroup_figure(table, metrics=(metric,))
    axis = figure.axes[0]
    axis.set_xlim(-1.02, 1.02)
    axis.axvline(0.0, color="black", linewidth=1)
    axis.set_xlabel(f"{metric}: augmented minus baseline (paired 95% CI)")
    return figure
