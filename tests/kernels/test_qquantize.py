"""Float weights written as Q4_K and Q6_K (``qquantize.c`` through ``qblocks.quantize``) hold the bytes llama.cpp's
reference quantizers write: against a fixture recorded from llama.cpp (``tests/support/kquant_fixture.py``)
always, and against llama.cpp's library itself where the ``bench`` extra installed it, on fresh inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.kernels import fma, qblocks
from tests.support import kquant_fixture

FMA_OK, FMA_WHY = fma.available()
pytestmark = pytest.mark.skipif(not FMA_OK, reason=f"the fma kernels cannot run here: {FMA_WHY}")


def _ours(x: np.ndarray, fmt: str) -> np.ndarray:
    return qblocks.quantize(torch.from_numpy(x), fmt).data.numpy()


def test_the_bytes_are_llama_cpps_recorded_ones():
    recorded = np.load(kquant_fixture.FIXTURE)
    names = [key[2:] for key in recorded.files if key.startswith("x/")]
    assert len(names) >= 10
    for name in names:
        x = recorded[f"x/{name}"]
        for fmt in kquant_fixture.ROUTINES:
            want, got = recorded[f"{fmt}/{name}"], _ours(x, fmt)
            assert got.shape == want.shape and np.array_equal(got, want), (fmt, name, np.argwhere(got != want)[:4])


def test_the_bytes_are_llama_cpps_on_fresh_inputs_and_threads_do_not_matter():
    lib = kquant_fixture.llamacpp_library()
    if lib is None:
        pytest.skip("llama.cpp's library (xllamacpp, the bench extra) is not installed; the recorded fixture covers it")
    cases = dict(kquant_fixture.inputs(seed=11))
    cases["layer"] = (np.random.default_rng(5).standard_normal((96, 1536)) * 0.05).astype(np.float32)
    before = fma.threads()
    try:
        for threads in (1, 2, 3):
            fma.set_threads(threads)
            for name, x in cases.items():
                for fmt in kquant_fixture.ROUTINES:
                    assert np.array_equal(_ours(x, fmt), kquant_fixture.llamacpp_quantize(lib, x, fmt)), (fmt, name)
    finally:
        fma.set_threads(before)


def test_the_packaged_kernel_sources_are_the_built_ones():
    """A wheel carries every file the run-time fallback compiles and the digest reads."""
    import tomllib
    from pathlib import Path

    from swarm.kernels import build

    pyproject = tomllib.loads((Path(build.HERE).parents[1] / "pyproject.toml").read_text())
    packaged = pyproject["tool"]["setuptools"]["package-data"]["swarm.kernels"]
    assert sorted(packaged) == sorted((*build.C_SOURCES, *build.HEADERS))
