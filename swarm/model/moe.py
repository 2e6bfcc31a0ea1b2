"""Mixture-of-experts layers, exact by construction: per-token expert blocks, stable routing, fused expert weights.

Owns: :func:`per_token_moe` (a sparse-MoE block run once per token), :func:`stable_router` and :func:`grouped_router`
(DeepSeek-V3's) picking experts by stable sorts, :func:`expert_sources` and :func:`fuse` (per-expert checkpoint tensors
stacked as transformers' modules hold them) and :func:`sink_attention` (gpt-oss's, per row). Why: docs/architecture.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swarm.kernels.invariant import canonical

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")


def is_moe_block(module: torch.nn.Module) -> bool:
    """True for a sparse-MoE block of the supported families (``MixtralSparseMoeBlock``, ...,
    ``GptOssMLP``, ``DeepseekV3MoE``)."""
    name = type(module).__name__
    return name.endswith("SparseMoeBlock") or name in ("GptOssMLP", "DeepseekV3MoE")


def is_router(module: torch.nn.Module) -> bool:
    """True for the top-k routers of the supported families (``MixtralTopKRouter``, ...), not the
    grouped one (:func:`is_grouped_router`)."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")


def is_grouped_router(module: torch.nn.Module) -> bool:
    """True for DeepSeek-V3's grouped sigmoid router (``DeepseekV3TopkRouter``)."""
    return hasattr(module, "e_score_correction_bias") and hasattr(module, "num_group") and hasattr(module, "top_k")


def per_token_moe(module: torch.nn.Module) -> None:
    """Run ``module`` (a sparse-MoE block) once per token: (B, T, D) in, the T one-token calls
    concatenated out; a one-token input is the call itself."""
    plain = module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        b, t, d = hidden_states.shape
        if b * t == 1:
            return plain(canonical(hidden_states))
        rows = hidden_states.reshape(b * t, 1, 1, d)
        outs = [plain(canonical(rows[i])) for i in range(b * t)]
        if isinstance(outs[0], tuple):  # gpt-oss returns (hidden states, router scores)
            return (torch.cat([o[0] for o in outs]).reshape(b, t, d), torch.cat([o[1] for o in outs]))
        return torch.cat(outs).reshape(b, t, d)

    module.forward = forward


def stable_router(module: torch.nn.Module) -> None:
    """Replace a top-k router's expert choice by a stable sort (ties: the lower expert index wins).

    Mixtral's router (no ``norm_topk_prob``) normalises the top-k probabilities and returns them in
    float32; Qwen's normalise when ``norm_topk_prob`` and cast back to the logits' dtype, as
    transformers' routers do. Returns (logits, top-k weights, top-k expert indices), as they do.
    """
    qwen = hasattr(module, "norm_topk_prob")
    if getattr(module, "bias", None) is not None:  # gpt-oss: top-k of the biased logits, softmax over those
        def forward_logits(hidden_states: torch.Tensor):
            logits = F.linear(hidden_states, module.weight, module.bias)
            ordered = torch.sort(logits, dim=-1, descending=True, stable=True)
            top_v, top_i = ordered.values[..., :module.top_k], ordered.indices[..., :module.top_k]
            return logits, torch.nn.functional.softmax(top_v, dim=1, dtype=top_v.dtype), top_i

        module.forward = forward_logits
        return

    def forward(hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, module.hidden_dim)
        logits = F.linear(h, module.weight)
        probs = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float)
        ordered = torch.sort(probs, dim=-1, descending=True, stable=True)
        top_v, top_i = ordered.values[..., :module.top_k], ordered.indices[..., :module.top_k]
        if not qwen or module.norm_topk_prob:
            top_v = top_v / top_v.sum(dim=-1, keepdim=True)
        if qwen:
            top_v = top_v.to(logits.dtype)
        return logits, top_v, top_i

    module.forward = forward


