"""Judging a stage's opened work, and re-checking a fraud proof, with the layer range's weights.

Owns: :class:`Blocks` (an auditor's blocks by layer range and dtype), :func:`class_for` (the class this process
would run a receipt's session in, and whether it is the receipt's), :func:`judge` (opened rows re-run: a
:class:`Verdict`, with a fraud proof on a mismatch) and :func:`verify_proof`. No networking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from swarm import proofs, repro
from swarm.errors import ConfigError, ProofRefused, SwarmError
from swarm.ranges import LayerRange

log = logging.getLogger(__name__)

OUTCOMES = ("passed", "failed", "refused", "unavailable", "not comparable", "unauditable", "skipped")


@dataclass(frozen=True)
class Verdict:
    """One stage's audit for one job.

    Attributes:
        peer_id, layers: the stage; ``job_id``: the job; ``outcome``: one of ``OUTCOMES`` (``failed``:
            its signed rows are not what its block computes, ``proof`` holds the evidence; ``refused``:
            it did not open a window, which counts as failed without a proof; ``unavailable``: it has no
            record of the job because it restarted after the job ended (counted apart, not as failed,
            never excluded); ``not comparable``: no
            class in common, never "cheated"); ``reason``: one line; ``windows``: the windows opened;
            ``positions``: the positions compared.
    """

    peer_id: str
    layers: tuple
    job_id: str
    outcome: str
    reason: str = ""
    windows: int = 0
    positions: int = 0
    proof: dict | None = field(default=None, repr=False)

    def line(self) -> str:
        """``FAILED stage 12D3Koo... [1, 3) job j: ...`` for a person."""
        return (f"{self.outcome.upper()} stage {self.peer_id[:16]}... [{self.layers[0]}, {self.layers[1]}) "
                f"job {self.job_id[:16]}: {self.reason}")


class Blocks:
    """The blocks an auditor runs, loaded from ``model_dir`` on first use and kept.

    Args:
        model_dir: a local model directory (HF layout) holding the ranges to audit.
        device: where to run (``cpu``: the classes of CPU stages).
    """

    def __init__(self, model_dir: Path | str, device: str = "cpu") -> None:
        self.model_dir, self.device = Path(model_dir), device
        self._blocks: dict = {}

    def get(self, layers, dtype: str, quantize: str | None = None):
        """The block of ``layers`` ([start, end)) in ``dtype``, its weights held as ``quantize`` (int8, int4
        or None: as loaded).

        Raises:
            ModelError / ConfigError: the model directory lacks the range, a bad dtype or quantization.
        """
        from swarm.model.block import load_block

        key = (tuple(layers), dtype, quantize)
        if key not in self._blocks:
            self._blocks[key] = load_block(self.model_dir, LayerRange(*layers), dtype=dtype, device=self.device,
                                           quantize=quantize)
        return self._blocks[key]

    def for_receipt(self, receipt: dict):
        """The block a stage receipt's session ran: its layers, dtype and, from its class, quantization."""
        scheme = quantized(receipt)
        layers, dtype = receipt["layers"], receipt.get("dtype", "float32")
        return self.get(layers, dtype) if scheme is None else self.get(layers, dtype, scheme)


def quantized(receipt: dict) -> str | None:
    """The quantization scheme a receipt's class names (None: weights as loaded, or no class)."""
    facts = receipt.get("repro", {}).get("facts", {}) if isinstance(receipt.get("repro"), dict) else {}
    quant = facts.get("quant") if isinstance(facts, dict) else None
    scheme = quant.get("scheme") if isinstance(quant, dict) else None
    return scheme if isinstance(scheme, str) else None


