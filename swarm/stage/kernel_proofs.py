"""The stage's kernel proofs, run before it serves: that the kernels give a row the same bits in
any forward (:func:`swarm.kernels.check.check_block`), for one GEMV per row at start-up
(``prove_kernels``, with a fallback from the fma or triton kernel mode to rows where the proof fails)
and for ``--batch-tile``-row GEMMs before the first session that may be packed (``prove_tile``).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def prove_kernels(block) -> dict:
    """Run the start-up invariance check (:func:`swarm.kernels.check.check_block`) for the mode every
    session may use (one GEMV per row) and log what was proven.

    Returns:
        ``{"rows_ok", "reason", "check_s", "mode", "isa", "library", "arithmetic", "why"}`` for READY,
        ``info_ok`` and ``/metrics`` (``kernels``): rows_ok False means this stage cannot promise that a
        verify chunk or a replay gives decode's bits; mode is the block's ``kernel_mode`` after the
        proof (``fma`` or ``triton``, or ``rows`` after a fallback, ``why`` then says which proof
        failed); the rest: :class:`swarm.kernels.facts.KernelsInUse`.
    """
    from swarm.config import cache_root
    from swarm.kernels.check import check_block_once
    from swarm.kernels.facts import kernels_in_use

    rows = check_block_once(block, 1, cache_root() / "proofs")
    spent = rows.seconds
    if not rows.ok and block.kernel_mode != "rows":
        log.error("kernels.fallback from=%s to=rows %s: every chunk now runs one row at a time (exact, slower)",
                  block.kernel_mode, rows.reason)
        block.set_kernel_mode("rows", why=f"the {block.kernel_mode} kernels failed the start-up proof: {rows.reason}")
        rows = check_block_once(block, 1, cache_root() / "proofs")
        spent += rows.seconds
    used = kernels_in_use(block.kernel_mode, getattr(block, "kernel_why", ""))
    if rows.ok:
        log.info("kernels.proven mode=%s isa=%s library=%r layers=%s seconds=%.2f", used.mode, used.isa or "-",
                 used.library, block.layer_range, rows.seconds)
    else:
        log.error("kernels.not_invariant mode=rows %s: speculative, healed and batched output of this stage may "
                  "differ from greedy; coordinators are told (info kernels.rows_ok=false)", rows.reason)
    return {"rows_ok": rows.ok, "reason": rows.reason, "check_s": round(spent, 3), **used.as_dict()}


def prove_tile(block, tile: int):
    """The proof of ``tile``-row GEMMs for packed sessions (worker thread), logged either way."""
    from swarm.config import cache_root
    from swarm.kernels.check import check_block_once

    report = check_block_once(block, tile, cache_root() / "proofs")
    if report.ok:
        log.info("kernels.proven mode=tile tile=%d layers=%s seconds=%.2f", tile, block.layer_range, report.seconds)
    else:
        log.warning("batch.not_invariant %s: packed sessions run one GEMV per row instead, so results stay "
                    "identical to solo runs", report.reason)
    return report
