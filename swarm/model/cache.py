"""Per-session KV cache for one stage's block of layers, addressed by absolute position.

Owns: :class:`KVCache`: every held layer's key/value rows for one session and ``kv_len``, the committed positions;
a rollback sets ``kv_len`` back and the next chunk overwrites the stale rows. It duck-types the ``update`` of
``transformers.Cache``, so transformers' own attention modules write into it.
"""

from __future__ import annotations

import torch

from swarm.errors import ContextOverflow, ProtocolError


class KVCache:
    """Growable per-layer K/V buffers, position-major: (B, capacity, Hkv, Dh).

    Position-major so that the view of the first S positions handed to attention has the same
    strides whatever the buffer's capacity: how far a session's cache has grown (a speculative
    chunk grows it earlier than decode steps would) must not change a row's arithmetic.

    Usage per forward: ``begin(pos, T)``; every layer calls ``update``; then ``commit()``.

    Args:
        layer_ids: absolute indices of the layers this cache serves (the modules' ``layer_idx``).
        max_len: maximum context length in positions; exceeding it raises ContextOverflow.
    """

    def __init__(self, layer_ids: list[int], max_len: int) -> None:
        self.layer_ids = list(layer_ids)
        self.max_len = int(max_len)
        self.kv_len = 0
        self._pending = 0
        self.version = 0  # bumped whenever a layer's buffers are replaced (grown): addresses held elsewhere go stale
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        # LongRoPE (LayerBlock.rotary_long): whether rows [0, kv_len) hold the long factors, and the end of
        # the frame the next forward computes a slice of (a stage that slices frames sets it; 0: none)
        self.rotary_long = False
        self.frame_end = 0

    def begin(self, pos: int, new_tokens: int) -> None:
        """Prepare to write positions ``[pos, pos + new_tokens)``, rolling back if ``pos < kv_len``.

        Raises:
            ProtocolError: if ``pos > kv_len`` (a gap: positions would be skipped).
            ContextOverflow: if ``pos + new_tokens > max_len``.
        """
        if pos < 0 or pos > self.kv_len:
            raise ProtocolError(f"chunk at pos {pos} is not contiguous with the session's kv_len {self.kv_len}")
        if pos + new_tokens > self.max_len:
            raise ContextOverflow(
                f"positions [{pos}, {pos + new_tokens}) exceed the maximum context of {self.max_len}"
            )
        self.kv_len = pos  # rollback (no-op when pos == kv_len)
        self._pending = new_tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write T new rows for ``layer_idx`` at ``[kv_len, kv_len + T)`` and return all S + T rows.

        Args:
            key_states, value_states: (B, Hkv, T, Dh) in the stage dtype, after rotary.
            layer_idx: the layer's absolute index.
        Returns:
            (keys, values), each (B, Hkv, kv_len + T, Dh): views into the buffers (strides set by
            kv_len + T alone).
        """
        t = key_states.shape[2]
        end = self.kv_len + t
        b, h, _, dh = key_states.shape
        keys, values = self._room(layer_idx, b, h, dh, value_states.shape[-1], key_states.dtype, key_states.device, end)
        keys[:, self.kv_len:end] = key_states.transpose(1, 2)
        values[:, self.kv_len:end] = value_states.transpose(1, 2)
        return _prefix(keys, end), _prefix(values, end)

    def reserve(self, layer_ids, needed: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Make room for ``needed`` positions in each of ``layer_ids``' buffers (B = 1; grown as ``update``
        grows them) and return their (keys, values) buffers, each (1, capacity, Hkv, Dh), for a kernel
        that writes rows itself. ``version`` changes whenever a buffer is replaced."""
        return [self._room(i, 1, heads, head_dim, head_dim, dtype, device, needed) for i in layer_ids]

    def _room(self, layer_idx, b, h, dk, dv, dtype, device, needed):
        keys = self._keys.get(layer_idx)
        if keys is None or keys.shape[1] < needed or (keys.shape[0], keys.shape[2]) != (b, h):
            return self._grow(layer_idx, b, h, dk, dv, dtype, device, needed)
        return keys, self._values[layer_idx]

    def _grow(self, layer_idx, b, h, dk, dv, dtype, device, needed):
        capacity = min(self.max_len, max(256, 1 << (needed - 1).bit_length()))
        capacity = max(capacity, needed)
        new_k = torch.zeros((b, capacity, h, dk), dtype=dtype, device=device)
        new_v = torch.zeros((b, capacity, h, dv), dtype=dtype, device=device)
        old_k = self._keys.get(layer_idx)
        if old_k is not None and (old_k.shape[0], old_k.shape[2]) == (b, h):
            new_k[:, : self.kv_len] = old_k[:, : self.kv_len]
            new_v[:, : self.kv_len] = self._values[layer_idx][:, : self.kv_len]
        self._keys[layer_idx], self._values[layer_idx] = new_k, new_v
        self.version += 1
        return new_k, new_v

    def commit(self) -> None:
        """Advance ``kv_len`` past the rows written since ``begin``."""
        self.kv_len += self._pending
        self._pending = 0

    def abort(self) -> None:
        """Forget a forward that failed midway; ``kv_len`` stays where ``begin`` set it."""
        self._pending = 0

    def nbytes(self) -> int:
        """Bytes held by the buffers (capacity, not just ``kv_len``)."""
        return sum(t.numel() * t.element_size() for t in (*self._keys.values(), *self._values.values()))


def _prefix(buf: torch.Tensor, end: int) -> torch.Tensor:
    """(B, Hkv, end, Dh) view of the first ``end`` positions of a (B, capacity, Hkv, Dh) buffer, with
    strides that depend on ``end`` only (the batch stride too), never on the capacity."""
    b, _, h, dh = buf.shape
    batch_stride = end * h * dh if b == 1 else buf.stride(0)  # B is 1 in swarm; a size-1 dim's stride is free
    return buf.as_strided((b, h, end, dh), (batch_stride, dh, h * dh, 1))
