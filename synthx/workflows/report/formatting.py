"""How the report writes a number, a subgroup, a significance mark, a table and a figure in HTML."""

from __future__ import annotations

import base64
import io

import pandas as pd

from lightning_modules.workflows.evaluate import percent
from synthx.analysis.endpoint import family_mark, shown_interval
from synthx.analysis.labels import attribute_label, group_label


def figure_html(figure) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(figure)
    return f'<img alt="figure" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def pct(value, sign: bool = False) -> str:
    """A fraction as % with one decimal, as the comparison tables print it."""
    return percent(value, sign)


def table_html(frame: pd.DataFrame) -> str:
    return f"<div class='scroll'>{frame.to_html(index=False, escape=True, na_rep='-', border=0, classes='data')}</div>"


def subgroup_name(attribute, group) -> str:
    return "All scans" if str(attribute) == "overall" else f"{attribute_label(attribute)}: {group_label(attribute, group)}"


def cell_mark(row) -> str:
    """A row's significance mark from its family's Holm adjustment (:func:`synthx.analysis.endpoint.family_mark`);
    none when the row cannot be judged."""
    try:
        return family_mark(row)
    except (KeyError, TypeError, ValueError):
        return ""


def difference_cell(row) -> str:
    """``+20.0 [+10.0, +30.0] **``: a row's difference with its shown interval and its mark, in points."""
    _, low, high = shown_interval(row)
    return f"{pct(row['delta'], True)} [{pct(low, True)}, {pct(high, True)}] {cell_mark(row)}".rstrip()


MARKS_NOTE = ("** significant after Holm's correction over its family (the primary endpoint alone; every other "
              "row of the augmented arm against its references; sham against the baseline), * significant by its own test "
              "only (exact McNemar for sensitivity and specificity, DeLong for AUC, the bootstrap with McNemar "
              "for F1), ~ the test rejects but the subgroup is below the support rule; no mark where the "
              "interval shown spans 0")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
