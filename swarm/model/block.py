"""A stage's block of decoder layers ``[start, end)``, loaded from only its own tensors.

Owns: building transformers' own decoder-layer, embedding, norm and rotary modules for one layer
range (via a per-family adapter), loading exactly the tensors those modules need from the
safetensors shards (mmap), and the forward over a session's KV cache at absolute positions.
Stage 0 adds the token embedding (and, for GPT-2, the learned position embedding); the tail adds
the final norm and the LM head.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.errors import ConfigError, ModelError, ProtocolError
from swarm.kernels import fma, invariant
from swarm.kernels.invariant import RotaryTable
from swarm.model import fused, mla, moe, qcheckpoint, qformats
from swarm.model.cache import KVCache
from swarm.weights.families import FAMILIES, Family  # noqa: F401  (re-exported; the table is torch-free there)
from swarm.ranges import LayerRange

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def pick_device(device: str = "auto") -> torch.device:
    """Resolve ``auto|cpu|cuda|mps`` to a torch device.

    Raises:
        ConfigError: if the requested device is not available on this machine.
    """
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but CUDA is not available on this machine")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("--device mps was requested but MPS is not available on this machine")
    if device not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"unknown device {device!r}: use auto, cpu, cuda or mps")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Resolve ``auto`` or a dtype name: auto is float32 on CPU, bfloat16 on CUDA, float16 on MPS.

    Raises:
        ConfigError: on an unknown dtype name.
    """
    if dtype == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_config(model_dir: Path):
    """Load the transformers config of ``model_dir`` and check the family is supported.

    Raises:
        ModelError: if config.json is missing/invalid or the family has no adapter.
    """
    from transformers import AutoConfig

    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{model_dir} has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelError(f"cannot read {cfg_path}: {exc}") from exc
    if config.model_type not in FAMILIES:
        raise ModelError(
            f"model family {config.model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelError(f"{cfg_path}: {name} must be a positive integer, got {value!r}")
    for name in ("num_key_value_heads", "head_dim", "max_position_embeddings", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ModelError(f"{cfg_path}: {name} must be a positive integer, got {value!r}")
    config._attn_implementation = RAGGED_ATTENTION
    if config.model_type in moe.MOE_FAMILIES:  # transformers' loop over experts (swarm.model.moe runs it per token)
        config._experts_implementation = "eager"
    return config


RAGGED_ATTENTION = "swarm_ragged"


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(RAGGED_ATTENTION, _ragged_attention)


def _get(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


class LayerBlock(torch.nn.Module):
    """Decoder layers ``[start, end)`` of a causal LM, plus the embedding (head) / norm and LM head (tail).

    Build with :func:`load_block`. Attributes: ``layer_range``, ``num_layers`` (L of the model),
    ``hidden_size`` (D), ``vocab_size`` (V), ``is_head``, ``is_tail``, ``dtype``, ``device``,
    ``max_ctx``, ``loaded_tensors`` (names read from disk), ``loaded_bytes``,
    ``range_digest`` (``resolve.weights_digest`` of those tensors' values).
    """

    def __init__(self, config, family: Family, layer_range: LayerRange, modules: dict, device, dtype):
        super().__init__()
        self.config = config
        self.family = family
        self.layer_range = layer_range
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.is_head = layer_range.start == 0
        self.is_tail = layer_range.end == self.num_layers
        self.device = device
        self.dtype = dtype
        self.max_ctx = int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 4096)
        self.layers = torch.nn.ModuleList(modules["layers"])
        self.embed = modules.get("embed")
        self.pos_embed = modules.get("pos_embed")
        self.norm = modules.get("norm")
        self.lm_head = modules.get("lm_head")
        self.rotary = modules.get("rotary")
        self.loaded_tensors: list[str] = []
        self.loaded_bytes = 0
        self.range_digest = ""  # resolve.weights_digest of loaded_tensors, set by load_block
        self.model_dir: Path | None = None  # set by load_block (sub-range digests read it)
        self._span_digests: dict[LayerRange, str] = {}
        self._tile: int | None = None  # rows per GEMM while forward_batch runs (None outside it)
        # "fma": swarm/kernels/fma.c's batch-invariant GEMM and attention (float32 or bfloat16 on an x86-64
        # CPU with AVX2+FMA or AVX-512, or an aarch64 one),
        # whole chunks per call; "triton": the same contract in Triton kernels (CUDA; on the CPU only
        # under Triton's interpreter, for tests); "rows": stock torch ops, one GEMV and one attention
        # call per row. load_block picks it (pick_kernel_mode); the stage's start-up proof may fall back
        # to "rows" (set_kernel_mode).
        self.kernel_mode = "rows"
        self.kernel_why = ""  # in the rows mode: why not fma or triton (rows_reason, or the failed proof)
        self.quantize: str | None = None  # int8 / int4: Linear weights held quantized (load_block's quantize)
        self._rope_table: RotaryTable | None = None  # set by load_block once the rotary module exists
        # fma mode: Llama-structured decoder layers run as one fma_layer.c call each (swarm.model.fused), the
        # module path's bits; False: every layer through its modules (tests compare the two)
        self.fused = True
        self._fused_plans: list | None = None  # per layer of the block: its fma.LayerPlan or None (built once)
        owned = [*self.layers.modules(), *(m for m in (self.norm, self.lm_head) if m is not None)]
        in_moe: set[int] = set()  # modules inside a sparse-MoE block, which runs once per token (swarm.model.moe)
        for mod in self.layers.modules():
            if moe.is_moe_block(mod):
                moe.per_token_moe(mod)
                in_moe.update(id(m) for m in mod.modules() if m is not mod)
            elif moe.is_router(mod):
                moe.stable_router(mod)
            elif moe.is_grouped_router(mod):
                moe.grouped_router(mod)
            elif mla.is_mla(mod):  # latents cached; each session's expanded in _ragged_attention
                mla.defer_expansion(mod, lambda: self._tile is not None)
        for mod in owned:
            if invariant.is_gemm(mod):
                _tiled(mod, self)
            elif (invariant.is_activation(mod) or invariant.is_norm(mod)) and id(mod) not in in_moe:
                _per_token(mod, self)

    def set_kernel_mode(self, mode: str, why: str = "") -> None:
        """Choose the arithmetic of every later forward: ``fma``, ``triton`` or ``rows`` (see ``kernel_mode``);
        ``why``: for ``rows``, the reason a stage reports (``kernel_why``).

        Raises:
            ConfigError: ``fma`` or ``triton`` where those kernels cannot run (fma: not float32 or bfloat16 on the
            CPU, or no AVX2+FMA CPU or C compiler; triton: not importable, not CUDA nor Triton's
            interpreter, another dtype: the reason is in the message).
        """
        if mode in ("fma", "triton"):
            usable = fma_kernels_usable if mode == "fma" else triton_kernels_usable
            ok, reason = usable(self.device, self.dtype)
            if not ok:
                raise ConfigError(f"the {mode} kernels cannot run for layers {self.layer_range}: {reason}")
        elif mode != "rows":
            raise ConfigError(f"unknown kernel mode {mode!r}: use fma, triton or rows")
        self.kernel_mode = mode
        self.kernel_why = why if mode == "rows" else ""
        self._fused_plans = None  # built again from the weights held now, at the next fused forward

    def kv_bytes_per_position(self, span: LayerRange | None = None) -> int:
        """Bytes of K and V one position takes in this block's KV cache (all its layers, or those of
        ``span``), B = 1: ``layers * kv_elements_per_token_layer * itemsize`` (``2 * Hkv * Dh``, or a
        DeepSeek-V3 latent's ``kv_lora_rank + qk_rope_head_dim``: :mod:`swarm.model.plan`); the cache
        grows lazily up to ``max_len`` of these."""
        from swarm.model.plan import kv_elements_per_token_layer

        itemsize = torch.empty((), dtype=self.dtype).element_size()
        n_layers = len(self.layers) if span is None else span.end - span.start
        return n_layers * kv_elements_per_token_layer(self.config) * itemsize

    def check_span(self, span: LayerRange | None) -> LayerRange:
        """The layers a session runs: ``span`` (any sub-range of this block), or the whole block.

        Raises:
            ConfigError: ``span`` is not inside the block's range.
        """
        if span is None:
            return self.layer_range
        if not self.layer_range.start <= span.start < span.end <= self.layer_range.end:
            raise ConfigError(f"layers {span} are not inside this stage's block {self.layer_range}")
        return span

    def new_cache(self, max_len: int | None = None, span: LayerRange | None = None) -> KVCache:
        """A fresh KV cache for one session over ``span`` (default: the whole block), ``max_len``
        defaulting to the model's maximum context."""
        span = self.check_span(span)
        return KVCache(list(range(span.start, span.end)), max_len or self.max_ctx)

    def digest_of(self, span: LayerRange | None = None) -> str:
        """``resolve.weights_digest`` of the tensors a session over ``span`` uses (its layers, plus the
        embedding when it starts at 0 and the final norm / LM head when it ends at L): what a stage
        signs in the receipt of such a session. The whole block's digest is ``range_digest``."""
        span = self.check_span(span)
        if span == self.layer_range or self.model_dir is None:
            return self.range_digest
        if span not in self._span_digests:
            from swarm.model.resolve import weights_digest

            self._span_digests[span] = weights_digest(self.model_dir, sorted(block_tensor_names(self.model_dir, span)))
        return self._span_digests[span]

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.inference_mode()
    def forward(self, cache: KVCache, pos: int, token_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this block over T new positions ``[pos, pos + T)`` and extend the session's KV cache.

        Args:
            cache: the session's KVCache; ``pos <= cache.kv_len`` (smaller rolls back).
            pos: absolute position of the first new token.
            token_ids: (1, T) int64, required on the head stage.
            hidden: (1, T, D) activations entering layer ``start`` in the block dtype, on other stages.
        Returns:
            (1, T, D) activations leaving layer ``end - 1``, or on the tail (1, T, V) float32 logits.
        Raises:
            ProtocolError: on a position gap; ContextOverflow: past the maximum context;
            ValueError: if the wrong input kind is given for this stage.
        """
        x = token_ids if self.is_head else hidden
        if x is None:
            kind = "token ids" if self.is_head else "hidden states"
            raise ValueError(f"stage {self.layer_range} needs {kind}")
        return self.forward_batch([(cache, pos, x)])[0]

    def forward_batch(self, rows: list, tile: int = 1, logits_rows: list[int] | None = None,
                      span: LayerRange | None = None) -> list[torch.Tensor]:
        """One forward over several sessions' new positions (continuous batching, ragged, no padding
        between sessions), in row-invariant arithmetic (:mod:`swarm.kernels.invariant`).

        The sessions' rows are packed into one (1, sum T_i, D) sequence. Every linear layer runs in
        fixed GEMMs of ``tile`` rows; norms and activations run per token; attention runs per query
        row over that row's session's own KV cache. So a row's bits depend only on its own input and
        its session's cache: not on T (decode, verify chunk, prefill slice), not on other sessions.

        Args:
            rows: ``[(cache, pos, x), ...]``, one entry per session (each cache at most once), with
                ``x`` (1, T_i) int64 token ids on the head, else (1, T_i, D) hidden states.
            tile: rows per GEMM, >= 1. 1 runs one GEMV per row, the very call a decode step makes
                (invariant by construction). More rows per GEMM amortize weight reads over packed
                sessions, and need the BLAS to give a row the same bits wherever it sits in the
                tile: :func:`swarm.kernels.check.check_block` proves that at stage start-up.
            logits_rows: tail only: per entry, how many of its last rows get the final norm and LM
                head (the rows whose next token is wanted); None: all of them.
            span: the layers to run, any sub-range of the block (every entry's cache must be made
                for it: ``new_cache(span=...)``); None: the whole block. A span starting at 0 takes
                token ids and embeds them; one ending at L returns logits.
        Returns:
            one tensor per entry, (1, T_i, D), or when the span ends at L (1, n_i, V) float32
            logits of the last n_i = ``logits_rows[i]`` (default T_i) rows.
        Raises:
            ProtocolError / ContextOverflow: a session's chunk does not fit its cache (nothing is
            written to any cache then); ValueError: a row of the wrong kind or shape, or tile < 1.
        """
        with torch.inference_mode():
            steps = self._forward_steps(rows, tile, logits_rows, span)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value

    def forward_steps(self, rows: list, tile: int = 1, logits_rows: list[int] | None = None,
                      span: LayerRange | None = None):
        """:meth:`forward_batch` as a generator that pauses between decoder layers.

        It yields None after every layer but the last and returns (``StopIteration.value``) what
        ``forward_batch`` returns. While it is paused the entries' caches hold the layers computed
        so far, uncommitted: other forwards may run over other caches in between (a scheduler lets
        a decode row overtake a long prompt's slice, :mod:`swarm.stage.scheduler`), never over these.
        The bits do not depend on the pauses (each layer is the same call either way). Closing it
        while paused (or an error) rolls the caches back to where they were.

        Args and raises: as :meth:`forward_batch` (raised by the first ``next``).
        """
        return _each_in_inference_mode(self._forward_steps(rows, tile, logits_rows, span))

    def _forward_steps(self, rows: list, tile: int, logits_rows: list[int] | None, span: LayerRange | None):
        """The generator behind :meth:`forward_batch` and :meth:`forward_steps` (each may be wrapped on its
        own, e.g. by a test double, without the other calling back into the wrapper); its caller runs
        it in ``torch.inference_mode``."""
        if not rows:
            return []
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"tile must be a positive int, got {tile!r}")
        span = self.check_span(span)
        head, tail = span.start == 0, span.end == self.num_layers
        # a plain list: slicing the ModuleList builds a new one, registering each layer again (~0.2 ms a step)
        layers = list(self.layers)[span.start - self.layer_range.start: span.end - self.layer_range.start]
        segs, xs = self._pack(rows, span, head, logits_rows)
        longs = [self.rotary_long(seg.cache, seg.pos, seg.t) for seg in segs]  # before any cache is touched
        begun = []
        try:
            for seg in segs:
                seg.cache.begin(seg.pos, seg.t)
                begun.append(seg.cache)
            if head:
                h = self.embed(torch.cat(xs, dim=1).to(self.device))
            else:
                h = torch.cat([x.to(self.device, self.dtype) for x in xs], dim=1)
            position_ids = torch.cat([torch.arange(s.pos, s.pos + s.t, device=self.device) for s in segs]).unsqueeze(0)
            if head and self.pos_embed is not None:
                h = h + self.pos_embed(position_ids)
            rope = None
            if self._rope_table is not None:
                long_rows = torch.cat([torch.full((s.t,), flag, dtype=torch.bool) for s, flag in zip(segs, longs)]) \
                    if any(longs) else None
                rope = self._rope_table.lookup(h, position_ids, long_rows)
            plan = _Plan(self, segs)
            plans, rows_c = self._fused_rows(h, rope, segs, span)
            rows_of = h  # the (1, N, D) tensor rows_c runs on, in place
            for i, layer in enumerate(layers):
                if i:
                    yield  # _tile is None here: another forward may run before this one goes on
                if rows_c is not None and plans[i] is not None and "forward" not in layer.__dict__:
                    # one C call (a layer whose forward was replaced, e.g. by a test double, runs that instead)
                    if h is not rows_of:  # the rows come from a module-path layer: run on its output
                        h = rows_of = h.contiguous()
                        rows_c.use(h[0])
                    fma.decoder_layer(plans[i], rows_c, i)
                    continue
                self._tile = tile
                try:
                    with invariant.attention_backends(self.device):
                        h = self._layer(layer, h, rope, position_ids, plan)
                finally:
                    self._tile = None
            if tail:
                if logits_rows is not None:
                    keep = [(s.off + s.t - n, n) for s, n in zip(segs, logits_rows)]
                    h = torch.cat([h[:, a:a + n] for a, n in keep], dim=1)
                    segs = [_Segment(s.cache, s.pos, n, sum(m for _, m in keep[:i])) for i, (s, (_, n)) in
                            enumerate(zip(segs, keep))]
                self._tile = tile
                try:
                    h = self.lm_head(self.norm(h)).float()
                finally:
                    self._tile = None
        except BaseException:  # also GeneratorExit: closed while paused
            for cache in begun:
                cache.abort()
            raise
        for cache in begun:
            cache.commit()
        if self._rope_table is not None and self._rope_table.switch is not None:
            for seg, flag in zip(segs, longs):
                seg.cache.rotary_long = flag
        return [h[:, s.off:s.off + s.t] for s in segs]

    def rotary_long(self, cache, pos: int, t: int) -> bool:
        """Whether a forward of positions ``[pos, pos + t)`` into ``cache`` takes LongRoPE's long factors.

        The rule is transformers' generate (``Phi3ForCausalLM.prepare_inputs_for_generation``): a
        sequence of at most ``original_max_position_embeddings`` (the table's ``switch``) positions
        takes the short factors; a longer one takes the long factors at every position, and generate
        drops its KV cache the step the sequence first grows past the switch and recomputes the whole
        sequence with them. So every row's result is that of one forward of its whole sequence. The
        sequence's length here is the end of the frame this forward belongs to (``cache.frame_end``,
        set by a stage that computes a frame in slices) or else ``pos + t``; rows ``[0, pos)`` already
        in the cache must hold the same factor set, which the coordinator sees to by sending the first
        chunk past the switch from position 0 (:class:`swarm.coordinator.spec.SpecLoop`).

        Returns:
            True for the long factors; False for the short ones, and for any other rotary.
        Raises:
            ProtocolError: the cache's rows ``[0, pos)`` hold the other factor set (the session crossed
                the switch in a chunk that did not start at position 0).
        """
        switch = self._rope_table.switch if self._rope_table is not None else None
        if switch is None:
            return False
        long = max(pos + t, getattr(cache, "frame_end", 0)) > switch
        if pos > 0 and long != getattr(cache, "rotary_long", False):
            raise ProtocolError(
                f"positions [{pos}, {pos + t}) take LongRoPE's {'long' if long else 'short'} factors but the "
                f"session's {pos} earlier positions hold the other set: a chunk that carries a session past "
                f"{switch} positions (or back under it) must be sent from position 0")
        return long

    def _fused_rows(self, h: torch.Tensor, rope, segs: list, span: LayerRange):
        """The fused path's plans for ``span``'s layers and the step's rows (they run on ``h`` in place), or
        (None, None) where every layer takes the module path."""
        if not self.fused or self.kernel_mode != "fma" or rope is None or h.dtype != self.dtype \
                or not h.is_contiguous():
            return None, None
        if self._fused_plans is None:
            self._fused_plans = [fused.layer_plan(layer, self.dtype, self._window(layer.self_attn))
                                 if hasattr(layer, "self_attn") else None for layer in self.layers]
        plans = self._fused_plans[span.start - self.layer_range.start: span.end - self.layer_range.start]
        ready = [p for p in plans if p is not None]
        if not ready:
            return None, None
        kv_heads, head_dim = ready[0].struct.Hkv, ready[0].struct.Dh
        rows = fused.step_rows(h, rope, segs, span.start, span.end, kv_heads, head_dim)
        return (None, None) if rows is None else (plans, rows)

    def _pack(self, rows: list, span: LayerRange, head: bool,
              logits_rows: list[int] | None) -> tuple[list[_Segment], list[torch.Tensor]]:
        """Check ``forward_batch``'s rows and place them in the packed sequence: one ``_Segment`` per
        entry (its cache, pos, T_i and offset), and the inputs in order.

        Raises:
            ValueError: a row of the wrong kind or shape for ``span``, or ``logits_rows`` that does not fit.
        """
        segs, xs, off = [], [], 0
        for cache, pos, x in rows:
            if head:
                if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.long:
                    raise ValueError(f"layers {span} start the model and need (1, T) int64 token ids")
            elif x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != self.hidden_size:
                raise ValueError(f"layers {span} need (1, T, {self.hidden_size}) hidden states")
            t = x.shape[1]
            segs.append(_Segment(cache, pos, t, off))
            xs.append(x)
            off += t
        if logits_rows is not None and (len(logits_rows) != len(segs)
                                        or any(not 0 <= n <= s.t for n, s in zip(logits_rows, segs))):
            raise ValueError(f"logits_rows {logits_rows} does not fit the rows {[s.t for s in segs]}")
        return segs, xs

    def _layer(self, layer, h, rope, position_ids, plan) -> torch.Tensor:
        """One decoder layer over the packed (1, N, D) rows."""
        if self.family.call == "rotary":
            h = layer(h, attention_mask=None, position_embeddings=rope, position_ids=position_ids,
                      cache=plan, swarm_plan=plan)
        else:
            h = layer(h, cache=plan, attention_mask=None, swarm_plan=plan)
        return h[0] if isinstance(h, tuple) else h  # older layer signatures return (hidden, ...)

    def _window(self, attn) -> int | None:
        """Sliding window of attention module ``attn`` in positions, or None: Qwen2/Qwen3 set it per
        layer on the module (a config with ``layer_types`` gives the others full attention, whatever
        its ``sliding_window``: Qwen2-MoE's default is 0 there), Mistral and Mixtral only in the config."""
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window or None
        types, index = getattr(self.config, "layer_types", None), getattr(attn, "layer_idx", None)
        if types and index is not None and types[index] != "sliding_attention":
            return None
        return getattr(self.config, "sliding_window", None) or None

    def _mask(self, attn, pos: int, t: int) -> torch.Tensor | None:
        """Boolean (1, 1, T, S + T) mask for attention module ``attn``, True = attend; None where
        SDPA's own causal path is exact.

        Matches transformers' choice: no mask for a single new token or a cache-less prompt, unless
        a sliding window (Mistral/Qwen2 ``sliding_window``) cuts into the keys.
        """
        window = self._window(attn)
        total = pos + t
        windowed = window is not None and total > window
        if not windowed and (t == 1 or pos == 0):
            return None
        q = torch.arange(pos, total, device=self.device).unsqueeze(1)  # (T, 1)
        k = torch.arange(total, device=self.device).unsqueeze(0)  # (1, S + T)
        allowed = k <= q
        if windowed:
            allowed &= (q - k) < window
        return allowed[None, None]  # (1, 1, T, S + T)


@dataclass
class _Segment:
    """One session's rows in a packed forward: positions ``[pos, pos + t)`` at offset ``off``."""

    cache: KVCache
    pos: int
    t: int
    off: int
    keys: torch.Tensor | None = None  # this layer's K/V for the session (set by _Plan.update)
    values: torch.Tensor | None = None


class _Plan:
    """The packed step's layout; passed to decoder layers as their cache (``update`` splits the new
    K/V rows into each session's KVCache) and to :func:`_ragged_attention` (``swarm_plan``)."""

    def __init__(self, block: LayerBlock, segs: list[_Segment]):
        self.block = block
        self.segs = segs

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        for s in self.segs:
            s.keys, s.values = s.cache.update(key_states[:, :, s.off:s.off + s.t],
                                              value_states[:, :, s.off:s.off + s.t], layer_idx)
        return key_states, value_states


def _each_in_inference_mode(steps):
    """Drive the generator ``steps`` one pause at a time, each stretch in ``torch.inference_mode``;
    closing this one closes it (its caches roll back then, never later at garbage collection)."""
    try:
        while True:
            with torch.inference_mode():
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
            yield
    finally:
        steps.close()


def _ragged_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention for a packed step: each query row against its own session's cached keys and values
    up to its own position, through transformers' SDPA path, as a one-token decode step would run
    it (:func:`swarm.kernels.invariant.attention_rows`). Output (1, N, H, Dh)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = kwargs.pop("swarm_plan", None)
    sinks = getattr(module, "sinks", None) is not None  # gpt-oss: a learned sink logit per head (moe.sink_attention)
    attend = moe.sink_attention if sinks else sdpa_attention_forward
    if plan is None:  # not called from LayerBlock.forward_batch
        return attend(module, query, key, value, attention_mask, **kwargs)
    if mla.is_mla(module):  # DeepSeek-V3: the caches hold latents; K and V widths differ: rows in every mode
        outs = [mla.attention(attend, module, query[:, :, s.off:s.off + s.t], s.keys, s.values, s.pos,
                              plan.block._mask, **kwargs) for s in plan.segs]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None
    if plan.block.kernel_mode in ("fma", "triton") and not sinks:  # those kernels have no sinks: rows for gpt-oss
        return _chunk_attention(plan, module, query, kwargs), None
    outs = [invariant.attention_rows(attend, module, query[:, :, s.off:s.off + s.t], s.keys,
                                     s.values, s.pos, plan.block._mask, **kwargs) for s in plan.segs]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _chunk_attention(plan: _Plan, module, query: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Each session's query rows against its own cache in one call of the block's batch-invariant
    kernel (:func:`swarm.kernels.fma.attention` or :func:`swarm.kernels.triton_ops.attention`, one
    signature). query: (1, H, N, Dh); returns (1, N, H, Dh)."""
    if plan.block.kernel_mode == "fma":
        from swarm.kernels import fma as kernels
    else:
        from swarm.kernels import triton_ops as kernels

    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    window = plan.block._window(module)
    rows = query[0].transpose(0, 1)  # (N, H, Dh), token-major
    widen = plan.block.kernel_mode == "fma" and rows.dtype is not torch.float32  # bfloat16: fma.c reads the cache as is
    if widen:
        rows = rows.float()
    outs = [kernels.attention(rows[s.off:s.off + s.t], s.keys[0].transpose(0, 1), s.values[0].transpose(0, 1), s.pos,
                          scaling, window) for s in plan.segs]
    out = (outs[0] if len(outs) == 1 else torch.cat(outs)).unsqueeze(0)
    return out.to(query.dtype) if widen else out


FMA_DTYPES = (torch.float32, torch.bfloat16)  # the block dtypes the fma kernels run (swarm.kernels.fma)


def fma_kernels_usable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a block on ``device`` in ``dtype`` can run the fma kernels, and why not (they take float32
    or bfloat16 weights on the CPU: a bfloat16 block's activations enter them widened, exactly)."""
    if device.type != "cpu" or dtype not in FMA_DTYPES:
        return False, (f"they take float32 or bfloat16 on the CPU, this block is "
                       f"{str(dtype).removeprefix('torch.')} on {device}")
    return fma.available()


def triton_kernels_usable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a block on ``device`` in ``dtype`` can run the triton kernels, and why not
    (``SWARM_KERNELS`` set to another mode, triton not importable, neither CUDA nor its interpreter)."""
    choice = os.environ.get("SWARM_KERNELS", "").strip().lower()
    if choice in ("rows", "fma"):
        return False, f"SWARM_KERNELS={choice}"
    if choice not in ("", "auto", "triton"):
        return False, f"SWARM_KERNELS={choice!r} is not one of auto, fma, triton, rows"
    try:
        from swarm.kernels import triton_ops
    except ImportError as exc:
        return False, f"triton cannot be imported ({exc})"
    return triton_ops.available(device, dtype)


def pick_kernel_mode(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """The kernel mode a block on ``device`` in ``dtype`` starts in, and why not a batch-invariant one.

    ``SWARM_KERNELS``: unset or ``auto`` picks ``triton`` on CUDA and ``fma`` for float32 or bfloat16 on the CPU;
    ``triton`` or ``fma`` asks for that mode (``triton`` runs on the CPU only under Triton's
    interpreter); ``rows`` turns both off. Where the wanted mode cannot run: ``rows``.

    Returns:
        ``(mode, reason)``: ``reason`` is empty unless a batch-invariant mode was wanted and cannot
        run, else it names that mode and says why (``the triton kernels cannot run: ...``).
    """
    choice = os.environ.get("SWARM_KERNELS", "").strip().lower()
    if choice == "triton" or (choice in ("", "auto") and device.type == "cuda"):
        ok, why = triton_kernels_usable(device, dtype)
        return ("triton", "") if ok else ("rows", f"the triton kernels cannot run: {why}")
    ok, why = fma_kernels_usable(device, dtype)
    if ok:
        return "fma", ""
    wanted = choice not in ("", "auto", "rows") or (device.type == "cpu" and dtype in FMA_DTYPES)
    return "rows", f"the fma kernels cannot run: {why}" if wanted else ""


def rows_reason(device: torch.device, dtype: torch.dtype) -> str:
    """Why a block on ``device`` in ``dtype`` starts in the rows mode ("" where it starts in another):
    :func:`pick_kernel_mode`'s reason, or what keeps the mode of that device (triton on CUDA, else
    fma) from running it, e.g. ``SWARM_KERNELS=rows`` or a float64 block."""
    mode, why = pick_kernel_mode(device, dtype)
    if mode != "rows" or why:
        return why
    if os.environ.get("SWARM_KERNELS", "").strip().lower() == "rows":
        return "SWARM_KERNELS=rows"
    name, usable = ("triton", triton_kernels_usable) if device.type == "cuda" else ("fma", fma_kernels_usable)
    return f"the {name} kernels cannot run: {usable(device, dtype)[1]}"


def _tiled(module: torch.nn.Module, block: LayerBlock) -> None:
    """Route ``module``'s forward (a Linear or GPT-2 Conv1D) through fixed ``block._tile``-row GEMMs
    on fresh aligned copies while ``block._tile`` is set (:func:`swarm.kernels.invariant.linear_rows`)."""
    plain = module.forward
    params = module._parameters  # read directly: nn.Module.__getattr__ costs more than a decode row's GEMV setup
    linear = isinstance(module, torch.nn.Linear)
    held: list = [None, None, None]  # the weight the views below were made of, its (K, N) view, its (N, K) rows

    def forward(x: torch.Tensor) -> torch.Tensor:
        tile = block._tile
        fw = module.__dict__.get(qcheckpoint.FP8_ATTR)
        if fw is not None:  # FP8 as published: the float GEMM's bits over the dequantized weight, in any mode
            from swarm.kernels import fp8

            bias, flat = params.get("bias"), x.reshape(-1, x.shape[-1])
            if x.dtype is torch.float32:
                out = fp8.linear(flat, fw, bias)
            else:  # bfloat16: as the fma branch below, over the weight rounded to bfloat16
                out = fp8.linear(flat.float(), fw, None if bias is None else bias.float(), bf16=True).to(x.dtype)
            return out.reshape(*x.shape[:-1], fw.n)
        qw = module.__dict__.get(qformats.ATTR)
        if qw is not None:  # a llama.cpp block format: the fma family's kernel, any number of rows, in forward_batch or not
            from swarm.kernels import qblocks

            out = qblocks.linear(x.reshape(-1, x.shape[-1]), qw, params.get("bias"))
            return out.reshape(*x.shape[:-1], qw.n)
        q = module.__dict__.get("swarm_quant")
        if q is not None:  # held quantized: fixed-shape row calls of torch's own op, inside forward_batch or not
            from swarm.kernels import quant

            out = quant.linear_rows(x.reshape(-1, x.shape[-1]), q, params.get("bias"), tile or 1)
            return out.reshape(*x.shape[:-1], q.n)
        if tile is None:
            return plain(x)
        weight = params["weight"]
        if held[0] is not weight:  # load_block assigns the weights after wrapping: view the current one
            held[0], held[1], held[2] = weight, (weight.t() if linear else weight), None
        lead = x.shape[:-1]
        if block.kernel_mode == "fma":
            if held[2] is None:  # (N, K) rows with a unit stride: a Linear's own weight, a Conv1D's transposed once
                held[2] = weight if linear and weight.is_contiguous() else held[1].t().contiguous()
            bias = params.get("bias")
            if x.dtype is torch.float32:
                out = fma.linear(x.reshape(-1, x.shape[-1]), held[2], bias)
            else:  # bfloat16: widened in, float32 sums, rounded once on the way out
                out = fma.linear(x.reshape(-1, x.shape[-1]).float(), held[2], None if bias is None else bias.float())
                out = out.to(x.dtype)
            return out.reshape(*lead, out.shape[-1])
        if block.kernel_mode == "triton":
            from swarm.kernels import triton_ops

            if held[2] is None:
                held[2] = weight if linear and weight.is_contiguous() else held[1].t().contiguous()
            out = triton_ops.linear(x.reshape(-1, x.shape[-1]), held[2], params.get("bias"))
            return out.reshape(*lead, out.shape[-1])
        out = invariant.linear_rows(x.reshape(-1, x.shape[-1]), held[1], params.get("bias"), tile)
        return out.reshape(*lead, out.shape[-1])

    module.forward = forward


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm", "MixtralRMSNorm",
             "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "DeepseekV3RMSNorm")
SILUS = ("SiLUActivation", "SiLU")


def _per_token(module: torch.nn.Module, block: LayerBlock) -> None:
    """Route a norm or activation module through row-invariant arithmetic while ``block._tile`` is
    set: vectorized kernels give a tensor's tail elements (scalar loop) other bits, and a reduction
    may split by shape, so where a row sits in the packed tensor must not decide how it is computed.
    fma (triton) mode: the Llama-family RMSNorms and SiLU run in ``fma.c`` (Triton kernels) over all
    rows at once, other norms and activations in fixed 16-row tiles; rows mode: one call per token."""
    plain = module.forward
    kind = type(module).__name__
    rms = kind in RMS_NORMS and hasattr(module, "variance_epsilon")
    silu = kind in SILUS

    def forward(x: torch.Tensor) -> torch.Tensor:
        if block._tile is None:
            return plain(x)
        if block.kernel_mode in ("fma", "triton"):  # one interface: rms_norm(x, weight, eps), silu(x)
            if block.kernel_mode == "fma":
                kernels = fma
            else:
                from swarm.kernels import triton_ops as kernels
            if kernels is fma and x.dtype is not torch.float32 and (rms or silu):  # bfloat16: widened, rounded once
                wide = x.float()
                out = fma.rms_norm(wide, module.weight.float(), module.variance_epsilon) if rms else fma.silu(wide)
                return out.to(x.dtype)
            if rms:
                return kernels.rms_norm(x, module.weight, module.variance_epsilon)
            if silu:
                return kernels.silu(x)
            return invariant.per_tile(plain, x)
        return invariant.per_token(plain, x)

    module.forward = forward


def _plan(model_dir: Path, config, family: Family, layer_range: LayerRange):
    """Build the meta skeleton of the owned modules; map each owned parameter to its file tensor.

    Returns:
        (modules for LayerBlock, {full param name: (module, param name, file tensor name)}, the
        skeleton's base module, the checkpoint's ``tensor_index``).
    Raises:
        ModelError: the checkpoint lacks a tensor the range needs.
    """
    from transformers import AutoModelForCausalLM

    from swarm.model.resolve import tensor_index

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    base = _get(skeleton, family.base)
    owned: dict[str, torch.nn.Module] = {}
    layer_list = _get(base, family.layers)
    modules: dict = {"layers": [layer_list[i] for i in range(layer_range.start, layer_range.end)]}
    for i in range(layer_range.start, layer_range.end):
        owned[f"{family.base}.{family.layers}.{i}"] = layer_list[i]
    head, tail = layer_range.start == 0, layer_range.end == config.num_hidden_layers
    if head:
        modules["embed"] = owned[f"{family.base}.{family.embed}"] = _get(base, family.embed)
        if family.pos_embed:
            modules["pos_embed"] = owned[f"{family.base}.{family.pos_embed}"] = _get(base, family.pos_embed)
    if tail:
        modules["norm"] = owned[f"{family.base}.{family.norm}"] = _get(base, family.norm)
        modules["lm_head"] = owned[family.lm_head] = _get(skeleton, family.lm_head)

    index = tensor_index(model_dir)
    tied_name = f"{family.base}.{family.embed}.weight"
    # full param name -> (module, param name, file tensor name, or (kind, names) of per-expert tensors fused)
    wanted: dict[str, tuple] = {}
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    for prefix, module in owned.items():
        for pname in [n for n, _ in module.named_parameters()] + _persistent_buffers(module, prefix, index):
            full = f"{prefix}.{pname}"
            src = full
            if full not in index and full == f"{family.lm_head}.weight" and getattr(config, "tie_word_embeddings", False):
                src = tied_name  # tied LM head: the tail reads the embedding matrix
            elif full not in index and experts:
                src = (moe.expert_sources(prefix, pname, experts, index) or moe.renamed_source(prefix, pname, index)
                       or qcheckpoint.mxfp4_sources(full, index) or src)
            missing = [n for n in moe.sources_of(src) if n not in index]
            if missing:
                raise ModelError(f"{model_dir} lacks tensor {missing[0]!r} needed by layers {layer_range}")
            wanted[full] = (module, pname, src)

    return modules, wanted, base, index


def _persistent_buffers(module: torch.nn.Module, prefix: str, index) -> list[str]:
    """Names of ``module``'s persistent buffers the checkpoint holds (DeepSeek-V3's router
    ``e_score_correction_bias``); non-persistent ones (rotary tables) are computed, never read."""
    out = []
    for name, _ in module.named_buffers():
        owner_path, _, leaf = name.rpartition(".")
        owner = _get(module, owner_path) if owner_path else module
        if leaf not in owner._non_persistent_buffers_set and f"{prefix}.{name}" in index:
            out.append(name)
    return out


def block_tensor_names(model_dir: Path | str, layer_range: LayerRange) -> set[str]:
    """The file tensor names a stage holding ``layer_range`` loads (for ``weights_digest``).

    Raises:
        ModelError / ConfigError: as ``load_block``.
    """
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    layer_range.check_within(config.num_hidden_layers)
    _, wanted, _, index = _plan(model_dir, config, FAMILIES[config.model_type], layer_range)
    names = {name for _, _, src in wanted.values() for name in moe.sources_of(src)}
    # an FP8 weight's block scales are read with it
    return names | {qcheckpoint.scale_name(n) for n in names if qcheckpoint.scale_name(n) in index}


def load_block(model_dir: Path | str, layer_range: LayerRange, *, dtype: str = "auto",
               device: str = "auto", progress: bool = False, quantize: str | None = None) -> LayerBlock:
    """Load layers ``[start, end)`` (and embedding / norm + LM head where owned) from ``model_dir``.

    Only the tensors of the owned modules are read, through safetensors' mmap.

    Args:
        model_dir: an HF-layout directory (config.json + safetensors, sharded or not).
        layer_range: the layers to hold; must lie in ``[0, L)``.
        dtype: auto|float32|bfloat16|float16|float64. device: auto|cpu|cuda|mps.
        progress: show a progress bar while reading tensors.
        quantize: ``int8`` or ``int4``: hold the decoder layers' Linear weights (and an untied LM
            head's) quantized (:mod:`swarm.kernels.quant`; a weight the scheme does not take stays in
            the compute dtype); the block computes in bfloat16 on the CPU. ``q8_0``, ``q4_0``, ``q4_1``,
            ``q4_k``, ``q6_k``: llama.cpp's block formats quantized at load; ``gguf``: the blocks of the GGUF file the model
            was converted from, as stored (:mod:`swarm.model.qformats`); both compute in float32 on the
            CPU in the fma kernels' arithmetic. None: as loaded.
    Returns:
        A LayerBlock in eval mode.
    Raises:
        ModelError: missing files or tensors, unsupported family. ConfigError: bad range/dtype/device.
    """
    from safetensors import safe_open

    from swarm.model.resolve import weights_digest

    model_dir = Path(model_dir)
    config = load_config(model_dir)
    fp8_block = qcheckpoint.block_size(config)  # refuses other quantization methods by name
    family = FAMILIES[config.model_type]
    layer_range.check_within(config.num_hidden_layers)
    dev = pick_device("cpu" if quantize is not None and device == "auto" else device)  # quantized: the CPU's ops
    blocks = quantize in qformats.SCHEMES  # llama.cpp's block formats (else int8 / int4: torch's ops)
    if quantize is not None:
        dtype = qformats.compute_dtype(quantize, dtype, dev) if blocks else _quantized_dtype(quantize, dtype, dev)
    dt = pick_dtype(dtype, dev)

    modules, wanted, base, index = _plan(model_dir, config, family, layer_range)
    from_gguf = {}  # full parameter name -> its Linear and the GGUF's block-format matrix
    if quantize == "gguf":
        head, tail = layer_range.start == 0, layer_range.end == config.num_hidden_layers
        for full, q in qformats.gguf_weights(model_dir, config, layer_range, head=head, tail=tail).items():
            if full not in wanted:
                continue
            linear = qformats.linear_of(*wanted[full][:2])
            if linear is not None:
                from_gguf[full] = (qformats.hold, linear, q)
            elif isinstance(modules.get("embed"), torch.nn.Embedding) and full.endswith(".embed_tokens.weight"):
                from_gguf[full] = (qformats.hold_embedding, modules["embed"], q)
    block = LayerBlock(config, family, layer_range, modules, dev, dt)
    shards = ExitStack()  # each shard opened (its header parsed) once, closed when the block is read
    opened: dict[Path, object] = {}

    # FP8 Linear weights and FP8 or MXFP4 experts stay as published where the fma kernels multiply this block
    # (swarm.kernels.fp8: a Linear's bits are the float GEMM's over the dequantized weight)
    hold_published = quantize is None and pick_kernel_mode(dev, dt)[0] == "fma"

    def shard(name: str):
        """The open shard holding checkpoint tensor ``name``."""
        path = index[name]
        if path not in opened:
            opened[path] = shards.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return opened[path]

    def raw(name: str) -> torch.Tensor:
        """Checkpoint tensor ``name`` as stored."""
        return shard(name).get_tensor(name)

    def fp8_stored(name: str) -> bool:
        """Whether checkpoint tensor ``name`` is stored in float8 e4m3 (its header says; nothing read)."""
        return shard(name).get_slice(name).get_dtype() == "F8_E4M3"

    def scales(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The block scales of FP8 weight ``name``, recorded among the block's tensors."""
        scale = qcheckpoint.scale_name(name)
        if scale not in index:
            raise ModelError(f"{name} is stored in {tensor.dtype} without its block scales ({scale}); a stage "
                             "dequantizes FP8 weights only with them")
        block.loaded_tensors.append(scale)
        return raw(scale)

    def read(name: str, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """Checkpoint tensor ``name`` (``tensor`` if already read), an FP8 weight dequantized with its scales."""
        tensor = raw(name) if tensor is None else tensor
        if tensor.dtype not in qcheckpoint.FP8_DTYPES:
            return tensor
        return qcheckpoint.dequantize(tensor, scales(name, tensor), fp8_block)

    by_file: dict[Path, list[str]] = {}
    fused = {full: src for full, (_, _, src) in wanted.items() if not isinstance(src, str)}
    for full, (_, _, src) in wanted.items():
        if full not in fused:
            by_file.setdefault(index[src], []).append(full)
    bar = _progress(len(wanted), progress, f"loading layers {layer_range}")
    held: dict[str, torch.nn.Parameter] = {}  # file tensor -> its parameter: a tied LM head shares the embedding's
    held_q: set[int] = set()  # block-format matrices held (ids)
    with shards:
        for names in by_file.values():
            for full in names:
                module, pname, src = wanted[full]
                if full in from_gguf:  # held as the GGUF stores it: its float conversion is never read
                    attach, module_of, q = from_gguf[full]
                    held_bytes = attach(module_of, q)
                    if id(q) not in held_q:  # a tied embedding and LM head in one stage: one matrix
                        held_q.add(id(q))
                        block.loaded_bytes += held_bytes
                        block.loaded_tensors.append(src)
                elif src in held:  # read once, held once (a stage holding head and tail of a tied model)
                    _assign(module, pname, held[src])
                else:
                    tensor = raw(src)
                    linear = qformats.linear_of(module, pname) if tensor.dtype is torch.float8_e4m3fn else None
                    if hold_published and linear is not None:
                        block.loaded_bytes += qcheckpoint.hold_fp8(linear, tensor, scales(src, tensor), fp8_block)
                    else:
                        keep = family.keeps_float32(src) and dt != torch.float64  # DeepSeek-V3's router
                        tensor = _aligned(read(src, tensor).to(device=dev, dtype=torch.float32 if keep else dt))
                        held[src] = _assign(module, pname, tensor)
                        block.loaded_bytes += tensor.numel() * tensor.element_size()
                    block.loaded_tensors.append(src)
                if bar:
                    bar.update(1)
        for full, (kind, names) in fused.items():  # per-expert tensors, stacked as the module holds them
            module, pname, _ = wanted[full]
            pairs = names if kind == "gate_up" else [[n] for n in names]
            if hold_published and kind in ("gate_up", "down") and all(fp8_stored(n) for pair in pairs for n in pair):
                stored = [[raw(n) for n in pair] for pair in pairs]
                experts = qformats.QExperts([qcheckpoint.HeldExpert(
                    [qcheckpoint.fp8_weight(t, scales(n, t), fp8_block) for n, t in zip(pair, tensors)])
                    for pair, tensors in zip(pairs, stored)])
            elif hold_published and kind == "mxfp4":
                experts = qcheckpoint.mxfp4_experts(raw(names[0]), raw(names[1]))
            else:
                experts = None
            if experts is not None:
                *path, leaf = pname.split(".")
                block.loaded_bytes += qcheckpoint.hold_experts(module.get_submodule(".".join(path)), leaf, experts)
                block.loaded_tensors.extend(moe.sources_of((kind, names)))
                if bar:
                    bar.update(1)
                continue
            parts = [[read(n) for n in pair] for pair in names] if kind == "gate_up" else [read(n) for n in names]
            tensor = qcheckpoint.dequantize_mxfp4(*parts) if kind == "mxfp4" else moe.fuse(kind, parts)
            tensor = tensor.to(device=dev, dtype=dt)
            _assign(module, pname, tensor)
            block.loaded_tensors.extend(moe.sources_of((kind, names)))
            block.loaded_bytes += tensor.numel() * tensor.element_size()
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    if family.rotary:
        rot_cls = type(_get(base, family.rotary))
        with torch.device(dev):
            block.rotary = rot_cls(config=config)
        block._rope_table = RotaryTable(block.rotary)
    leftover = [n for n, t in block.named_parameters() if t.is_meta] + [n for n, t in block.named_buffers() if t.is_meta]
    if leftover:
        raise ModelError(f"tensors were not loaded for layers {layer_range}: {', '.join(leftover[:5])}")
    block.eval()
    if quantize in qformats.QUANTIZED_AT_LOAD:
        qformats.quantize_loaded(block, quantize)
    elif quantize is not None and not blocks:
        _quantize_block(block, quantize, tied=bool(getattr(config, "tie_word_embeddings", False)))
    if blocks:
        qformats.require_kernels(quantize)
        block.quantize = quantize
    block.kernel_mode, why = pick_kernel_mode(dev, dt)
    if why:
        log.warning("kernels.rows layers=%s: %s; every chunk runs one row at a time, exact but slower",
                    layer_range, why)
    block.kernel_why = rows_reason(dev, dt) if block.kernel_mode == "rows" else ""
    block.range_digest = weights_digest(model_dir, block.loaded_tensors)  # signed in every receipt
    block.model_dir = model_dir
    log.info("block.loaded layers=%s tensors=%d bytes=%d dtype=%s device=%s kernels=%s range_digest=%s", layer_range,
             len(block.loaded_tensors), block.loaded_bytes, dt, dev, block.kernel_mode, block.range_digest[:16])
    return block


def _quantized_dtype(scheme: str, dtype: str, device: torch.device) -> str:
    """The dtype a block quantized to ``scheme`` computes in (bfloat16), checked against ``dtype``.

    Raises:
        ConfigError: an unknown scheme, a device other than the CPU, a dtype other than bfloat16, or a
            torch without the ops.
    """
    from swarm.kernels import quant

    if scheme not in quant.SCHEMES:
        raise ConfigError(f"--quantize {scheme!r} is not one of {', '.join(quant.SCHEMES)}")
    if device.type != "cpu":
        raise ConfigError(f"quantized weights run on the CPU for now (torch's int8/int4 CPU ops), not {device}")
    if dtype not in ("auto", "bfloat16"):
        raise ConfigError(f"quantized weights compute in bfloat16; --dtype {dtype} cannot go with --quantize")
    ok, why = quant.usable()
    if not ok:
        raise ConfigError(f"--quantize {scheme}: {why}")
    return "bfloat16"


def _quantize_block(block: LayerBlock, scheme: str, *, tied: bool) -> None:
    """Hold the block's decoder-layer Linear weights, and its LM head unless tied to the embedding,
    quantized to ``scheme``; ``loaded_bytes`` becomes what is held."""
    from swarm.kernels import quant

    targets = [m for m in block.layers.modules() if isinstance(m, torch.nn.Linear)]
    if block.lm_head is not None and not tied and isinstance(block.lm_head, torch.nn.Linear):
        targets.append(block.lm_head)
    kept = 0
    for mod in targets:
        w = mod.weight
        q = quant.quantize(w, scheme)
        if q is None:
            kept += 1  # the scheme does not take this shape: it stays in bfloat16
            continue
        mod.__dict__["swarm_quant"] = q
        block.loaded_bytes += q.nbytes - w.numel() * w.element_size()
        mod.weight = torch.nn.Parameter(w.new_empty((0,)), requires_grad=False)  # the float copy is freed
    block.quantize = scheme
    if kept:
        log.warning("quantize.kept_bfloat16 layers=%s scheme=%s weights=%d of %d: %s does not take their shapes "
                    "(int8: inputs a multiple of 16; int4: inputs of 32, outputs of 16)", block.layer_range, scheme,
                    kept, len(targets), scheme)


ALIGN = 64  # bytes: where torch's own allocations start


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied when its data does not start on an ``ALIGN``-byte boundary (a view into a safetensors
    file, wherever the tensor sits in it): MKL gives a GEMV other bits at another alignment of its operands (a
    router's logits, any op of the rows mode), so without the copy a stage's bits would depend on the file's
    layout, and a resharded copy of the same weights would compute other bits."""
    return tensor if tensor.device.type != "cpu" or tensor.data_ptr() % ALIGN == 0 else tensor.clone()


def _assign(module: torch.nn.Module, pname: str, tensor: torch.Tensor) -> torch.nn.Parameter:
    """Set ``module``'s parameter ``pname`` to ``tensor`` (a Parameter is used as it is, so two modules
    may share one), or its persistent buffer ``pname``; returns the parameter (or the buffer).

    Raises:
        ModelError: the shapes differ.
    """
    owner = module
    *path, leaf = pname.split(".")
    for part in path:
        owner = getattr(owner, part)
    old = getattr(owner, leaf)
    if tuple(old.shape) != tuple(tensor.shape):
        raise ModelError(f"tensor {pname} has shape {tuple(tensor.shape)}, expected {tuple(old.shape)}")
    if leaf in owner._buffers:  # a persistent buffer stays a buffer
        owner._buffers[leaf] = tensor
        return tensor
    param = tensor if isinstance(tensor, torch.nn.Parameter) else torch.nn.Parameter(tensor, requires_grad=False)
    setattr(owner, leaf, param)
    return param


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", leave=False)


def model_num_layers(model_dir: Path | str) -> int:
    """Number of decoder layers L declared in ``model_dir/config.json`` (cheap, no transformers)."""
    data = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in data:
            return int(data[key])
    raise ModelError(f"{model_dir}/config.json does not state the number of layers")


_register_attention()
