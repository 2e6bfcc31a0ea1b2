"""LongRoPE (Phi-3): a sequence longer than ``original_max_position_embeddings`` takes the long factors
at every position, as transformers computes it, in one forward, in slices, and across a generation
that crosses the switch (issue 45 item 11)."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from swarm.coordinator.spec import SpecLoop, rotary_switch
from swarm.errors import ProtocolError
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from tests.support.models import make_synthetic

SWITCH = 16
HEAD_DIM = 8  # phi3's synthetic config: hidden 32 over 4 heads


def _longrope(short, long):
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": SWITCH}


@pytest.fixture(scope="module", params=["factors 1-1.3 / 2-4.1", "factors 1 / 8-30"])
def phi3_longrope(request, tmp_path_factory):
    """A seeded Phi-3 whose rotary switches from the short to the long factors past 16 positions."""
    n = HEAD_DIM // 2
    factors = {"factors 1-1.3 / 2-4.1": ([1.0 + 0.1 * i for i in range(n)], [2.0 + 0.7 * i for i in range(n)]),
               "factors 1 / 8-30": ([1.0] * n, [8.0 + 7.0 * i for i in range(n)])}[request.param]
    out = tmp_path_factory.mktemp("phi3-longrope")
    return make_synthetic("phi3", out, rope_scaling=_longrope(*factors), max_position_embeddings=64,
                          original_max_position_embeddings=SWITCH)


def _reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()


def _blocks(model_dir):
    return [load_block(model_dir, LayerRange(0, 2), dtype="float64", device="cpu"),
            load_block(model_dir, LayerRange(2, 4), dtype="float64", device="cpu")]


def _forward(blocks, caches, pos, tokens):
    h = None
    for b, c in zip(blocks, caches):
        h = b.forward(c, pos, token_ids=torch.tensor([tokens])) if b.is_head else b.forward(c, pos, hidden=h)
    return h[0]


def _prompt(n, seed=0):
    return torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("length", [SWITCH, SWITCH + 1, 24, 40])
def test_a_forward_takes_the_factors_of_its_whole_sequence(phi3_longrope, length):
    """Every row of a sequence past the switch takes the long factors (before: rows below the switch
    took the short ones, logits 1e-3 off transformers' where shorter sequences agree to 1e-8)."""
    blocks, prompt = _blocks(phi3_longrope), _prompt(length)
    with torch.no_grad():
        ref = _reference(phi3_longrope)(torch.tensor([prompt])).logits[0]
    got = _forward(blocks, [b.new_cache() for b in blocks], 0, prompt)
    assert (got - ref).abs().max().item() < 1e-6


def test_a_frame_computed_in_slices_takes_its_whole_frames_factors(phi3_longrope):
    """A stage computes a long frame a slice at a time; ``cache.frame_end`` (the scheduler sets it)
    gives every slice the frame's factors, bit for bit those of one forward."""
    blocks, prompt = _blocks(phi3_longrope), _prompt(30)
    whole = _forward(blocks, [b.new_cache() for b in blocks], 0, prompt)
    caches = [b.new_cache() for b in blocks]
    rows = []
    for a in range(0, 30, 7):
        for c in caches:
            c.frame_end = 30
        rows.append(_forward(blocks, caches, a, prompt[a:a + 7]))
    assert torch.equal(torch.cat(rows), whole)


def test_a_chunk_that_crosses_the_switch_after_position_0_is_refused(phi3_longrope):
    """Rows computed with the short factors cannot serve a sequence past the switch: the chunk is
    refused (the coordinator sends such a chunk from position 0), the cache is left as it was."""
    block = load_block(phi3_longrope, LayerRange(0, 4), dtype="float64", device="cpu")
    cache, prompt = block.new_cache(), _prompt(20)
    block.forward(cache, 0, token_ids=torch.tensor([prompt[:12]]))
    with pytest.raises(ProtocolError, match="must be sent from position 0"):
        block.forward(cache, 12, token_ids=torch.tensor([prompt[12:20]]))
    assert cache.kv_len == 12 and not cache.rotary_long
    block.forward(cache, 0, token_ids=torch.tensor([prompt]))  # from 0: the long factors everywhere
    assert cache.rotary_long
    with pytest.raises(ProtocolError, match="must be sent from position 0"):  # and back under the switch
        block.forward(cache, 8, token_ids=torch.tensor([prompt[8:12]]))


class _ScriptDrafter:
    """Drafts the reference continuation, with a wrong token at every ``wrong_every``-th position
    (so verify chunks are rejected around the switch too)."""

    name = "script"

    def __init__(self, full: list[int], wrong_every: int):
        self.full, self.wrong_every = full, wrong_every

    def propose(self, context, n):
        out = []
        for q in range(len(context), min(len(self.full), len(context) + n)):
            out.append(self.full[q] if q % self.wrong_every else (self.full[q] + 1) % 97)
        return out


def _drive(blocks, loop: SpecLoop) -> dict[int, torch.Tensor]:
    """Run ``loop``'s chunks through ``blocks`` in order, as a ring's stages would (stale chunks
    computed too), delivering results one at a time. Returns the logits of every answered row."""
    caches = [b.new_cache() for b in blocks]
    logits, pending = {}, deque()
    while not loop.done:
        for chunk in loop.next_chunks():
            h = _forward(blocks, caches, chunk.pos, list(chunk.tokens))
            rows = h[chunk.first_result - chunk.pos:]
            for i, row in enumerate(rows):
                logits[chunk.first_result + i] = row
            pending.append((chunk, rows.argmax(-1).tolist()))
        chunk, ids = pending.popleft()
        loop.on_result(chunk.chunk_id, chunk.epoch, ids)
    return logits


@pytest.mark.parametrize("prompt_len,k,depth", [(10, 0, 1), (10, 3, 2), (15, 2, 3), (16, 0, 1), (22, 3, 2)])
def test_generation_across_the_switch_matches_transformers_generate(phi3_longrope, prompt_len, k, depth):
    """transformers' generate recomputes the whole sequence with the long factors the step it grows
    past the switch (its KV cache from the short factors is dropped); the ring's chunks do the same,
    plain and speculative, so every new token's logits agree with generate's."""
    new = 14
    prompt = _prompt(prompt_len, seed=prompt_len)
    model = _reference(phi3_longrope)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    ref_ids = ref.sequences[0, prompt_len:].tolist()
    drafter = _ScriptDrafter(prompt + ref_ids, wrong_every=4)
    loop = SpecLoop(prompt, new, drafter=drafter, k=k, depth=depth, prefill_chunk=4, rotary_switch=SWITCH)
    logits = _drive(_blocks(phi3_longrope), loop)
    assert loop.output == ref_ids
    for i, row in enumerate(ref.logits):
        assert (logits[prompt_len - 1 + i] - row[0]).abs().max().item() < 1e-6, i


def test_rotary_switch_reads_the_config():
    assert rotary_switch({"rope_parameters": _longrope([1.0], [2.0])}) == SWITCH
    assert rotary_switch({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]},
                          "original_max_position_embeddings": 4096}) == 4096
    assert rotary_switch({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}) is None
    assert rotary_switch({"max_position_embeddings": 4096}) is None