def class_for(block, receipt: dict) -> tuple[repro.ReproClass | None, int, str]:
    """The class this process runs ``receipt``'s session in (its kernel mode and tile), and why not.

    Returns:
        ``(class, tile, reason)``: ``reason`` is empty when the class is the receipt's, else a line
        starting ``not comparable:`` (``class`` None when the receipt's class does not read).
    In the ``rows`` mode this process's torch thread count becomes the receipt's (a fact of that
    class, and the auditor's to choose): an auditor on 2 threads re-runs a 1-thread stage's work.
    """
    from swarm.kernels.facts import stage_class

    try:
        theirs = repro.parse(receipt.get("repro"))
    except ValueError as exc:
        return None, 1, f"not comparable: the receipt's class does not read ({exc})"
    kernel = theirs.facts.get("kernel") if isinstance(theirs.facts.get("kernel"), dict) else {}
    tile = kernel.get("tile", 1) if isinstance(kernel.get("tile", 1), int) else 1
    mode = kernel.get("mode")
    if mode in ("fma", "triton", "rows") and block.kernel_mode != mode:
        try:
            block.set_kernel_mode(mode)
        except ConfigError as exc:
            return None, tile, f"not comparable: this machine cannot run the {mode} kernels ({exc})"
    threads = kernel.get("threads")
    if mode == "rows" and isinstance(threads, int) and 0 < threads <= 1024:
        import torch

        if torch.get_num_threads() != threads:  # a free choice of the auditor's: the BLAS's bits follow the
            torch.set_num_threads(threads)  # thread count in the rows mode, so re-run at the stage's
    span = LayerRange(*receipt["layers"])
    mine = stage_class(block, block.check_span(span), max(1, tile))
    same = repro.comparable(theirs, mine)
    return mine, max(1, tile), "" if same else same.reason


def _rows(openings: list) -> dict[int, tuple]:
    return {o.start + i: r for o in openings for i, r in enumerate(o.rows)}


def _bound(rows: dict, pred_rows: dict | None, end: int) -> str:
    """Why the accused's inputs in [0, end) are not all present and equal to the predecessor's sent rows."""
    for q in range(end):
        got = rows.get(q, (None, None))[1]
        if got is None:
            return f"position {q} has no input row (taken from a prefix cache or never computed): it cannot be re-run"
        if pred_rows is not None:
            sent = pred_rows.get(q, (None,) * 4)[3]
            if sent is None or bytes(sent) != bytes(got):
                return f"input not bound: at position {q} the stage's input row is not the row its predecessor signed"
    return ""


def judge(block, receipt: dict, openings: list, raw: list[dict], pred: tuple | None, *, sampled: bool,
          auditor: str, sign, now_ms: int) -> Verdict:
    """Re-run ``block`` on a stage's opened inputs and compare every opened output row.

    Args:
        block: the range's block (:class:`Blocks`); receipt: the stage's signed receipt.
        openings / raw: its checked ``swarm.openings.Opening``s of windows 0 .. k and the signed maps.
        pred: ``(receipt, openings, raw)`` of the predecessor (None at the head).
        sampled: the job sampled its tokens (the tail's rows cannot be re-derived then).
        auditor: this auditor's PeerId; ``sign(bytes) -> bytes`` its key; now_ms: wall-clock ms.
    Returns:
        A :class:`Verdict` (``failed`` with a ``swarm.proofs`` proof at the first mismatching position).
    """
    from swarm.model.recompute import recompute

    base = dict(peer_id=receipt["peer_id"], layers=tuple(receipt["layers"]), job_id=receipt["job_id"],
                windows=len(openings))
    tail = receipt["layers"][1] == receipt.get("num_layers")
    if tail and sampled:
        return Verdict(**base, outcome="not comparable", reason="not comparable: the job sampled its tokens, and "
                                                                "the sampling settings are not in the receipt")
    mine, tile, why = class_for(block, receipt)
    if why:
        return Verdict(**base, outcome="not comparable", reason=why)
    rows = _rows(openings)
    end = max(rows) + 1 if rows else 0
    unbound = _bound(rows, None if pred is None else _rows(pred[1]), end)
    if unbound:
        return Verdict(**base, outcome="unauditable", reason=unbound)
    out_kind = next((r[2] for r in rows.values() if r[2] is not None), None)
    try:
        got = recompute(block, [(rows[q][0], rows[q][1]) for q in range(end)], out_kind,
                        span=LayerRange(*receipt["layers"]), tile=tile)
    except (ValueError, TypeError, SwarmError) as exc:  # the stage signed rows that are not rows of its layers
        return Verdict(**base, outcome="failed", reason=f"its signed rows do not decode as its layers' input: {exc}")
    compared = 0
    for q in range(end):
        claimed = rows[q][3]
        if claimed is None:
            continue
        compared += 1
        if bytes(claimed) != got[q]:
            proof = proofs.build_proof(receipt=receipt, openings=raw, pred_receipt=None if pred is None else pred[0],
                                      pred_openings=None if pred is None else pred[2], position=q,
                                      recomputed=got[q], auditor_class=mine.as_dict(), auditor=auditor, sign=sign,
                                      created_ms=now_ms)
            return Verdict(**base, outcome="failed", positions=compared, proof=proof,
                           reason=f"position {q}: the stage's output row is not what layers [{receipt['layers'][0]}, "
                                  f"{receipt['layers'][1]}) compute on its input (class {mine.id})")
    return Verdict(**base, outcome="passed", positions=compared,
                   reason=f"{compared} output rows of {len(openings)} windows reproduced bit for bit (class {mine.id})")


