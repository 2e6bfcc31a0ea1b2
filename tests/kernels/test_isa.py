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


def _bf16_gemm_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fma_bf16.h's definition in float32 torch ops, for inputs with no value near float32's subnormals (where
    the flush changes nothing): x rounded to bfloat16, K padded to 16, lane l adding the product of pair
    element 2l + 1 then 2l of each block of 16 (a bfloat16 product is exact, so + is the FMA), dot's tree."""
    m, k = x.shape
    kp = -(-k // 16) * 16
    xs = F.pad(x.bfloat16().float(), (0, kp - k)).view(m, 1, kp // 16, 8, 2)
    ws = F.pad(w.float(), (0, kp - k)).view(1, w.shape[0], kp // 16, 8, 2)
    acc = torch.zeros(m, w.shape[0], 8)
    for i in range(kp // 16):
        acc = acc + xs[:, :, i, :, 1] * ws[:, :, i, :, 1]
        acc = acc + xs[:, :, i, :, 0] * ws[:, :, i, :, 0]
    s = ((acc[..., 0] + acc[..., 1]) + (acc[..., 2] + acc[..., 3])) + ((acc[..., 4] + acc[..., 5]) + (acc[..., 6] + acc[..., 7]))
    return s if bias is None else s + bias


def test_the_bfloat16_gemm_is_its_definition_and_a_bfloat16_cache_is_widened():
    """A bfloat16 weight's GEMM gives the bits fma_bf16.h defines (checked against the definition in torch
    ops, K on and off multiples of 16, with and without bias, in every ISA, with and without vdpbf16ps);
    a bfloat16 cache is widened exactly, so attention's bits equal those of its float32 copy."""
    gen = torch.Generator().manual_seed(3)
    for m, k, n in ((1, 576, 70), (11, 70, 33), (5, 13, 7), (30, 129, 61), (64, 200, 96)):
        x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
        for bias in (None, b):
            want = _bf16_gemm_reference(x, w, bias)
            for name, got in _each_isa(lambda: [fma.linear(x, w, bias) for _ in _bf16_dot_settings()]).items():
                assert all(torch.equal(g, want) for g in got), (name, (m, k, n))
    # the odd product first: each lane 1, then 0.75 ulp (odd) and 0.5 ulp (even) rounds to 1 + 2 ulp (even
    # first: 1 + 1 ulp); random data of like magnitude mostly adds exactly and would not show the order
    w = torch.tensor([0.0, 1.0] * 8 + [2.0 ** -24, 1.5 * 2.0 ** -24] * 8).view(1, 32).bfloat16()
    for name, got in _each_isa(lambda: [fma.linear(torch.ones(3, 32), w) for _ in _bf16_dot_settings()]).items():
        assert all(torch.equal(g, torch.full((3, 1), 8 + 2.0 ** -19)) for g in got), name
    q, keys, values = torch.randn(6, 4, 16), torch.randn(80, 2, 16).bfloat16(), torch.randn(80, 2, 16).bfloat16()
    assert torch.equal(fma.attention(q, keys, values, 74, 0.25), fma.attention(q, keys.float(), values.float(), 74, 0.25))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fma.attention(q, keys.half(), values.half(), 74, 0.25)


def _bf16_dot_settings():
    """Yield with SWARM_BF16DP 1, then 0 (AVX512-BF16's vdpbf16ps, then FMAs on the widened halves)."""
    before = os.environ.get("SWARM_BF16DP")
    try:
        for setting in ("1", "0"):
            os.environ["SWARM_BF16DP"] = setting
            yield setting
    finally:
        if before is None:
            os.environ.pop("SWARM_BF16DP", None)
        else:
            os.environ["SWARM_BF16DP"] = before


def test_the_bfloat16_gemm_flushes_to_zero_alike_in_every_isa():
    """Near float32's smallest normals (products about 2^-126, sums cancelling onto FLT_MIN), every ISA, with
    and without vdpbf16ps, gives the same bits, plain C's software flush included, and a flush happened."""
    gen = torch.Generator().manual_seed(5)

    def spread(shape, lo, hi):
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        return sign * (1 + torch.rand(shape, generator=gen)) * torch.pow(2.0, torch.randint(lo, hi, shape, generator=gen).float())

    cases = []
    for _ in range(12):
        cases.append((spread((3, 48), -75, -55), spread((40, 48), -75, -55).bfloat16(), spread((40,), -130, -120)))
        x = torch.ones(3, 48)
        x[:, 1::2] = spread((3, 24), -76, -74)
        cases.append((x, spread((40, 48), -127, -124).bfloat16(), None))
    tiny = torch.finfo(torch.float32).tiny
    # each lane: 1.5 * tiny, then - tiny: 0.5 * tiny, subnormal, flushed; IEEE's sum of 8 lanes is 4 * tiny
    w = torch.tensor([-tiny, 1.5 * tiny] * 8).view(1, 16).bfloat16()
    cases.append((torch.ones(2, 16), w, None))
    assert torch.equal(_bf16_gemm_reference(torch.ones(2, 16), w, None), torch.full((2, 1), 4 * tiny))
    runs = _each_isa(lambda: [[fma.linear(x, w, b) for x, w, b in cases] for _ in _bf16_dot_settings()])
    outs = [out for per_isa in runs.values() for out in per_isa]
    for other in outs[1:]:
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(outs[0], other))
    assert torch.equal(outs[0][-1], torch.zeros(2, 1))
    flat = torch.cat([o.flatten() for o in outs[0]])
    assert not ((flat != 0) & (flat.abs() < tiny)).any()  # no subnormal result anywhere


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
        for vnni in ("1", "0"):  # the block formats' integer sums by vpdpwssd where the CPU has it, and by madd;
            # the bfloat16 GEMM by vdpbf16ps where the CPU has it, and by FMAs
            proc = subprocess.run([str(native), str(index)], capture_output=True, timeout=120,
                                  env={**os.environ, "SWARM_VNNI": vnni, "SWARM_BF16DP": vnni})
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
