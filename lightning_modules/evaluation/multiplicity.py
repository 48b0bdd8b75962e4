"""Multiplicity adjustment of a family of tests: Holm's step-down procedure (used within each
attribute's supported groups of a paired comparison)."""

from __future__ import annotations

import numpy as np


def holm_adjust(p_values) -> np.ndarray:
    """Holm's step-down adjustment of a family of p-values; NaN entries are not tests (kept NaN, not counted).

    The k-th smallest of m p-values becomes max over j <= k of min(1, (m - j + 1) p_(j)); rejecting
    where the adjusted value is below alpha controls the family-wise error rate at alpha.
    """
    p = np.asarray(p_values, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    tested = np.flatnonzero(~np.isnan(p))
    m = len(tested)
    if m:
        order = tested[np.argsort(p[tested], kind="stable")]
        adjusted[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return adjusted
