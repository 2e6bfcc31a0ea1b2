"""Row-invariant arithmetic for a layer block: a row's result never depends on its neighbours.

Owns: the row-invariant paths of stock torch ops (the rows mode's): :func:`linear_rows` (GEMMs in fixed aligned
tiles), :func:`per_token` and :func:`per_tile` (norms, activations), :func:`attention_rows` (per query row),
:class:`RotaryTable` and the SDPA backends allowed on CUDA (docs/architecture.md, "Row-invariant forwards").
"""

from __future__ import annotations

import contextlib

import torch


ALIGN_BYTES = 64  # what torch's CPU allocator (c10 gAlignment) and CUDA's caching allocator give


def fresh(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous copy of ``x`` (new allocation: the allocator's alignment, no shared storage)."""
    return x.clone(memory_format=torch.contiguous_format)


def canonical(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if it is contiguous and starts on an allocator-aligned address, else a fresh copy:
    either way the kernel sees what it would see for a freshly allocated tensor of this shape."""
    if x.is_contiguous() and x.data_ptr() % ALIGN_BYTES == 0:
        return x
    return fresh(x)


# Output columns per GEMV when a weight is too big for the caches (an LM head: V x D): every row's
# GEMVs then reuse one cached column block instead of streaming the whole matrix per row. A fixed
# constant, not a cache size: a row's bits may depend on the block width, so every machine uses this.
COLUMN_BLOCK = 2048
COLUMN_BLOCK_MIN_BYTES = 16 << 20


def linear_rows(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    """``x @ weight_t + bias`` for (M, K) rows as fixed (tile, K) GEMMs, each on an aligned tile.

    With ``tile == 1`` and a weight of at least ``COLUMN_BLOCK_MIN_BYTES``, each row's GEMV runs in
    fixed blocks of ``COLUMN_BLOCK`` output columns, all rows per block (same calls for a decode
    row, just cache-friendly for a chunk).

    Args:
        x: (M, K) rows, any M >= 0; the block dtype and device.
        weight_t: (K, N), possibly a transposed view of a Linear's (N, K) weight.
        bias: (N,) or None.
        tile: rows per GEMM, >= 1; the last tile is zero-padded.
    Returns:
        (M, N), a new tensor.
    """
    m = x.shape[0]
    n_out = weight_t.shape[1]
    big = weight_t.numel() * weight_t.element_size() >= COLUMN_BLOCK_MIN_BYTES
    blocked = tile == 1 and n_out > COLUMN_BLOCK and big
    if m == 1 and tile == 1 and not blocked:  # a decode row: the very call the loop below makes, without it
        a = canonical(x)
        return torch.mm(a, weight_t) if bias is None else torch.addmm(bias, a, weight_t)
    if blocked:
        rows = [canonical(x[i:i + 1]) for i in range(m)]
        out = x.new_empty((m, n_out))
        for c in range(0, n_out, COLUMN_BLOCK):
            w = weight_t[:, c:c + COLUMN_BLOCK]
            b = None if bias is None else bias[c:c + COLUMN_BLOCK]
            for i, a in enumerate(rows):
                out[i, c:c + COLUMN_BLOCK] = (torch.mm(a, w) if b is None else torch.addmm(b, a, w))[0]
        return out
    outs = []
    for i in range(0, m, tile):
        part = x[i:i + tile]
        n = part.shape[0]
        if n < tile:
            a = x.new_zeros((tile, x.shape[1]))
            a[:n] = part
        else:
            a = canonical(part)
        y = torch.mm(a, weight_t) if bias is None else torch.addmm(bias, a, weight_t)
        outs.append(y if n == tile else y[:n])
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs) if outs else x.new_empty((0, weight_t.shape[1]))


def per_token(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply ``fn`` to each token of ``x`` separately, each a fresh (1, 1, ...) copy.

    Args:
        fn: a shape-preserving function of one token (a norm, an activation).
        x: (1, N, ...) in the packed token-major layout.
    Returns:
        (1, N, ...), ``fn`` of every token, concatenated.
    """
    if x.dim() < 2 or x.shape[0] != 1:
        raise ValueError(f"per_token wants (1, N, ...) tensors, got {tuple(x.shape)}")
    if x.shape[1] == 1:  # one token: x[:, 0:1] is x itself (same storage, offset and strides)
        return fn(canonical(x))
    outs = [fn(canonical(x[:, i:i + 1])) for i in range(x.shape[1])]
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs, dim=1) if outs else fn(x)


TILE_ROWS = 16  # rows per call of a norm or activation in the fma mode; a decode row is padded to it


def per_tile(fn, x: torch.Tensor, rows: int = TILE_ROWS) -> torch.Tensor:
    """Apply ``fn`` to ``x``'s tokens in calls of exactly ``rows`` tokens, the last zero-padded, each
    an aligned contiguous (1, rows, ...) tensor (:func:`canonical`): every call has one shape, so a
    token's bits depend on its slot at most (vector tails), which :func:`swarm.kernels.check.check_block`
    covers, never on how many tokens came.

    Args:
        fn: a shape-preserving, token-wise function (a norm, an activation).
        x: (1, N, ...) in the packed token-major layout.
    Returns:
        (1, N, ...), ``fn`` of every token.
    """
    if x.dim() < 2 or x.shape[0] != 1:
        raise ValueError(f"per_tile wants (1, N, ...) tensors, got {tuple(x.shape)}")
    n = x.shape[1]
    outs = []
    for i in range(0, n, rows):
        part = x[:, i:i + rows]
        k = part.shape[1]
        if k == rows:
            buf = canonical(part)
        else:
            buf = x.new_zeros((1, rows, *x.shape[2:]))
            buf[:, :k] = part
        y = fn(buf)
        outs.append(y if k == rows else y[:, :k])
    if not outs:
        return fn(x)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def attention_rows(sdpa, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int,
                   mask_of, **kwargs) -> torch.Tensor:
    """One session's attention, one query row at a time, each exactly as a decode step would run it.

    Args:
        sdpa: transformers' ``sdpa_attention_forward`` (or a function with its signature).
        module: the attention module (scaling, GQA groups, sliding window).
        query: (1, H, T, Dh) this session's queries for positions ``[pos, pos + T)``, after rotary.
        keys, values: (1, Hkv, pos + T, Dh) the session's cache up to its last new position.
        pos: absolute position of the first query row.
        mask_of: ``mask_of(module, position, 1)`` -> boolean mask or None for a one-row query.
        kwargs: passed on to ``sdpa`` (dropout, scaling, sliding_window, ...).
    Returns:
        (1, T, H, Dh) attention output, token-major as transformers' attention functions return it.
    """
    outs = []
    for i in range(query.shape[2]):
        end = pos + i + 1  # a decode step at position pos + i sees keys [0, pos + i]
        out, _ = sdpa(module, fresh(query[:, :, i:i + 1]), keys[:, :, :end], values[:, :, :end],
                      mask_of(module, pos + i, 1), **kwargs)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def attention_backends(device: torch.device):
    """The SDPA backends a stage allows on ``device``, as a context manager.

    On CUDA: flash, memory-efficient, then math; not cuDNN attention, which builds a new plan for
    every new key length (measured on an H200, torch 2.11: ~11 ms per call once per layer per decode
    step, 0.09 ms for a length seen before) and a decode step's key length is new every time.
    Elsewhere: no restriction (a null context).
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def is_norm(module: torch.nn.Module) -> bool:
    """True for the per-token normalizations of the supported families (RMSNorm kinds, LayerNorm)."""
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def is_activation(module: torch.nn.Module) -> bool:
    """True for activation modules (transformers.activations, torch.nn activations)."""
    return type(module).__module__ in ("transformers.activations", "torch.nn.modules.activation")


def is_gemm(module: torch.nn.Module) -> bool:
    """True for affine maps run as GEMMs: ``nn.Linear`` and GPT-2's ``Conv1D`` (weight kept (K, N))."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


class RotaryTable:
    """Rotary cos/sin per absolute position, each computed once by a one-position call of the
    model's own rotary module and then looked up, so a position's values never depend on which
    other positions shared the call (vectorized cos/sin give a tensor's tail other bits).

    LongRoPE (Phi-3's ``rope_type: longrope``) has two factor sets, and transformers picks one per
    forward for every position of it: the short factors while the sequence holds at most
    ``original_max_position_embeddings`` positions (``switch``), the long ones for all positions once
    it holds more. A one-position call at p picks by p alone, so the table holds the natural values
    (short below ``switch``, long from it) and, for a long sequence, the long values below ``switch``.

    Args:
        rotary: the family's rotary embedding module (``rotary(x, position_ids) -> (cos, sin)``).
    """

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.switch = longrope_switch(rotary)  # None: one factor set at every length
        self.cos: torch.Tensor | None = None  # (P, Dh) for positions [0, P)
        self.sin: torch.Tensor | None = None
        self._long_head: tuple[torch.Tensor, torch.Tensor] | None = None  # (switch, Dh) long cos, sin

    def lookup(self, like: torch.Tensor, position_ids: torch.Tensor,
               long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (1, N, Dh) in ``like``'s dtype for (1, N) or (N,) int64 positions.

        ``long_rows``: (N,) bool, LongRoPE only: the rows of sequences longer than ``switch``, which
        take the long factors below ``switch`` too; None: no such row.
        """
        flat = position_ids.reshape(-1)
        need = int(flat.max().item()) + 1 if flat.numel() else 0
        have = 0 if self.cos is None else self.cos.shape[0]
        if need > have or self.cos.dtype != like.dtype:
            if self.cos is not None and self.cos.dtype != like.dtype:
                self.cos = self.sin = self._long_head = None
                have = 0
            parts = [self.rotary(like[:, :1], torch.tensor([[p]], device=like.device)) for p in range(have, need)]
            new_cos = torch.cat([c[0] for c, _ in parts]) if parts else None
            new_sin = torch.cat([s[0] for _, s in parts]) if parts else None
            self.cos = new_cos if self.cos is None else torch.cat([self.cos, new_cos])
            self.sin = new_sin if self.sin is None else torch.cat([self.sin, new_sin])
        cos, sin = self.cos[flat], self.sin[flat]
        if long_rows is not None and self.switch is not None:
            swap = long_rows.reshape(-1).to(flat.device) & (flat < self.switch)
            if bool(swap.any()):
                long_cos, long_sin = self._long_below_switch(like)
                cos, sin = cos.clone(), sin.clone()
                cos[swap], sin[swap] = long_cos[flat[swap]], long_sin[flat[swap]]
        return cos.unsqueeze(0), sin.unsqueeze(0)

    def _long_below_switch(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Long-factor cos, sin (switch, Dh) of positions [0, switch): one-position calls of the module's
        undecorated forward with the long inverse frequencies (the ones transformers swaps in)."""
        if self._long_head is None:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            module = self.rotary
            raw = type(module).forward.__wrapped__  # without dynamic_rope_update's per-call choice
            long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, like.device, seq_len=self.switch + 1)
            kept = module.inv_freq.clone()
            try:
                module.inv_freq.copy_(long_inv)
                parts = [raw(module, like[:, :1], torch.tensor([[p]], device=like.device)) for p in range(self.switch)]
            finally:
                module.inv_freq.copy_(kept)
            self._long_head = (torch.cat([c[0] for c, _ in parts]), torch.cat([s[0] for _, s in parts]))
        return self._long_head


def longrope_switch(rotary: torch.nn.Module) -> int | None:
    """``original_max_position_embeddings`` of a LongRoPE rotary module (the longest sequence that takes
    the short factors), or None for any other rotary (one factor set at every length)."""
    if getattr(rotary, "rope_type", None) != "longrope" or not hasattr(type(rotary).forward, "__wrapped__"):
        return None
    config = rotary.config
    params = getattr(config, "rope_parameters", None) or {}
    switch = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return int(switch) if switch else None
