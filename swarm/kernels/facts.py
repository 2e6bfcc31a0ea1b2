"""The facts a block's output bits depend on, read off this machine: its reproducibility class.

Owns: :func:`machine_facts` (device, ISA, CPU vendor, BLAS, library versions), :func:`kernel_facts`, :func:`stage_class`
(those facts with the block's dtype, kernel mode and weights digest, as a :class:`swarm.repro.ReproClass`) and
:func:`kernels_in_use` (mode, ISA, library, why rows: for READY, ``--check``, ``info_ok``, ``/metrics``, the dashboard).
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import re
from pathlib import Path

import torch

from swarm import repro


def _cpu_vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _blas(config: str) -> str:
    """``mkl 2024.2``, ``openblas``, ... from ``torch.__config__.show()``."""
    name = re.search(r"BLAS_INFO=([\w.-]+)", config)
    blas = name.group(1) if name else "unknown"
    if blas == "mkl":
        version = re.search(r"Math Kernel Library Version ([\d.]+)", config)
        if version:
            blas += f" {version.group(1)}"
    elif blas == "open":  # torch writes BLAS_INFO=open for OpenBLAS
        blas = "openblas"
    return blas


@functools.lru_cache(maxsize=None)
def machine_facts(device_type: str = "cpu", device_index: int = 0) -> dict:
    """What this process's arithmetic rests on besides the block: device, ISA, BLAS, versions.

    Args:
        device_type: ``cpu`` or ``cuda`` (the block's device type); ``device_index``: the GPU.
    Returns:
        ``{"device", "isa", "cpu_vendor", "blas", "torch", "transformers"[, "cuda"]}`` (JSON values).
    """
    import transformers

    config = torch.__config__.show()
    facts = {
        "isa": f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}",
        "cpu_vendor": _cpu_vendor(),
        "blas": _blas(config),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability(device_index)
        facts["device"] = f"cuda {torch.cuda.get_device_name(device_index)} sm{major}{minor}"
        facts["cuda"] = torch.version.cuda or "unknown"
    else:
        facts["device"] = device_type
    return facts


@functools.lru_cache(maxsize=None)
def _fma_arithmetic() -> tuple[str, str]:
    """The fma kernels' arithmetic name and the digest of their sources: the same on every ISA they run
    in (AVX-512, AVX2, NEON give the same bits: tests/kernels/test_isa.py), so the ISA is no fact."""
    from swarm.kernels import build, fma

    path = fma.describe()
    return (path.arithmetic if path else ""), build.source_digest()


@dataclasses.dataclass(frozen=True)
class KernelsInUse:
    """Which kernels a stage runs, and why one row at a time where it does.

    Attributes:
        mode: the block's ``kernel_mode``: ``fma``, ``triton`` or ``rows``.
        isa: the fma kernels' instruction set (``avx512``, ``avx2``, ``neon``); "" in the other modes.
        library: ``installed`` (the extension pip built) or ``built at run time`` (the fallback build) for
            fma; ``triton VERSION`` (``(interpreter)`` off CUDA); ``torch`` for rows (stock torch ops).
        arithmetic: the fma kernels' arithmetic (the same bits on every ISA); "" in the other modes.
        why: in the ``rows`` mode, why not a batch-invariant one (those kernels cannot run here, or
            failed the stage's start-up proof); "" in the other modes.
        bf16_dot: fma mode: what forms the bfloat16 GEMM's pairs, ``vdpbf16ps`` or ``fma`` (the same bits;
            ``fma.KernelPath``); "" in the other modes.
    """

    mode: str
    isa: str = ""
    library: str = ""
    arithmetic: str = ""
    why: str = ""
    bf16_dot: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def kernels_in_use(mode: str, why: str = "") -> KernelsInUse:
    """What runs a block in kernel mode ``mode``, read off this process (``why``: kept for ``rows`` only).

    Raises:
        ValueError: an unknown mode. RuntimeError: ``fma`` where those kernels cannot run.
    """
    if mode == "fma":
        from swarm.kernels import fma

        path = fma.describe()
        if path is None:
            raise RuntimeError(f"swarm's FMA kernels are unavailable: {fma.available()[1]}")
        return KernelsInUse("fma", isa=path.isa, library=path.library, arithmetic=path.arithmetic,
                            bf16_dot=path.bf16_dot)
    if mode == "triton":
        from swarm.kernels import triton_ops

        d = triton_ops.describe()
        return KernelsInUse("triton", library=f"triton {d['triton']}" + (" (interpreter)" if d["interpreter"] else ""))
    if mode == "rows":
        return KernelsInUse("rows", library="torch", why=why)
    raise ValueError(f"unknown kernel mode {mode!r}")


def kernel_facts(mode: str, tile: int = 1, threads: int | None = None, *, cpu: bool = True) -> dict:
    """The kernel mode and the constants a row's bits depend on.

    In the ``rows`` mode torch's thread count is one of them: measured 2026-12-03 on a 2-core AMD EPYC
    (torch 2.13, MKL 2024.2), check_block's sessions at SmolLM2's widths gave other bits at 1, 2 and 4
    threads (the same bits at the same count, run after run). The fma kernels' threads only share out
    disjoint outputs (``swarm.kernels.fma``), so there it is no fact (tests/kernels/test_facts.py).

    Args:
        mode: the block's ``kernel_mode``: ``fma``, ``triton`` or ``rows``.
        tile: rows per GEMM of the session (``rows`` mode only: packed sessions' ``--batch-tile``;
            the fma and triton kernels give a row the same bits at any packing). The triton mode
            names its own GEMM tile, key block and launch configuration
            (:func:`swarm.kernels.triton_ops.describe`), so an audit compares only within them.
        threads: torch's thread count for the ``rows`` mode (default: ``torch.get_num_threads()``).
        cpu: the block runs on the CPU; on a GPU the CPU thread count is no fact.
    Raises:
        ValueError: an unknown mode or a tile below 1.
    """
    from swarm.kernels import invariant

    if tile < 1:
        raise ValueError(f"tile must be at least 1, got {tile}")
    if mode == "fma":
        arithmetic, source = _fma_arithmetic()
        return {"mode": "fma", "arithmetic": arithmetic, "source": source, "key_block": 64,
                "norm_tile": invariant.TILE_ROWS}
    if mode == "triton":
        from swarm.kernels import triton_ops

        return {"mode": "triton", **triton_ops.describe(), "norm_tile": invariant.TILE_ROWS}
    if mode == "rows":
        out = {"mode": "rows", "tile": tile, "column_block": invariant.COLUMN_BLOCK,
               "column_block_min_bytes": invariant.COLUMN_BLOCK_MIN_BYTES}
        if cpu:
            out["threads"] = threads or torch.get_num_threads()
        return out
    raise ValueError(f"unknown kernel mode {mode!r}")


def stage_class(block, span=None, tile: int = 1) -> repro.ReproClass:
    """The reproducibility class of ``block`` running ``span`` (default: its whole range) at ``tile``.

    Args:
        block: a loaded ``LayerBlock`` (its ``device``, ``dtype``, ``kernel_mode``, ``digest_of``).
        span: the ``LayerRange`` a session runs; its weights digest is part of the class.
        tile: the session's rows per GEMM (see :func:`kernel_facts`).
    Returns:
        The :class:`swarm.repro.ReproClass`. The CPU vendor is a fact only in the ``rows`` mode on a
        CPU (the BLAS's code paths differ by vendor); fma.c's arithmetic is fixed by its source, the
        triton kernels' by their source, tiles and Triton's version on the GPU the device names.
    """
    device = torch.device(block.device)
    facts = dict(machine_facts(device.type, device.index or 0))
    mode = getattr(block, "kernel_mode", "rows")
    if not (mode == "rows" and device.type == "cpu"):
        facts.pop("cpu_vendor")
    facts.update(schema=repro.SCHEMA, dtype=str(block.dtype).removeprefix("torch."),
                 kernel=kernel_facts(mode, tile, cpu=device.type == "cpu"), weights=block.digest_of(span))
    quant = getattr(block, "quantize", None)
    if quant in ("int8", "int4"):  # weights held quantized (swarm.kernels.quant): the scheme and torch's ops decide the bits
        from swarm.kernels import quant as quant_ops

        facts["quant"] = {"scheme": quant, "int4_group": quant_ops.INT4_GROUP, "int8_k": quant_ops.INT8_K}
    elif quant is not None:  # llama.cpp's block formats: qblocks_kernels.h's integer arithmetic (fma.c names it)
        from swarm.kernels.qblocks import ARITHMETIC

        facts["quant"] = {"scheme": quant, "arithmetic": ARITHMETIC}
    return repro.make(facts)
