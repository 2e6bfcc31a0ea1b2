"""Where each supported transformers family keeps its pieces: attribute paths, hence tensor names.

Owns: the ``Family`` table, shared by ``swarm.model.block`` (building a block's modules) and
``swarm.weights.select`` (naming a block's tensors without torch, to pick the shard files a stage needs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Family:
    """Where a transformers family keeps its pieces (attribute paths in the CausalLM module).

    ``call`` says how decoder layers are called: "rotary" (Llama-like layers take
    ``position_embeddings``) or "plain" (GPT-2 blocks take hidden states, cache and mask only).
    ``float32``: name endings of checkpoint tensors a stage holds in float32 whatever its dtype, as
    transformers keeps them (its ``_keep_in_fp32_modules_strict``: DeepSeek-V3's router).
    """

    base: str
    embed: str
    layers: str
    norm: str
    lm_head: str = "lm_head"
    rotary: str | None = None
    pos_embed: str | None = None
    call: str = "rotary"
    float32: tuple[str, ...] = ()

    def keeps_float32(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` stays float32 in a block of a narrower dtype."""
        return bool(self.float32) and name.endswith(self.float32)


_LLAMA_LIKE = Family(base="model", embed="embed_tokens", layers="layers", norm="norm", rotary="rotary_emb")
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "phi3": _LLAMA_LIKE,
    # sparse mixture-of-experts families (swarm.model.moe): the same paths, experts under each layer
    "mixtral": _LLAMA_LIKE,
    "qwen2_moe": _LLAMA_LIKE,
    "qwen3_moe": _LLAMA_LIKE,
    "gpt_oss": _LLAMA_LIKE,
    # multi-head latent attention (swarm.model.mla), shared and grouped-routed experts
    "deepseek_v3": replace(_LLAMA_LIKE, float32=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")),
    "gpt2": Family(base="transformer", embed="wte", layers="h", norm="ln_f", pos_embed="wpe", call="plain"),
}
