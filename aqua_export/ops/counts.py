"""The token counts of ops.rules in numpy, for what sizes a cache before any node runs (runtime.caches): serving a
folder needs no torch. ops.rules.budget takes tensors too and calls this for everything else."""

from __future__ import annotations

import numpy as np


def budget(ratio: float, n) -> np.ndarray:
    """Tokens AQUA-H2O keeps after n real ones (int64 array): max(1, ceil(ratio n)), with ops.rules.budget's slack."""
    x = np.asarray(n, np.float64)
    return np.maximum(np.ceil(ratio * x - 1e-6 * x - 1e-9), 1).astype(np.int64)


def slots_needed(ratio: float, n_real) -> int:
    """Slots a cache must have for rows that will have seen n_real [B] real tokens: live slots never exceed
    budget + 1 (one token in, at most one out), and never the tokens seen."""
    n = np.asarray(n_real, np.int64)
    return int(np.minimum(n, budget(ratio, n) + 1).max(initial=0))
