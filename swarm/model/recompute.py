"""Re-running a block on a stage's opened input rows: what an auditor (or a proof's verifier) computes.

Owns: :func:`recompute`: opened input rows in, the output rows the block gives for them out, encoded as the stage sent
them (hidden states in the wire dtype; at the tail the greedy tokens). One forward from position 0 over a fresh KV
cache: the block is row-invariant (``swarm.kernels.check``), so the stage's chunking changes no bits.
"""

from __future__ import annotations

import torch

from swarm import openings, wire


def recompute(block, inputs: list[tuple[str, bytes]], out_kind: str | None, *, span=None, tile: int = 1) -> list[bytes]:
    """The output rows of ``block`` over ``span`` for input rows at positions ``0 .. T-1``.

    Args:
        block: a loaded ``LayerBlock`` holding ``span``; its dtype and kernel mode as the stage's class says.
        inputs: T pairs ``(kind, row bytes)``: kind ``tokens`` (4-byte ids, at the head) or a wire dtype
            name (hidden-state rows of D values, float8 rows ending in their scale); one kind throughout.
        out_kind: the stage's output rows' kind: ``token_ids`` (the tail: greedy argmax), or a wire dtype
            name for hidden states (None: the block's dtype).
        span: the layers to run (default the block's); tile: rows per GEMM (the session's, from its class).
    Returns:
        T output rows (bytes), one per position.
    Raises:
        ValueError: no inputs, mixed kinds, rows of the wrong size or kind for the span, an unknown dtype.
    """
    if not inputs or len({k for k, _ in inputs}) != 1:
        raise ValueError("recompute needs input rows of one kind")
    kind, rows = inputs[0][0], [r for _, r in inputs]
    span = block.check_span(span)
    if (kind == "tokens") != (span.start == 0):
        raise ValueError(f"layers {span} take {'token ids' if span.start == 0 else 'hidden states'}, not {kind!r} rows")
    if kind == "tokens":
        x = torch.tensor([openings.token_ids(rows)], dtype=torch.long)
    else:
        x = wire.decode_tensor(openings.tensor_map(kind, rows, block.hidden_size))
    n = len(rows)
    (y,) = block.forward_batch([(block.new_cache(n, span), 0, x)], tile=tile, span=span)
    if span.end == block.num_layers:
        return openings.token_rows(y[0].argmax(dim=-1).tolist())
    dtype = block.dtype if out_kind is None else wire.WIRE_DTYPES.get(out_kind)
    if dtype is None:
        raise ValueError(f"unknown wire dtype {out_kind!r}")
    return openings.hidden_rows(wire.encode_tensor(y, dtype=dtype))[1]
