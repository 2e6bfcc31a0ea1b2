"""Batch-invariant float32 GEMM and attention on x86-64 CPUs (AVX2 + FMA), from ``fma.c``.

Owns: building ``fma.c`` once per machine (the system C compiler, into the swarm cache) and calling
it on torch tensors through ctypes. Each output element is one fixed function of its own row's
inputs (``fma.c`` states them), so a row's bits never depend on how many rows share the call: a
decode row, a verify chunk, a prefill slice and packed sessions get the same bits, while a chunk
reads each weight once per block of rows, not once per row.

Why our own kernel (measured 2026-12-02 on a 2-core AMD EPYC, torch 2.13 CPU, 1 thread): MKL's
sgemm gives a row the same bits for every M >= 4 but other bits at M = 1 (its GEMV path) and at
M = 2-3; oneDNN's matmul agrees for every M >= 2 but not at M = 1. Padding a decode row to 4 rows
(MKL) or 2 (oneDNN) to stay in the invariant regime made a decode step's GEMMs 1.5-1.8x slower
(SmolLM2's 30 layers: 57 ms as GEMVs, 88 ms as 2-row oneDNN, 105 ms as 4-row MKL), and GEMMs of a
fixed tile of 8-16 rows cost 1.5-2x a large GEMM per row. No stock CPU kernel gave both.

Threads: each call splits its work into tasks with disjoint outputs (blocks of GEMM columns; query
rows and heads of attention) over a small POSIX-thread pool in ``fma.c``; every output element is
computed by the same code whichever thread takes it, so the thread count (:func:`set_threads`, else
torch's) never changes a bit.

:func:`available` says whether the kernels can run here (x86-64 with AVX2 and FMA, a C compiler,
``SWARM_KERNELS`` unset, ``auto`` or ``fma``; ``rows`` or ``triton`` turns them off), with the reason
when not.
``CC`` names the compiler (split like a shell word list, so ``CC="ccache gcc"`` works). May import torch; no networking.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fma.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-pthread")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernels are unavailable (None: not decided yet, "": available)

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_threads: int | None = None  # set_threads: the kernels' own thread count (None: torch's)


def set_threads(threads: int | None) -> None:
    """Give the kernels their own thread count (None: follow ``torch.get_num_threads()``).

    A stage in the fma mode runs its GEMMs and attention here and only small element-wise ops in
    torch, so it gives these kernels its ``--threads`` and torch one thread: torch's OpenMP workers
    spin after each op and would take the cores this pool's workers need (measured on the 2-core AMD
    EPYC: a 575-position replay over 10 layers took 0.85 s at 2 torch threads, 0.80 s at 1).
    Raises ValueError below 1.
    """
    global _threads
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    _threads = threads


def threads() -> int:
    """The thread count the kernels use now."""
    return _threads or torch.get_num_threads()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build() -> tuple[ctypes.CDLL | None, str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"not an x86-64 CPU ({platform.machine()})"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return None, f"the CPU lacks {', '.join(sorted(missing))}"
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    try:
        cc = shlex.split(os.environ.get("CC", "")) or ([found] if found else [])
    except ValueError as exc:
        return None, f"CC={os.environ['CC']!r} is not a command line: {exc}"
    if not cc:
        return None, "no C compiler (cc, gcc or clang) on PATH to build swarm/kernels/fma.c"
    from swarm.config import cache_root

    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((*cc, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"fma-{digest}.so"
    if target.exists():
        try:
            return _bind(ctypes.CDLL(str(target))), ""
        except OSError as exc:  # a truncated or foreign file: build it again
            log.warning("kernels.rebuild library=%s: cannot load it (%s)", target, exc)
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(target.parent, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target.parent))
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            # a read-only cache (HOME not writable) must not cost the stage its kernels: build in a
            # private temporary directory instead, every start, and say how to keep the build
            log.warning("kernels.cache_unwritable dir=%s (%s): building in a temporary directory; set "
                        "SWARM_CACHE to a writable directory to keep the build", target.parent, exc.strerror)
            target = Path(tempfile.mkdtemp(prefix="swarm-kernels-")) / target.name
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([*cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            said = proc.stderr.strip()[-300:] or f"exit status {proc.returncode}, no output file"
            return None, f"{' '.join(cc)} could not build {SOURCE.name}: {said}"
        tmp.replace(target)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not build {SOURCE.name} with {' '.join(cc)}: {exc}"
    try:
        lib = _bind(ctypes.CDLL(str(target)))
    except OSError as exc:
        return None, f"could not load {target}: {exc}"
    finally:
        if target.parent.name.startswith("swarm-kernels-"):  # a temporary build: loaded (mapped), not kept
            shutil.rmtree(target.parent, ignore_errors=True)
    log.info("kernels.built library=%s", target)
    return lib, ""


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures on a loaded library."""
    lib.swarm_linear.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int]
    lib.swarm_linear.restype = None
    lib.swarm_attention.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32,
                                    _ptr, _int]
    lib.swarm_attention.restype = ctypes.c_int
    lib.swarm_rmsnorm.argtypes = [_ptr, _i64, _i64, _ptr, _f32, _ptr]
    lib.swarm_rmsnorm.restype = None
    lib.swarm_silu.argtypes = [_ptr, _i64, _ptr]
    lib.swarm_silu.restype = None
    return lib


