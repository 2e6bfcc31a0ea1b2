"""swarm's one CPU arithmetic (``fma.c``): batch-invariant float32 GEMM (float32 or bfloat16 weights),
attention, RMSNorm and SiLU, the same bits on every instruction set that runs them.

Owns: finding the compiled kernels (the extension ``pip install`` built, ``swarm/kernels/_fma*.so``;
else a build with the system C compiler into the swarm cache, with a warning), choosing the
instruction set (the best the CPU has, or ``SWARM_ISA``), and calling them on torch tensors through
ctypes. Each output element is one fixed function of its own row's inputs (``fma.c`` states them),
so a row's bits never depend on how many rows share the call (a decode row, a verify chunk, a
prefill slice, packed sessions), nor on the thread count, nor on the ISA (AVX-512, AVX2 + FMA, NEON:
``tests/kernels/test_isa.py``), while a chunk reads each weight once per block of rows.
:func:`decoder_layer` runs a whole Llama-structured decoder layer in one call of ``fma_layer.c`` through
these same kernels (the module path's operations, roundings and order: its bits, without its Python).

Why our own kernel (measured 2026-12-02 on a 2-core AMD EPYC, torch 2.13 CPU, 1 thread): MKL's
sgemm gives a row the same bits for every M >= 4 but other bits at M = 1 (its GEMV path) and at
M = 2-3; oneDNN's matmul agrees for every M >= 2 but not at M = 1; and MKL takes other code paths
(other bits) on AVX-512 than on AVX2. No stock CPU kernel gave invariance at full speed.

:func:`available` says whether the kernels run here (an x86-64 CPU with AVX2 and FMA or an aarch64
CPU, a library, ``SWARM_KERNELS`` unset, ``auto`` or ``fma``), with the reason when not;
:func:`describe` says which ISA and which library. ``CC`` names the fallback build's compiler (split
like a shell word list, so ``CC="ccache gcc"`` works).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.kernels import build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fma.c")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernels are unavailable (None: not decided yet, "": available)
_origin = ""  # "installed" or "built at run time"
_isa_now = ""  # the ISA in use (set with the library)

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_threads: int | None = None  # set_threads: the kernels' own thread count (None: torch's)


@dataclass(frozen=True)
class KernelPath:
    """Which compiled kernels a process runs.

    Attributes:
        isa: the instruction set in use (``avx512``, ``avx2``, ``neon``).
        isas: every ISA this CPU and library can run, best first.
        arithmetic: the names of the arithmetic, float32's then the bfloat16 GEMM's, joined by `` + `` (the
            same on every ISA; what an auditor must match).
        library: ``installed`` (the extension pip built) or ``built at run time`` (the fallback).
        path: the shared library's file.
        bf16_dot: what runs the bfloat16 GEMM's pairs: ``vdpbf16ps`` (AVX512-BF16) or ``fma`` (two FMAs on
            the widened halves, the same bits).
    """

    isa: str
    isas: tuple[str, ...]
    arithmetic: str
    library: str
    path: str
    bf16_dot: str = "fma"

    def as_dict(self) -> dict:
        return {"isa": self.isa, "isas": list(self.isas), "arithmetic": self.arithmetic, "library": self.library,
                "path": self.path, "bf16_dot": self.bf16_dot}


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


def _installed() -> tuple[ctypes.CDLL | None, str]:
    """The extension ``pip install`` built, if there is one built from these very sources."""
    try:
        spec = importlib.util.find_spec(build.EXTENSION)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None, "no installed kernel extension (swarm/kernels/_fma*.so: pip install builds it)"
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.swarm_source_digest.restype = ctypes.c_char_p
        built_from = lib.swarm_source_digest().decode()
    except (OSError, AttributeError) as exc:
        return None, f"the installed kernel extension {spec.origin} cannot be loaded: {exc}"
    want = build.source_digest()
    if built_from != want:
        return None, (f"the installed kernel extension {spec.origin} was built from other sources ({built_from or '?'}, "
                      f"these are {want}): reinstall swarm (pip install .) to rebuild it")
    try:
        lib = _bind(lib)
    except AttributeError as exc:
        return None, f"the installed kernel extension {spec.origin} lacks a kernel: {exc}"
    return lib, spec.origin


def _build() -> tuple[ctypes.CDLL | None, str]:
    """Build the kernels with the system C compiler into the swarm cache (the fallback): (library, "") or
    (None, why not)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return None, f"not an x86-64 or aarch64 CPU ({platform.machine()})"
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    try:
        cc = shlex.split(os.environ.get("CC", "")) or ([found] if found else [])
    except ValueError as exc:
        return None, f"CC={os.environ['CC']!r} is not a command line: {exc}"
    if not cc:
        return None, "no C compiler (cc, gcc or clang) on PATH to build swarm/kernels/fma.c"
    from swarm.config import cache_root

    digest = build.source_digest()
    target = cache_root() / "kernels" / f"fma-{digest}-{hashlib.sha256(' '.join(cc).encode()).hexdigest()[:8]}.so"
    if target.exists():
        try:
            return _bind(ctypes.CDLL(str(target))), ""
        except (OSError, AttributeError) as exc:  # a truncated or foreign file: build it again
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
        status, stderr = build.compile_library(cc, tmp, extra=(build.define_digest(), "-shared"))
        if status != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            said = stderr.strip()[-300:] or f"exit status {status}, no output file"
            return None, f"{' '.join(cc)} could not build {SOURCE.name}: {said}"
        tmp.replace(target)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not build {SOURCE.name} with {' '.join(cc)}: {exc}"
    try:
        lib = _bind(ctypes.CDLL(str(target)))
    except (OSError, AttributeError) as exc:
        return None, f"could not load {target}: {exc}"
    finally:
        if target.parent.name.startswith("swarm-kernels-"):  # a temporary build: loaded (mapped), not kept
            shutil.rmtree(target.parent, ignore_errors=True)
    log.info("kernels.built library=%s", target)
    return lib, ""


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures on a loaded library (AttributeError: not this library's symbols)."""
    lib.swarm_linear.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int]
    lib.swarm_linear.restype = None
    lib.swarm_linear_bf16.argtypes = lib.swarm_linear.argtypes
    lib.swarm_linear_bf16.restype = ctypes.c_int
    lib.swarm_attention.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32,
                                    _ptr, _int]
    lib.swarm_attention.restype = ctypes.c_int
    lib.swarm_attention_bf16.argtypes = lib.swarm_attention.argtypes
    lib.swarm_attention_bf16.restype = ctypes.c_int
    lib.swarm_rmsnorm.argtypes = [_ptr, _i64, _i64, _ptr, _f32, _ptr]
    lib.swarm_rmsnorm.restype = None
    lib.swarm_silu.argtypes = [_ptr, _i64, _ptr]
    lib.swarm_silu.restype = None
    lib.swarm_qlinear.argtypes = [_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int]
    lib.swarm_qlinear.restype = ctypes.c_int
    lib.swarm_qlinear_many.argtypes = [_ptr, _int, _ptr, _i64, _i64, _i64, _int]
    lib.swarm_qlinear_many.restype = ctypes.c_int
    lib.swarm_layer_forward.argtypes = [_ptr, _ptr, _i64, _int]
    lib.swarm_fp8_linear.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr,
                                     _i64, _int, _int]
    lib.swarm_fp8_linear.restype = ctypes.c_int
    lib.swarm_mxfp4_linear.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int,
                                       _int]
    lib.swarm_mxfp4_linear.restype = ctypes.c_int
    lib.swarm_quantize_kquant.argtypes = [_int, _ptr, _i64, _i64, _i64, _ptr, _i64]
    lib.swarm_quantize_kquant.restype = ctypes.c_int
    lib.swarm_layer_forward.restype = ctypes.c_int
    for name in ("swarm_isa_name", "swarm_arithmetic", "swarm_bf16_arithmetic", "swarm_source_digest"):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.swarm_isa_name.argtypes = lib.swarm_isa_supported.argtypes = lib.swarm_use_isa.argtypes = [_int]
    lib.swarm_isa_count.argtypes = []
    lib.swarm_bf16_dot_instruction.argtypes = []
    lib.swarm_bf16_dot_instruction.restype = ctypes.c_int
    return lib


