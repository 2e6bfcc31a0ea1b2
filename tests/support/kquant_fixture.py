"""Inputs for the K-quant quantizers' test, and llama.cpp's own bytes for them (``tests/data/kquant_llamacpp.npz``).

Rewrite the file with llama.cpp's reference quantizers (``quantize_row_q4_K_ref`` / ``quantize_row_q6_K_ref``
from the ``xllamacpp`` wheel's library, ``pip install -e '.[bench]'``)::

    .venv/bin/python -m tests.support.kquant_fixture
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "kquant_llamacpp.npz"
ROUTINES = {"q4_k": ("quantize_row_q4_K_ref", 144), "q6_k": ("quantize_row_q6_K_ref", 210)}


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """Named float32 (rows, 512) matrices: ordinary weights at five scales and the corners of the search
    (one sign, zeros, constants, outliers, values on a grid, a 2^40 range, runs of zeros and subnormals)."""
    rng = np.random.default_rng(seed)
    out = {f"normal{i}": rng.standard_normal((2, 512)) * s for i, s in enumerate((1e-6, 1e-3, 0.02, 1.0, 300.0))}
    out["positive"] = np.abs(rng.standard_normal((2, 512))) + 0.5
    out["negative"] = -np.abs(rng.standard_normal((2, 512)))
    const = np.ones((4, 512))
    const[1] = -2
    const[2] = 1e-20
    const[3] = 0
    out["constant"] = const
    outliers = rng.standard_normal((2, 512))
    outliers[:, ::7] *= 50
    out["outliers"] = outliers
    out["grid"] = rng.integers(-3, 4, (2, 512)) * 0.25
    out["wide"] = rng.standard_normal((2, 512)) * np.exp(rng.uniform(-30, 10, (2, 512)))
    holes = rng.standard_normal((2, 512))
    holes[:, 16:32] = 0
    holes[:, 100:140] = 1e-30
    out["holes"] = holes
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def llamacpp_quantize(lib: ctypes.CDLL, x: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 (rows, K / 256 * block bytes): ``x`` by llama.cpp's reference quantizer of ``fmt`` in ``lib``."""
    name, block_bytes = ROUTINES[fmt]
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // 256 * block_bytes), np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def llamacpp_library() -> ctypes.CDLL | None:
    """The ``xllamacpp`` wheel's library (llama.cpp built for the CPU), or None where it is not installed."""
    try:
        import xllamacpp
    except ImportError:
        return None
    found = sorted(Path(xllamacpp.__file__).parent.glob("xllamacpp*.so"))
    return ctypes.CDLL(str(found[0])) if found else None


def main() -> None:
    lib = llamacpp_library()
    if lib is None:
        raise SystemExit("xllamacpp is not installed: pip install -e '.[bench]'")
    arrays = {}
    for name, x in inputs().items():
        arrays[f"x/{name}"] = x
        for fmt in ROUTINES:
            arrays[f"{fmt}/{name}"] = llamacpp_quantize(lib, x, fmt)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
