"""A Phi-3 LongRoPE ring equals transformers' generate across the switch: real stages on loopback,
frames computed in slices of 3 rows, plain and speculative (issue 45 item 11)."""

from __future__ import annotations

import pytest
import torch
import trio

from swarm.config import SpecConfig
from swarm.coordinator.drafters import NgramDrafter
from tests.support.models import make_synthetic, reference_greedy
from tests.support.ring import ring_generate, start_ring

pytestmark = pytest.mark.ring  # real stages on loopback

SWITCH = 16


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [8.0 + 7.0 * i for i in range(4)],
            "original_max_position_embeddings": SWITCH}
    return make_synthetic("phi3", tmp_path_factory.mktemp("phi3-longrope-ring"), rope_scaling=rope,
                          max_position_embeddings=64, original_max_position_embeddings=SWITCH, seed=3)


def test_ring_matches_generate_across_the_switch(phi3_longrope, tmp_path):
    """Prompts below the switch that cross it while decoding, one past it; plain and n-gram speculative."""
    new = 16
    prompts = [torch.randint(1, 40, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 13, 21)]
    plain, spec = SpecConfig(prefill_chunk=4), SpecConfig(draft="ngram", k=3, depth=2, prefill_chunk=4)

    async def main():
        out = []
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                ring, _ = await start_ring(nursery, phi3_longrope, [(0, 2), (2, 4)], tmp_path, prefill_slice=3)
                for prompt in prompts:
                    out.append(await ring_generate(ring, phi3_longrope, 4, prompt, new, tmp_path, spec_config=plain))
                    out.append(await ring_generate(ring, phi3_longrope, 4, prompt, new, tmp_path, spec_config=spec,
                                                   drafter=NgramDrafter()))
                nursery.cancel_scope.cancel()
        return out

    got = trio.run(main)
    for i, prompt in enumerate(prompts):
        ref = reference_greedy(phi3_longrope, prompt, new, "float64")
        assert got[2 * i] == ref, (len(prompt), "plain")
        assert got[2 * i + 1] == ref, (len(prompt), "speculative")
