"""How swarm's CPU kernels are compiled: their sources, flags and digest, shared by ``setup.py`` (the
extension ``pip install`` builds) and :mod:`swarm.kernels.fma` (the run-time fallback build).

Standard library only: ``setup.py`` loads this file by path, before swarm's dependencies exist.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
# fma.c: the thread pool, the ISA table and the public entry points; one file per instruction set,
# each compiling to nothing on another architecture (so one list builds on x86-64 and aarch64)
C_SOURCES = ("fma.c", "fma_avx512.c", "fma_avx2.c", "fma_neon.c", "fma_generic.c")
HEADERS = ("fma_kernels.h", "fma_attention.h", "fma_common.h", "qblocks_kernels.h")
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
