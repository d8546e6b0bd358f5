"""A small Nelder-Mead minimiser (numpy only; the project does not depend on scipy)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def nelder_mead(
    fn: Callable[[np.ndarray], float],
    x0: np.ndarray,
    step: float = 0.5,
    iterations: int = 2000,
    tolerance: float = 1e-10,
) -> np.ndarray:
    """The point of the simplex around `x0` (edges `step`) where `fn` ended lowest, after
    at most `iterations` moves or once the values differ by less than `tolerance`."""
    n = len(x0)
    simplex = [np.asarray(x0, dtype=float)]
    for i in range(n):
        point = simplex[0].copy()
        point[i] += step
        simplex.append(point)
    values = [fn(p) for p in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        f_reflected = fn(reflected)
        if f_reflected < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            f_expanded = fn(expanded)
            simplex[-1], values[-1] = (
                (expanded, f_expanded) if f_expanded < f_reflected else (reflected, f_reflected)
            )
        elif f_reflected < values[-2]:
            simplex[-1], values[-1] = reflected, f_reflected
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            f_contracted = fn(contracted)
            if f_contracted < values[-1]:
                simplex[-1], values[-1] = contracted, f_contracted
            else:  # shrink towards the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (p - simplex[0]) for p in simplex[1:]]
                values = [values[0]] + [fn(p) for p in simplex[1:]]
    return simplex[int(np.argmin(values))]