@dataclass(frozen=True)
class ProofCheck:
    """A proof that held: ``accused`` cheated at ``position`` of ``job_id``; ``note``: a remark (the
    auditor's own recomputed row differing from this machine's, which does not clear the accused)."""

    accused: str
    auditor: str
    job_id: str
    position: int
    layers: tuple
    note: str = ""

    def line(self) -> str:
        return (f"VALID proof: stage {self.accused} [{self.layers[0]}, {self.layers[1]}) sent an output row at "
                f"position {self.position} of job {self.job_id[:16]} that its layers do not compute on its input"
                + (f" ({self.note})" if self.note else ""))


def verify_proof(proof: dict, blocks: Blocks) -> ProofCheck:
    """Re-check a fraud proof in one pass: :func:`swarm.proofs.check_proof`, then re-run the accused's
    layers on its opened inputs up to the claimed position and compare with its signed output row.

    Raises:
        ProofRefused: the proof does not hold (``.reason``: see ``swarm.proofs``; ``not comparable``
            when this machine cannot run the receipt's class; ``malformed`` when the signed rows do not
            decode; ``honest stage framed``, with ``.against`` the auditor, when the re-run gives the
            stage's own row).
    """
    from swarm.model.recompute import recompute

    claim = proofs.check_proof(proof)
    layers = tuple(claim.receipt["layers"])
    try:
        block = blocks.for_receipt(claim.receipt)
    except Exception as exc:  # a missing range or dtype: say so, never crash on someone else's document
        raise proofs.refused("not comparable", f"cannot load layers {list(layers)}: {exc}") from None
    _, tile, why = class_for(block, claim.receipt)
    if why:
        raise proofs.refused("not comparable", why)
    try:
        got = recompute(block, list(claim.inputs), claim.out_kind, span=LayerRange(*layers), tile=tile)[claim.position]
    except (ValueError, TypeError, IndexError, SwarmError) as exc:  # rows the accused signed that do not decode
        raise proofs.refused("malformed", f"the opened rows cannot be re-run on layers {list(layers)}: {exc}") from None
    if got == claim.claimed:
        raise proofs.refused("honest stage framed", f"layers {list(layers)} compute the stage's own output row at "
                                                   f"position {claim.position}: this is evidence against the auditor "
                                                   f"{claim.auditor}", against=claim.auditor)
    note = "" if got == claim.recomputed else "the auditor's recomputed row differs from this machine's"
    return ProofCheck(claim.accused, claim.auditor, claim.receipt["job_id"], claim.position, layers, note)


__all__ = ["Blocks", "ProofCheck", "ProofRefused", "Verdict", "class_for", "judge", "verify_proof"]