def available() -> tuple[bool, str]:
    """Whether the kernels run on this machine (built on first call), and why not when they do not."""
    global _lib, _reason
    choice = os.environ.get("SWARM_KERNELS", "").strip().lower()  # read every time: a test or a stage may set it
    if choice in ("rows", "triton"):
        return False, f"SWARM_KERNELS={choice}"
    if choice not in ("", "auto", "fma"):
        return False, f"SWARM_KERNELS={choice!r} is not one of auto, fma, triton, rows"
    with _lock:
        if _reason is None:
            _lib, _reason = _build()
        return _lib is not None, _reason


def _library() -> ctypes.CDLL:
    if _reason == "":  # built and loaded: the per-call path of a decode step stays short
        return _lib
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"swarm's FMA kernels are unavailable: {reason}")
    return _lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 CPU rows with a unit last stride (a copy only when it is not already)."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"the FMA kernels take float32 CPU tensors, got {x.dtype} on {x.device}")
    return x if x.stride(-1) == 1 and (x.dim() < 2 or x.stride(-2) >= x.shape[-1]) else x.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, each output element ``dot(x[m], weight[n])`` (+ ``bias[n]``) as ``fma.c``
    defines it: its bits never depend on M.

    Args:
        x: (M, K) float32 on the CPU, M >= 0.
        weight: (N, K) float32 with a unit last stride (an ``nn.Linear`` weight).
        bias: (N,) float32 or None.
    Returns:
        (M, N) float32, a new tensor.
    Raises:
        ValueError: other dtypes, devices or mismatched shapes. RuntimeError: kernels unavailable.
    """
    lib = _library()
    x, weight = _rows(x), _rows(weight)
    m, k = x.shape
    n, kw = weight.shape
    if kw != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"linear shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        b = None if bias is None else _rows(bias).contiguous().data_ptr()
        lib.swarm_linear(x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), n, weight.stride(0), b, out.data_ptr(),
                         n, _threads or torch.get_num_threads())
    return out


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float,
              window: int | None = None) -> torch.Tensor:
    """Causal attention of one session's T query rows at positions ``[pos, pos + T)`` over its cache,
    each row over its own keys only (``fma.c``): a row's bits never depend on T.

    Args:
        query: (T, H, Dh) float32, heads contiguous per token.
        keys, values: (S, Hkv, Dh) float32 position-major cache views with S >= pos + T, unit strides
            for heads and dims (a ``KVCache`` buffer); H must be a multiple of Hkv (grouped-query).
        pos: absolute position of query row 0.
        scale: the score scale (1 / sqrt(Dh) usually).
        window: sliding window in positions, or None.
    Returns:
        (T, H, Dh) float32.
    Raises:
        ValueError: bad shapes, strides or dtype. RuntimeError: kernels unavailable. MemoryError: no room
        for the call's transposed keys ((S + 64) * Hkv * Dh floats at most).
    """
    lib = _library()
    query = _rows(query).contiguous()
    t, h, dh = query.shape
    s, hkv, dh_k = keys.shape
    if values.shape != keys.shape or dh_k != dh or h % hkv or s < pos + t:
        raise ValueError(f"attention shapes do not fit: query {tuple(query.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}, pos {pos}")
    ks, vs = keys.stride(), values.stride()
    if ks != vs or ks[1:] != (dh, 1) or keys.dtype is not torch.float32 or values.dtype is not torch.float32 \
            or not keys.is_cpu or not values.is_cpu:
        raise ValueError(f"keys and values must be float32 position-major CPU cache views, got {keys.dtype} and "
                         f"{values.dtype} with strides {ks} and {vs}")
    out = torch.empty((t, h, dh), dtype=torch.float32)
    if t and lib.swarm_attention(query.data_ptr(), t, h, dh, query.stride(0), keys.data_ptr(), values.data_ptr(),
                                 hkv, keys.stride(0), pos, int(window or 0), float(scale), out.data_ptr(),
                                 _threads or torch.get_num_threads()):
        raise MemoryError(f"attention over {pos + t} positions could not allocate its transposed keys")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, each row alone (``fma.c``: ``swarm_rmsnorm``).

    Args:
        x: (..., D) float32 on the CPU. weight: (D,) float32. eps: the module's epsilon.
    Returns:
        A new tensor shaped like ``x``.
    Raises:
        ValueError: other dtypes or a weight of another width. RuntimeError: kernels unavailable.
    """
    lib = _library()
    d = x.shape[-1]
    if tuple(weight.shape) != (d,):
        raise ValueError(f"rms_norm weight {tuple(weight.shape)} does not fit rows of {d}")
    x = _rows(x).contiguous()
    w = _rows(weight).contiguous()
    out = torch.empty_like(x)
    if x.numel():
        lib.swarm_rmsnorm(x.data_ptr(), x.numel() // d, d, w.data_ptr(), float(eps), out.data_ptr())
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of every element, each alone (``fma.c``: ``swarm_silu``). x: float32 CPU; returns a new tensor."""
    lib = _library()
    x = _rows(x).contiguous()
    out = torch.empty_like(x)
    if x.numel():
        lib.swarm_silu(x.data_ptr(), x.numel(), out.data_ptr())
    return out
