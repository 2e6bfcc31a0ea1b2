"""Seeded tiny models of each supported family and the exactness references they are checked against."""

from __future__ import annotations

from pathlib import Path


FAMILY_CONFIGS = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=128),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=128),
    "qwen3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, head_dim=8, max_position_embeddings=128),
    "mistral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=97, sliding_window=6, max_position_embeddings=128),
    "phi3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, pad_token_id=0),
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, vocab_size=97, n_positions=128, bos_token_id=0, eos_token_id=0),
    # sparse mixture-of-experts families (swarm.model.moe); no EOS, so generate never stops early
    "mixtral": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, num_local_experts=4,
                    num_experts_per_tok=2, eos_token_id=None),
    "qwen2_moe": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                      decoder_sparse_step=1, norm_topk_prob=False, eos_token_id=None),
    "qwen3_moe": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, head_dim=8, max_position_embeddings=128, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, norm_topk_prob=True,
                      eos_token_id=None),
    "gpt_oss": dict(hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, vocab_size=97, max_position_embeddings=128,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=4, eos_token_id=None,
                    pad_token_id=0),  # layers alternate sliding and full attention (the config's default)
    # multi-head latent attention (K 20 wide, V 10, the cache 16 + 8 per position), one dense layer,
    # then 8 routed experts in 4 groups (2 eligible), 3 per token, and a shared expert
    "deepseek_v3": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=4,
                        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1, kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, vocab_size=97,
                        max_position_embeddings=128, eos_token_id=None),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")


def make_synthetic(family: str, out_dir: Path, dtype: str = "float64", seed: int = 0, **overrides) -> Path:
    """Write a seeded random tiny model of ``family`` (transformers' own classes) to ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**FAMILY_CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out_dir)
    return out_dir


def reference_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, dtype: str) -> list[int]:
    """Single-process transformers ``generate(do_sample=False)`` new ids: the exactness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    if getattr(model.config, "_experts_implementation", None) is not None:  # MoE: the loop over experts (any dtype)
        model.config._experts_implementation = "eager"
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def chained_greedy(blocks, prompt, new_tokens):
    """Greedy decoding through ``blocks`` (LayerBlocks covering the model in order), one process, no network."""
    import torch

    caches = [b.new_cache() for b in blocks]
    out, pos, toks = [], 0, list(prompt)
    while len(out) < new_tokens:
        h = None
        for b, c in zip(blocks, caches):
            h = b.forward(c, pos, token_ids=torch.tensor([toks])) if b.is_head else b.forward(c, pos, hidden=h)
        pos += len(toks)
        toks = [int(h[0, -1].argmax())]
        out.append(toks[0])
    return out
