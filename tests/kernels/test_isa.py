"""One arithmetic on every instruction set: the fma kernels' AVX-512, AVX2 and NEON paths give the same
bits for GEMMs (float32 and bfloat16 weights), attention (float32 and bfloat16 caches), RMSNorm and
SiLU; a whole block in either dtype gives the same bits in every ISA; the NEON path is checked under
qemu against the x86 paths; the installed extension serves a host with no compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarm.kernels import build, fma
from swarm.model.block import load_block
from swarm.ranges import LayerRange

FMA_OK, FMA_WHY = fma.available()
pytestmark = pytest.mark.skipif(not FMA_OK, reason=f"the fma kernels cannot run here: {FMA_WHY}")
HARNESS = Path(__file__).resolve().parents[1] / "support" / "kernel_harness.c"


def _isas() -> tuple[str, ...]:
    return fma.describe().isas if FMA_OK else ()


def _each_isa(run):
    """``run()`` under every ISA this CPU has (the first is the one a stage picks), restoring the choice."""
    before = fma.isa()
    try:
        results = {}
        for name in _isas():
            fma.use_isa(name)
            results[name] = run()
        return results
    finally:
        fma.use_isa(before)


def _kernel_outputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(44)
    outs = []
    for m, k, n in ((1, 576, 1536), (5, 576, 577), (37, 40, 172), (3, 13, 7), (64, 200, 96), (25, 100, 1)):
        x, w, b = (torch.randn(*shape, generator=gen) for shape in ((m, k), (n, k), (n,)))
        outs += [fma.linear(x, w, b), fma.linear(x, w.bfloat16()), fma.linear(x, w.bfloat16(), b)]
    for t, h, hkv, dh, pos, window in ((9, 9, 3, 64, 140, None), (1, 9, 3, 64, 300, None), (5, 8, 2, 16, 20, 5),
                                       (30, 4, 4, 13, 0, None), (70, 6, 3, 8, 60, 70)):
        q = torch.randn(t, h, dh, generator=gen)
        keys, values = torch.randn(pos + t, hkv, dh, generator=gen), torch.randn(pos + t, hkv, dh, generator=gen)
        outs += [fma.attention(q, keys, values, pos, dh ** -0.5, window),
                 fma.attention(q, keys.bfloat16(), values.bfloat16(), pos, dh ** -0.5, window)]
    x, w = torch.randn(3, 7, 41, generator=gen), torch.randn(41, generator=gen)
    outs += [fma.rms_norm(x, w, 1e-5), fma.silu(x * 40)]
    return outs


def test_every_isa_gives_the_same_bits_for_every_kernel():
    """The CPU's ISAs (AVX-512 and AVX2 on an AVX-512 x86, AVX2 alone on others) agree bit for bit, and
    the results are the functions they claim to be (float64 references, close)."""
    results = _each_isa(_kernel_outputs)
    first, *others = results.values()
    for name in list(results)[1:]:
        for i, (a, b) in enumerate(zip(first, results[name])):
            assert torch.equal(a, b), f"{name} differs from {list(results)[0]} at output {i}"
    gen = torch.Generator().manual_seed(44)
    x, w, b = torch.randn(1, 576, generator=gen), torch.randn(1536, 576, generator=gen), torch.randn(1536, generator=gen)
    torch.testing.assert_close(first[0], F.linear(x.double(), w.double(), b.double()).float(), rtol=1e-4, atol=1e-4)
    if len(results) == 1:
        pytest.skip(f"this CPU runs one ISA only ({list(results)[0]}): nothing to compare it with here")


def test_bfloat16_operands_give_the_bits_of_their_float_copies():
    """A bfloat16 weight or cache is widened exactly, so the bits equal those of its float32 copy."""
    torch.manual_seed(3)
    x, w = torch.randn(11, 70), torch.randn(33, 70).bfloat16()
    assert torch.equal(fma.linear(x, w), fma.linear(x, w.float()))
    q, keys, values = torch.randn(6, 4, 16), torch.randn(80, 2, 16).bfloat16(), torch.randn(80, 2, 16).bfloat16()
    assert torch.equal(fma.attention(q, keys, values, 74, 0.25), fma.attention(q, keys.float(), values.float(), 74, 0.25))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fma.attention(q, keys.half(), values.half(), 74, 0.25)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_block_gives_the_same_bits_in_every_isa(synthetic, dtype):
    """A whole decoder block (GEMMs, attention, norms, activations, the rotary table in torch) gives the
    same output bits in every ISA: a prefill chunk, then a decode row."""
    model = synthetic("llama", "float32", hidden_size=40, intermediate_size=172)
    block = load_block(model, LayerRange(1, 3), dtype=dtype, device="cpu")
    assert block.kernel_mode == "fma"
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 13, block.hidden_size, generator=gen).to(block.dtype)

    def run():
        cache = block.new_cache(32)
        return [block.forward_batch([(cache, 0, x[:, :12])], tile=1)[0],
                block.forward_batch([(cache, 12, x[:, 12:])], tile=1)[0]]

    results = list(_each_isa(run).values())
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    assert results[0][0].dtype == block.dtype and results[0][0].isfinite().all()


def _cc_for(target: str) -> list[str] | None:
    cc = shutil.which("aarch64-linux-gnu-gcc" if target == "aarch64" else "gcc") or \
        (shutil.which("cc") if target != "aarch64" else None)
    return [cc] if cc else None


def _harness(tmp_path: Path, target: str) -> Path:
    out = tmp_path / f"harness-{target}"
    flags = tuple(f for f in build.FLAGS if f != "-fPIC")
    sources = (HARNESS, *(build.HERE / name for name in build.C_SOURCES))
    status, stderr = build.compile_library(_cc_for(target), out, flags=flags, sources=sources,
                                           extra=("-static",) if target == "aarch64" else ())
    assert status == 0, stderr[-2000:]
    return out


@pytest.mark.process
@pytest.mark.slow
def test_the_neon_path_gives_the_x86_bits_under_qemu(tmp_path):
    """fma_neon.c, cross-compiled for aarch64 and run under qemu-aarch64, writes the same bytes as every
    x86 ISA on the same inputs (tests/support/kernel_harness.c)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"compares against the x86 paths; this is {platform.machine()}")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if not qemu or not _cc_for("aarch64"):
        pytest.skip("needs qemu-user and gcc-aarch64-linux-gnu (Debian's packages; .ci/run installs them)")
    native, arm = _harness(tmp_path, "x86_64"), _harness(tmp_path, "aarch64")
    runs = {}
    for index in range(3):  # avx512, avx2, generic (fma.c's order); exit status 2: this CPU lacks it
        for vnni in ("1", "0"):  # the block formats' integer sums by vpdpwssd where the CPU has it, and by madd
            proc = subprocess.run([str(native), str(index)], capture_output=True, timeout=120,
                                  env={**os.environ, "SWARM_VNNI": vnni})
            if proc.returncode == 0:
                runs[(("avx512", "avx2", "generic")[index], vnni)] = proc.stdout
            else:
                assert proc.returncode == 2, proc.stderr
    proc = subprocess.run([qemu, str(arm), "0"], capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runs["neon"] = proc.stdout
    assert len(runs["neon"]) > 200_000
    for name, out in runs.items():
        assert out == runs["neon"], f"{name} and neon differ"
    assert ("generic", "0") in runs and len(runs) >= 5


@pytest.mark.process
def test_an_installed_extension_serves_a_host_without_a_compiler(tmp_path):
    """With CC=false and an empty cache, the kernels still load from the extension pip built; a library
    built from other sources is refused with the reason and a rebuild is the fallback."""
    probe = ("from swarm.kernels import fma; ok, why = fma.available(); d = fma.describe(); "
             "print(ok, d.library if d else why)")
    env = {**os.environ, "CC": "false", "SWARM_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    installed = fma._installed()[0] is not None
    if not installed:
        pytest.skip(f"no installed kernel extension here ({fma._installed()[1]})")
    assert out.stdout.strip() == "True installed", out.stderr
    assert not list(tmp_path.glob("kernels/*.so"))  # nothing was compiled


def test_a_stale_extension_is_refused_with_the_reason(monkeypatch):
    if fma._installed()[0] is None:
        pytest.skip("no installed kernel extension here")
    monkeypatch.setattr(build, "source_digest", lambda root=build.HERE: "0" * 16)
    lib, why = fma._installed()
    assert lib is None and "was built from other sources" in why and "pip install" in why


@pytest.mark.process
def test_swarm_isa_chooses_the_instruction_set_or_says_why_not():
    probe = "from swarm.kernels import fma; ok, why = fma.available(); print(fma.isa() if ok else why)"

    def run(isa: str) -> str:
        env = {**os.environ, "SWARM_ISA": isa}
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                              env=env).stdout.strip()

    assert run("auto") == _isas()[0]
    assert run(_isas()[-1]) == _isas()[-1]
    assert "is not an instruction set this CPU runs" in run("sse2")
    with pytest.raises(ValueError, match="not an instruction set"):
        fma.use_isa("sse2")
