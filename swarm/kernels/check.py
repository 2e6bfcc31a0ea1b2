"""Start-up proof that a loaded layer block keeps a row's bits independent of its neighbours.

Owns: :func:`check_block` and :func:`check_block_once` (its report kept in memory and, with ``cache_dir``, on disk):
a block's outputs one row at a time, in chunks and, for ``tile > 1`` or a kernel mode, packed with other sessions'
rows, compared bit for bit on seeded inputs in scratch KV caches (docs/architecture.md, "The start-up proof").
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.files import write_atomic

# Per session: (pos, rows) chunks in order; a pos below the previous end rolls back (rejected drafts).
# Covers a multi-row prefill, decode rows, verify chunks, a rollback into a verify chunk, and three
# sessions of different lengths packed together, in 23 rows.
SCHEDULE = (
    ((0, 4), (4, 1), (5, 3), (6, 2)),
    ((0, 6), (6, 2), (8, 1)),
    ((0, 1), (1, 3)),
)


@dataclass(frozen=True)
class InvarianceReport:
    """What :func:`check_block` found.

    Attributes:
        tile: rows per GEMM that was checked.
        ok: every position's output was bit-identical in every grouping.
        reason: empty when ok, else the first difference (session, position, grouping, size).
        seconds: wall time of the check.
    """

    tile: int
    ok: bool
    reason: str
    seconds: float


def _inputs(block, seed: int) -> list[list[tuple[int, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    plans = []
    for chunks in SCHEDULE:
        plan = []
        for pos, t in chunks:
            if block.is_head:
                x = torch.randint(0, block.vocab_size, (1, t), generator=gen)
            else:
                x = torch.randn(1, t, block.hidden_size, generator=gen, dtype=torch.float64).to(block.dtype)
            plan.append((pos, x))
        plans.append(plan)
    return plans


def _one_row_at_a_time(block, plan, tile: int) -> list[torch.Tensor]:
    cache = block.new_cache(64)
    outs = []
    for pos, x in plan:
        rows = [block.forward_batch([(cache, pos + i, x[:, i:i + 1])], tile=tile)[0] for i in range(x.shape[1])]
        outs.append(torch.cat(rows, dim=1))
    return outs


def _chunked_solo(block, plan, tile: int) -> list[torch.Tensor]:
    cache = block.new_cache(64)
    return [block.forward_batch([(cache, pos, x)], tile=tile)[0] for pos, x in plan]


def _packed(block, plans, tile: int, seed: int) -> list[list[torch.Tensor]]:
    """Step k packs chunk k of every session that has one, in a shuffled order."""
    rng = random.Random(seed)
    caches = [block.new_cache(64) for _ in plans]
    outs: list[list[torch.Tensor]] = [[] for _ in plans]
    for k in range(max(len(p) for p in plans)):
        ready = [i for i, p in enumerate(plans) if k < len(p)]
        rng.shuffle(ready)
        ys = block.forward_batch([(caches[i], *plans[i][k]) for i in ready], tile=tile)
        for i, y in zip(ready, ys):
            outs[i].append(y)
    return outs


def _first_difference(ref: list[torch.Tensor], got: list[torch.Tensor], plan) -> tuple[int, float] | None:
    for (pos, _), a, b in zip(plan, ref, got):
        if a.shape != b.shape:
            return pos, float("inf")
        for i in range(a.shape[1]):
            if not torch.equal(a[:, i], b[:, i]):
                return pos + i, (a[:, i].double() - b[:, i].double()).abs().max().item()
    return None


def check_block(block, tile: int = 1, *, seed: int = 0) -> InvarianceReport:
    """Prove on this block, dtype, device and BLAS that chunking and packing do not change any bits.

    Three sessions (prompts of 4, 6 and 1 positions, then decode rows, verify chunks of 2 and 3
    rows, and a rollback) run one row at a time (the reference), in their chunks alone, and, when
    ``tile > 1`` or in the fma or triton kernel mode (where a stage packs every session's rows into one
    forward), packed together in a shuffled order. Costs about 70 one-row forwards of the block.

    Args:
        block: a loaded :class:`swarm.model.block.LayerBlock`.
        tile: rows per GEMM to check (1: the solo mode every session may use; > 1: packed sessions).
        seed: seeds the random inputs and the packing order.
    Returns:
        An :class:`InvarianceReport`; never raises for a failed property (it reports it).
    """
    start = time.perf_counter()
    plans = _inputs(block, seed)
    refs = [_one_row_at_a_time(block, plan, tile) for plan in plans]
    kinds = [("chunked", [_chunked_solo(block, plan, tile) for plan in plans])]
    if tile > 1 or getattr(block, "kernel_mode", "rows") in ("fma", "triton"):  # a stage packs every session's rows
        kinds.append(("packed", _packed(block, plans, tile, seed)))
    reason = ""
    for kind, runs in kinds:
        for i, (plan, ref, got) in enumerate(zip(plans, refs, runs)):
            diff = _first_difference(ref, got, plan)
            if diff is not None:
                reason = (f"layers {block.layer_range} {str(block.dtype).removeprefix('torch.')} on "
                          f"{block.device}, {getattr(block, 'kernel_mode', 'rows')} kernels, tile {tile}: "
                          f"session {i} position {diff[0]} differs when {kind} "
                          f"(max abs difference {diff[1]:.3g})")
                break
        if reason:
            break
    return InvarianceReport(tile, not reason, reason, time.perf_counter() - start)


_REPORTS: dict[tuple, InvarianceReport] = {}


def check_block_once(block, tile: int = 1, cache_dir=None) -> InvarianceReport:
    """:func:`check_block`, run once for the same weights (``block.range_digest``), layer range, dtype,
    device, tile and torch thread count on the same machine and software: what the proof depends on.

    Within a process the report is kept in memory. With ``cache_dir`` it is also kept on disk under a
    key that adds the CPU (model name and feature flags), the GPU name, torch's version and build
    configuration, and the source of this package's kernels, so a stage restarted on the same machine
    reuses the proof it ran, and any change of hardware, library or kernel code proves again.
    """
    key = (getattr(block, "range_digest", "") or str(id(block)), str(block.layer_range), str(block.dtype),
           str(block.device), tile, torch.get_num_threads(), getattr(block, "kernel_mode", "rows"),
           getattr(block, "quantize", None) or "")
    if key in _REPORTS:
        return _REPORTS[key]
    path = None
    if cache_dir is not None and getattr(block, "range_digest", ""):
        digest = hashlib.sha256(json.dumps([list(map(str, key)), _machine()]).encode()).hexdigest()
        path = cache_dir / f"{digest}.json"
        try:
            data = json.loads(path.read_text())
            _REPORTS[key] = InvarianceReport(int(data["tile"]), bool(data["ok"]), str(data["reason"]), 0.0)
            return _REPORTS[key]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not proven here yet (or an unreadable file): prove now
    report = _REPORTS[key] = check_block(block, tile)
    if path is not None:
        try:
            write_atomic(path, json.dumps({"tile": report.tile, "ok": report.ok, "reason": report.reason,
                                           "seconds": report.seconds}))
        except OSError:
            pass  # a read-only cache only costs the next start another proof
    return report


def _machine() -> list[str]:
    """What a proof's result may depend on besides the block: CPU, GPU, torch build, kernel source
    (and, once the triton kernels are loaded, Triton's version and whether its interpreter runs them)."""
    cpu = platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text()
        fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
                  for line in info.splitlines() if ":" in line}
        cpu = f"{fields.get('vendor_id', '')} {fields.get('model name', '')} {fields.get('flags', '')}"
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    here = Path(__file__).resolve().parent
    files = [*sorted(here.glob("*.py")), *sorted(here.glob("*.c")),
             here.parent / "model" / "block.py", here.parent / "model" / "cache.py"]
    source = hashlib.sha256(b"".join(p.read_bytes() for p in files if p.exists())).hexdigest()
    triton_ops = sys.modules.get("swarm.kernels.triton_ops")
    kernels = "" if triton_ops is None else \
        f"triton {triton_ops.triton.__version__} interpreted {triton_ops.INTERPRETED}"
    return [platform.machine(), cpu, gpu, torch.__version__, torch.__config__.show(), source, kernels]
