"""How the report writes a number, a subgroup, a significance mark, a table and a figure in HTML."""

from __future__ import annotations

import base64
import io

import pandas as pd

from lightning_modules.workflows.evaluate import percent, significance_mark
from synthx.labels import attribute_label, group_label


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
    try:
        return significance_mark(row).strip()
    except (KeyError, TypeError, ValueError):
        return ""


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