def _isa_names(lib: ctypes.CDLL) -> list[str]:
    """The ISAs ``lib`` holds that this CPU runs, best first."""
    return [lib.swarm_isa_name(i).decode() for i in range(lib.swarm_isa_count()) if lib.swarm_isa_supported(i)]


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The installed extension, else a build at run time (with a warning saying why); then the ISA:
    ``SWARM_ISA`` (``auto``, or a name the CPU runs), else the best."""
    global _origin, _isa_now
    lib, where = _installed()
    if lib is not None:
        _origin = "installed"
    else:
        log.warning("kernels.fallback %s; building swarm/kernels/fma.c at run time", where)
        lib, why = _build()
        if lib is None:
            return None, why
        _origin = "built at run time"
    names = _isa_names(lib)
    fast = [name for name in names if name != "generic"]  # generic: plain C, the reference, slow
    wanted = os.environ.get("SWARM_ISA", "").strip().lower()
    if wanted in ("", "auto"):
        if not fast:
            return None, ("the CPU has none of the kernels' vector units (x86-64 AVX2 + FMA, AVX-512F, aarch64 "
                          "NEON); SWARM_ISA=generic runs them in plain C, slowly")
        wanted = fast[0]
    if wanted not in names:
        return None, f"SWARM_ISA={wanted!r} is not an instruction set this CPU runs the kernels in ({', '.join(names)})"
    lib.swarm_use_isa(_index(lib, wanted))
    _isa_now = wanted
    return lib, ""


def _index(lib: ctypes.CDLL, name: str) -> int:
    return next(i for i in range(lib.swarm_isa_count()) if lib.swarm_isa_name(i).decode() == name)


def available() -> tuple[bool, str]:
    """Whether the fma kernel mode can run on this machine (the library loaded on first call, and
    ``SWARM_KERNELS`` not choosing another mode), and why not when it cannot."""
    choice = os.environ.get("SWARM_KERNELS", "").strip().lower()  # read every time: a test or a stage may set it
    if choice in ("rows", "triton"):
        return False, f"SWARM_KERNELS={choice}"
    if choice not in ("", "auto", "fma"):
        return False, f"SWARM_KERNELS={choice!r} is not one of auto, fma, triton, rows"
    return library_available()


def library_available() -> tuple[bool, str]:
    """Whether the kernels' library loads here, whatever mode a block runs in (weights in block formats
    need it in every mode: ``swarm.kernels.qblocks``), and why not when it does not."""
    global _lib, _reason
    with _lock:
        if _reason is None:
            _lib, _reason = _load()
        return _lib is not None, _reason


def _library() -> ctypes.CDLL:
    if _reason == "":  # built and loaded: the per-call path of a decode step stays short
        return _lib
    ok, reason = library_available()
    if not ok:
        raise RuntimeError(f"swarm's CPU kernels are unavailable: {reason}")
    return _lib


def describe() -> KernelPath | None:
    """Which ISA and library the kernels run here (None where they cannot load: :func:`library_available`
    says why)."""
    ok, _ = library_available()
    if not ok:
        return None
    lib = _library()
    path = getattr(lib, "_name", "")
    arithmetic = f"{lib.swarm_arithmetic().decode()} + {lib.swarm_bf16_arithmetic().decode()}"
    return KernelPath(isa=isa(), isas=tuple(_isa_names(lib)), arithmetic=arithmetic, library=_origin,
                      path=str(path), bf16_dot="vdpbf16ps" if lib.swarm_bf16_dot_instruction() else "fma")


def isa() -> str:
    """The instruction set the kernels run in now (``avx512``, ``avx2``, ``neon``)."""
    _library()
    return _isa_now


def use_isa(name: str) -> str:
    """Run the kernels in ISA ``name`` from now on (every thread of the process); returns the previous one.

    For tests and benchmarks that compare ISAs on one machine: every ISA gives the same bits.
    Raises:
        ValueError: ``name`` is not an ISA this CPU and library run. RuntimeError: kernels unavailable.
    """
    global _isa_now
    lib = _library()
    names = _isa_names(lib)
    if name not in names:
        raise ValueError(f"{name!r} is not an instruction set this CPU runs the kernels in ({', '.join(names)})")
    before = _isa_now
    lib.swarm_use_isa(_index(lib, name))
    _isa_now = name
    return before


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 CPU rows with a unit last stride (a copy only when it is not already)."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"the FMA kernels take float32 CPU tensors, got {x.dtype} on {x.device}")
    return x if x.stride(-1) == 1 and (x.dim() < 2 or x.stride(-2) >= x.shape[-1]) else x.contiguous()


def held_operands(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None,
                  what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The operands of a GEMM over a weight held in its own format (``qblocks``, ``fp8``) of ``k`` inputs and
    ``n`` outputs: ``x`` as (M, k) float32 CPU rows with a unit last stride, a new (M, n) float32 output, and
    the bias, contiguous (held by the caller while the kernel reads it), or None. ``what`` names the caller in
    errors.

    Raises:
        ValueError: ``x`` or ``bias`` of another dtype, device or shape.
    """
    if x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what} takes (M, {k}) float32 CPU rows, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype is not torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias must be float32 ({n},), got {bias.dtype} {tuple(bias.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, torch.empty((x.shape[0], n), dtype=torch.float32), None if bias is None else bias.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, each output element ``dot(x[m], weight[n])`` (+ ``bias[n]``) as ``fma.c``
    defines it: its bits never depend on M.

    Args:
        x: (M, K) float32 on the CPU, M >= 0.
        weight: (N, K) float32 or bfloat16 with a unit last stride (an ``nn.Linear`` weight). With a
            bfloat16 weight the GEMM is the bfloat16 one (``fma_bf16.h``): x rounded to bfloat16, pairs of
            products by FMA with x86's flush to zero (the bits of AVX512-BF16's ``vdpbf16ps``).
        bias: (N,) float32 or None.
    Returns:
        (M, N) float32, a new tensor.
    Raises:
        ValueError: other dtypes, devices or mismatched shapes. RuntimeError: kernels unavailable.
        MemoryError: no room for x's bfloat16 copy (a bfloat16 weight).
    """
    lib = _library()
    bf16 = weight.dtype is torch.bfloat16
    x = _rows(x)
    if bf16:
        if not weight.is_cpu:
            raise ValueError(f"the FMA kernels take CPU tensors, got a weight on {weight.device}")
        if weight.stride(-1) != 1 or (weight.dim() == 2 and weight.stride(0) < weight.shape[-1]):
            weight = weight.contiguous()
    else:
        weight = _rows(weight)
    m, k = x.shape
    n, kw = weight.shape
    if kw != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"linear shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        b = None if bias is None else _rows(bias).contiguous().data_ptr()
        args = (x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), n, weight.stride(0), b, out.data_ptr(), n,
                _threads or torch.get_num_threads())
        if not bf16:
            lib.swarm_linear(*args)
        elif lib.swarm_linear_bf16(*args):
            raise MemoryError(f"a bfloat16 linear of {m} rows could not allocate its bfloat16 copy of x")
    return out


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float,
              window: int | None = None) -> torch.Tensor:
    """Causal attention of one session's T query rows at positions ``[pos, pos + T)`` over its cache,
    each row over its own keys only (``fma.c``): a row's bits never depend on T.

    Args:
        query: (T, H, Dh) float32, heads contiguous per token.
        keys, values: (S, Hkv, Dh) float32 or bfloat16 (both the same) position-major cache views with
            S >= pos + T, unit strides for heads and dims (a ``KVCache`` buffer); H must be a multiple of
            Hkv (grouped-query). A bfloat16 cache is widened on load (exact): the bits of its float copy.
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
    if ks != vs or ks[1:] != (dh, 1) or keys.dtype not in (torch.float32, torch.bfloat16) \
            or values.dtype is not keys.dtype or not keys.is_cpu or not values.is_cpu:
        raise ValueError(f"keys and values must be float32 or bfloat16 position-major CPU cache views, got "
                         f"{keys.dtype} and {values.dtype} with strides {ks} and {vs}")
    call = lib.swarm_attention_bf16 if keys.dtype is torch.bfloat16 else lib.swarm_attention
    out = torch.empty((t, h, dh), dtype=torch.float32)
    if t and call(query.data_ptr(), t, h, dh, query.stride(0), keys.data_ptr(), values.data_ptr(), hkv,
                  keys.stride(0), pos, int(window or 0), float(scale), out.data_ptr(), _threads or torch.get_num_threads()):
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


# ---- one decoder layer per call (fma_layer.c): the module path's operations, in its order, in C

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # a decoder layer's Linears, in fma_layer.c's order


class _Projection(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("fmt", ctypes.c_int32), ("w", _ptr), ("ldw", _i64), ("n", _i64),
                ("k", _i64), ("bias", _ptr), ("scale", _ptr), ("lds", _i64), ("bn", _i64), ("bk", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("bf16", ctypes.c_int32), ("pad", ctypes.c_int32), ("D", _i64), ("H", _i64), ("Hkv", _i64),
                ("Dh", _i64), ("I", _i64), ("eps_in", _f32), ("eps_post", _f32), ("eps_qk", _f32), ("scale", _f32),
                ("window", _i64), ("norm_in", _ptr), ("norm_post", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                *((name, _Projection) for name in PROJECTIONS)]


class _Segment(ctypes.Structure):
    _fields_ = [("pos", _i64), ("t", _i64), ("off", _i64), ("keys", _ptr), ("values", _ptr)]


class _Rows(ctypes.Structure):
    _fields_ = [("N", _i64), ("h", _ptr), ("cos", _ptr), ("sin", _ptr), ("nseg", _i64), ("segs", _ptr)]


class LayerPlan:
    """One decoder layer's weights and constants as ``fma_layer.c`` takes them (:func:`layer_plan`); holds
    every tensor its struct points at."""

    def __init__(self, struct: _Layer, held: list):
        self.struct = struct
        self.held = held
        self.ref = ctypes.byref(struct)


class LayerRows:
    """A packed step's rows as ``fma_layer.c`` takes them (:func:`layer_rows`); ``h`` is updated in place."""

    def __init__(self, struct: _Rows, h: torch.Tensor, held: list):
        self.struct = struct
        self.h = h
        self.held = held
        self.ref = ctypes.byref(struct)

    def use(self, h: torch.Tensor) -> None:
        """Run the next layers on ``h`` (N, D), contiguous, of the rows' dtype (a module-path layer's output).

        Raises:
            ValueError: another shape, dtype or layout.
        """
        if h.shape != self.h.shape or h.dtype is not self.h.dtype or not h.is_contiguous():
            raise ValueError(f"rows of {self.h.dtype} {tuple(self.h.shape)} cannot go on as {h.dtype} {tuple(h.shape)}")
        self.h = h
        self.struct.h = h.data_ptr()


@dataclass(frozen=True)
class Blocks:
    """A (N, K) weight in one of llama.cpp's block formats, as ``swarm_qlinear`` takes it.

    Attributes:
        data: uint8 (N, row bytes) on the CPU, the blocks of weight row n in row n (``qblocks.QWeight.data``).
        fmt: the format's number in ``swarm_qlinear`` (the order of ``qblocks.FORMATS``).
        k: input features.
    """

    data: torch.Tensor
    fmt: int
    k: int


def _projection(weight, bias: torch.Tensor | None, dtype: torch.dtype, held: list) -> _Projection:
    """A Linear's weight (an (N, K) tensor of the block dtype, :class:`Blocks` or an ``Fp8Weight``) and bias as
    fma_layer.c takes them: the very arguments the module path's kernel call gets."""
    scale = lds = bn = bk = 0
    if hasattr(weight, "scale"):  # swarm.kernels.fp8.Fp8Weight (which imports this module): swarm_fp8_linear
        kind, fmt, ptr, ld, n, k = 3, 0, weight.data.data_ptr(), weight.data.stride(0), weight.n, weight.k
        scale, lds, (bn, bk) = weight.scale.data_ptr(), weight.scale.stride(0), weight.block
        held.extend((weight.data, weight.scale))
    elif isinstance(weight, Blocks):
        if dtype is not torch.float32 or weight.data.dtype is not torch.uint8 or weight.data.dim() != 2:
            raise ValueError(f"block-format weights are uint8 rows computing in float32, got {weight.data.dtype} "
                             f"{tuple(weight.data.shape)} in a {dtype} block")
        data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
        kind, fmt, ptr, ld, n, k = 2, weight.fmt, data.data_ptr(), data.stride(0), data.shape[0], weight.k
        held.append(data)
    else:
        if weight.dtype is not dtype or weight.dim() != 2 or not weight.is_cpu:
            raise ValueError(f"a {dtype} block's weight must be a 2-D {dtype} CPU tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        w = weight if weight.is_contiguous() else weight.contiguous()
        kind, fmt, ptr, ld, (n, k) = int(dtype is torch.bfloat16), 0, w.data_ptr(), w.stride(0), w.shape
        held.append(w)
    b = None
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit {n} outputs")
        b = bias.detach().float().contiguous()  # a bfloat16 block's bias enters widened, as the module path's
        held.append(b)
    return _Projection(kind, fmt, ptr, ld, n, k, None if b is None else b.data_ptr(), scale or None, lds, bn, bk)


def layer_plan(*, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, norm_in: torch.Tensor,
               norm_post: torch.Tensor, eps_in: float, eps_post: float, projections: dict, scale: float,
               window: int | None = None, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               eps_qk: float = 0.0) -> LayerPlan:
    """One Llama-structured decoder layer for :func:`decoder_layer`, built once.

    Args:
        dtype: the block dtype, float32 or bfloat16 (h, rotary tables and KV cache in it).
        heads, kv_heads, head_dim: H, Hkv, Dh.
        norm_in, norm_post: (D,) RMSNorm weights (input_layernorm, post_attention_layernorm); eps_*: theirs.
        projections: ``q k v o gate up down`` -> (weight, bias): an (N, K) tensor of ``dtype`` or
            :class:`Blocks` (a float32 block), and an (N,) bias or None.
        scale: attention's score scale. window: sliding window in positions, or None.
        q_norm, k_norm, eps_qk: (Dh,) per-head RMSNorm weights applied to q and k before rotary (Qwen3), or None.
    Returns:
        A :class:`LayerPlan`.
    Raises:
        ValueError: shapes or dtypes that do not fit one another.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the fused layer runs float32 or bfloat16 blocks, not {dtype}")
    held: list = []
    proj = {name: _projection(*projections[name], dtype, held) for name in PROJECTIONS}
    d, inter = proj["q"].k, proj["gate"].n
    want = {"q": (heads * head_dim, d), "k": (kv_heads * head_dim, d), "v": (kv_heads * head_dim, d),
            "o": (d, heads * head_dim), "gate": (inter, d), "up": (inter, d), "down": (d, inter)}
    got = {name: (p.n, p.k) for name, p in proj.items()}
    if got != want or head_dim % 2 or heads % kv_heads:
        raise ValueError(f"a decoder layer of H {heads}, Hkv {kv_heads}, Dh {head_dim} cannot have projections {got}")

    def vector(w: torch.Tensor, n: int) -> int:
        if tuple(w.shape) != (n,):
            raise ValueError(f"a norm weight of {tuple(w.shape)} does not fit rows of {n}")
        w = w.detach().float().contiguous()  # a bfloat16 block's norm weights enter widened, as the module path's
        held.append(w)
        return w.data_ptr()

    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    struct = _Layer(int(dtype is torch.bfloat16), 0, d, heads, kv_heads, head_dim, inter, eps_in, eps_post, eps_qk,
                    scale, int(window or 0), vector(norm_in, d), vector(norm_post, d),
                    None if q_norm is None else vector(q_norm, head_dim),
                    None if k_norm is None else vector(k_norm, head_dim), *(proj[name] for name in PROJECTIONS))
    return LayerPlan(struct, held)


def layer_rows(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list) -> LayerRows:
    """A packed step's rows for :func:`decoder_layer`, built once per forward.

    Args:
        h: (N, D) contiguous, float32 or bfloat16: the rows entering the next layer (updated in place).
        cos, sin: (N, Dh) of h's dtype, contiguous: each row's rotary table.
        segments: per session ``(pos, t, off, keys, values)``: positions ``[pos, pos + t)`` at rows
            ``[off, off + t)``; keys / values: ctypes arrays of the session's (capacity, Hkv, Dh) buffer
            addresses, one per layer slot, each holding at least ``pos + t`` positions.
    Raises:
        ValueError: dtypes or shapes that do not fit.
    """
    if h.dtype not in (torch.float32, torch.bfloat16) or cos.dtype is not h.dtype or sin.dtype is not h.dtype \
            or not h.is_contiguous() or not cos.is_contiguous() or not sin.is_contiguous() \
            or h.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != h.shape[0]:
        raise ValueError(f"layer rows take contiguous (N, D) h and (N, Dh) cos, sin of one dtype, got {h.dtype} "
                         f"{tuple(h.shape)}, {cos.dtype} {tuple(cos.shape)}, {sin.dtype} {tuple(sin.shape)}")
    segs = (_Segment * len(segments))(*(_Segment(pos, t, off, ctypes.addressof(k), ctypes.addressof(v))
                                        for pos, t, off, k, v in segments))
    struct = _Rows(h.shape[0], h.data_ptr(), cos.data_ptr(), sin.data_ptr(), len(segments), ctypes.addressof(segs))
    return LayerRows(struct, h, [cos, sin, segs, segments])


def decoder_layer(plan: LayerPlan, rows: LayerRows, slot: int) -> None:
    """Run one decoder layer over ``rows`` (``rows.h`` updated in place, each session's K/V rows written to its
    buffers of layer slot ``slot``) in one ``fma_layer.c`` call: bit for bit the module path's layer.

    Raises:
        MemoryError: no memory for the layer's scratch or attention's transposed keys. ValueError: a block
        format or K that the block-format GEMM refuses. (Either may leave the layer's cache rows written:
        roll the forward back.)
    """
    rc = _library().swarm_layer_forward(plan.ref, rows.ref, slot, _threads or torch.get_num_threads())
    if rc == -2:
        raise MemoryError(f"no memory for a decoder layer over {rows.struct.N} rows")
    if rc:
        raise ValueError("the block-format GEMM refused a weight of this layer (format or K)")
