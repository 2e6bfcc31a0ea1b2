"""How swarm's CPU kernels are compiled: their sources, flags and digest, shared by ``setup.py`` (the
extension ``pip install`` builds) and :mod:`swarm.kernels.fma` (the run-time fallback build).

Standard library only: ``setup.py`` loads this file by path, before swarm's dependencies exist.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# fma.c: the thread pool, the ISA table and the public entry points; one file per instruction set,
# each compiling to nothing on another architecture (so one list builds on x86-64 and aarch64); fma_layer.c:
# a whole decoder layer through fma.c's entry points; qquantize.c: float rows written as Q4_K / Q6_K blocks
# fp8.c: FP8 weights with block scales, decoded a panel at a time into the float32 / bfloat16 GEMM
C_SOURCES = ("fma.c", "fma_avx512.c", "fma_avx2.c", "fma_neon.c", "fma_generic.c", "fma_layer.c", "qquantize.c",
             "fp8.c")
HEADERS = ("fma_kernels.h", "fma_bf16.h", "fma_attention.h", "fma_common.h", "qblocks_kernels.h")
# no -m flags: each ISA file sets its own target, and fma.c dispatches on the CPU at run time;
# -ffp-contract=off: no multiply-add is fused unless the source says so
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-pthread")
EXTENSION = "swarm.kernels._fma"


def source_digest(root: Path = HERE) -> str:
    """sha256 (16 hex digits) of every kernel source and the flags: what the installed extension must
    have been built from to be used (``swarm_source_digest()`` in the library)."""
    h = hashlib.sha256()
    for name in (*C_SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()[:16]


def define_digest(root: Path = HERE) -> str:
    """The ``-D`` flag that compiles the digest into the library."""
    return f'-DSWARM_SOURCE_DIGEST="{source_digest(root)}"'


def compile_library(cc: list[str], out: Path, *, flags: tuple[str, ...] = FLAGS, extra: tuple[str, ...] = (),
                    sources: tuple[Path, ...] | None = None, timeout_s: float = 300.0) -> tuple[int, str]:
    """Compile ``sources`` (default: every kernel source) to objects in parallel, one compiler per source
    (one per ISA file: they take most of the time), then link them into ``out``.

    Args:
        cc: the compiler command line. out: the shared library or program to write. flags: compile
            flags. extra: flags for both steps (``-shared``, ``-static``, a ``-D``). sources: C files.
    Returns:
        (exit status, the compiler's stderr): 0 and the file written, or the first failure.
    """
    sources = tuple(sources or (HERE / name for name in C_SOURCES))
    with tempfile.TemporaryDirectory(prefix="swarm-kernels-obj-") as tmp:
        objects = [Path(tmp) / f"{i}-{Path(src).stem}.o" for i, src in enumerate(sources)]
        procs = [subprocess.Popen([*cc, *flags, *extra, "-c", str(src), "-o", str(obj)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for src, obj in zip(sources, objects)]
        failed = None
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err = f"timed out after {timeout_s:.0f} s"
            if proc.returncode != 0 and failed is None:
                failed = (proc.returncode or 1, err)
        if failed:
            return failed
        link = subprocess.run([*cc, *flags, *extra, *map(str, objects), "-o", str(out), "-lm"], capture_output=True,
                              text=True, timeout=timeout_s)
        return link.returncode, link.stderr
