"""Statistics for the sampling tests."""

from __future__ import annotations


def chi2_critical(dof: int, z: float = 3.0902) -> float:
    """Chi-square critical value at p = 0.001 (z = 3.0902), Wilson-Hilferty approximation
    (within about 2% of the exact value for dof >= 3, slightly lenient; exact below that)."""
    exact = {1: 10.83, 2: 13.82}
    if dof in exact:
        return exact[dof]
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
