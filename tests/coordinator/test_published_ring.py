"""Checkpoints as published, over the network: a 3-stage ring of real stages on loopback holding an FP8 Llama
and gpt-oss's MXFP4 experts as stored gives one process's tokens, greedy and n-gram speculative (issue 47)."""

from __future__ import annotations

import pytest
import trio

from swarm.config import SpecConfig
from swarm.coordinator.drafters import NgramDrafter
from swarm.model import qcheckpoint, qformats
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from tests.model.test_qcheckpoint import _batched_greedy, _gpt_oss_pair, _llama_pair
from tests.support.ring import ring_generate, start_ring

pytestmark = pytest.mark.ring
RANGES = [(0, 1), (1, 3), (3, 4)]


@pytest.mark.parametrize("kind", ["fp8-llama", "mxfp4-gpt-oss"])
def test_a_ring_on_a_published_checkpoint_gives_one_processs_tokens(synthetic, tmp_path, kind):
    model = (_llama_pair if kind == "fp8-llama" else _gpt_oss_pair)(synthetic, tmp_path)[0]
    whole = load_block(model, LayerRange(0, 4), dtype="float32", device="cpu")
    if whole.kernel_mode != "fma":
        pytest.skip(f"checkpoints are held as published where the fma kernels run: {whole.kernel_why}")
    prompt, new = [1, 5, 9, 3, 7, 2, 8], 10
    want, _ = _batched_greedy([whole], prompt, new, 1)
    plain, spec = SpecConfig(prefill_chunk=4), SpecConfig(draft="ngram", k=3, depth=2, prefill_chunk=4)

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                ring, servers = await start_ring(nursery, model, RANGES, tmp_path, dtype="float32")
                held = sum(isinstance(m.__dict__.get("gate_up_proj"), qformats.QExperts)
                           or qcheckpoint.FP8_ATTR in m.__dict__ for s in servers for m in s.block.modules())
                got = [await ring_generate(ring, model, 4, prompt, new, tmp_path, spec_config=plain),
                       await ring_generate(ring, model, 4, prompt, new, tmp_path, spec_config=spec,
                                           drafter=NgramDrafter())]
                nursery.cancel_scope.cancel()
        return held, got

    held, (greedy, speculative) = trio.run(main)
    assert held > 0  # the stages hold the published bytes
    assert greedy == want and speculative == want