def grouped_router(module: torch.nn.Module) -> None:
    """Replace DeepSeek-V3's router choice by stable sorts (ties: the lower group, then the lower expert
    index wins); without ties it picks what transformers' ``DeepseekV3TopkRouter`` picks, with the same
    float32 arithmetic. Returns (logits, top-k weights, top-k expert indices) as that router does, the
    experts in choice order (highest biased score first)."""

    def forward(hidden_states: torch.Tensor):
        h = hidden_states.view(-1, module.hidden_dim)
        logits = F.linear(h.type(torch.float32), module.weight.type(torch.float32))
        scores = logits.sigmoid()
        biased = scores + module.e_score_correction_bias
        per_group = biased.view(-1, module.num_group, module.num_experts // module.num_group)
        best_two = torch.sort(per_group, dim=-1, descending=True, stable=True).values[..., :2]
        group_scores = best_two.sum(dim=-1)  # (N, n_group); two values: their order never changes the sum
        groups = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[..., :module.topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand_as(per_group).reshape(-1, module.num_experts)
        eligible = biased.masked_fill(~keep, float("-inf"))
        top_i = torch.sort(eligible, dim=-1, descending=True, stable=True).indices[..., :module.top_k]
        top_v = scores.gather(1, top_i)
        if module.norm_topk_prob:
            top_v = top_v / (top_v.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, top_v * module.routed_scaling_factor, top_i

    module.forward = forward


def expert_sources(prefix: str, pname: str, num_experts: int, index) -> tuple[str, list] | None:
    """The checkpoint tensors a fused expert parameter is made of, or None when it is not one.

    Args:
        prefix: the layer's module path (``model.layers.3``). pname: the parameter's path in the layer
            (``mlp.experts.gate_up_proj``). num_experts: E. index: the checkpoint's tensor names.
    Returns:
        ``("gate_up", [[gate_0, up_0], ...])`` or ``("down", [down_0, ...])`` in expert order, named as
        the checkpoint names them (Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen's
        ``mlp.experts.E.gate_proj/up_proj/down_proj``); None for other parameters or when the
        checkpoint holds neither layout.
    """
    if not pname.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return None
    layouts = [(f"{prefix}.block_sparse_moe.experts", ("w1", "w3", "w2")),
               (f"{prefix}.{pname.rsplit('.', 1)[0]}", ("gate_proj", "up_proj", "down_proj"))]
    for base, (gate, up, down) in layouts:
        if f"{base}.0.{gate}.weight" in index:
            if pname.endswith("gate_up_proj"):
                return "gate_up", [[f"{base}.{e}.{gate}.weight", f"{base}.{e}.{up}.weight"] for e in range(num_experts)]
            return "down", [f"{base}.{e}.{down}.weight" for e in range(num_experts)]
    return None


def renamed_source(prefix: str, pname: str, index) -> str | None:
    """Mixtral's checkpoint name of a router weight the module holds as ``mlp.gate.weight``
    (``block_sparse_moe.gate.weight``), if the checkpoint has it."""
    if pname == "mlp.gate.weight" and f"{prefix}.block_sparse_moe.gate.weight" in index:
        return f"{prefix}.block_sparse_moe.gate.weight"
    return None


def fuse(kind: str, tensors: list) -> torch.Tensor:
    """Stack per-expert tensors as transformers' fused parameters hold them: ``gate_up``: for each
    expert ``cat(gate, up)`` along the output dim, stacked (E, 2F, D); ``down``: stacked (E, D, F)."""
    if kind == "gate_up":
        return torch.stack([torch.cat(pair, dim=0) for pair in tensors])
    return torch.stack(tensors)


def sources_of(src) -> list[str]:
    """The checkpoint tensor names behind one planned parameter (a name, or a fused one's sources)."""
    if isinstance(src, str):
        return [src]
    kind, names = src
    return [n for pair in names for n in pair] if kind == "gate_up" else list(names)


def sink_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """gpt-oss attention (transformers' ``eager_attention_forward`` of that family: a sink logit per head
    joins each row's softmax and is dropped after it) with a boolean mask (True = attend, as the block's
    masks are) turned into the additive mask that function adds. Shapes as transformers' attention
    functions: query (B, H, T, Dh), key/value (B, Hkv, S, Dh); returns ((B, T, H, Dh), weights)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype).masked_fill(~attention_mask,
                                                                                          float("-inf"))
    if scaling is None:
        scaling = module.scaling
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
