"""Real ``swarm stage`` processes on loopback: stages that fetched their weights from another stage
(``--fetch-from``) form a ring whose answer equals transformers'."""

from __future__ import annotations

import os

import pytest
import trio

from swarm.launch import LocalRing
from swarm.ranges import LayerRange
from swarm.weights.store import SIDECAR
from tests.conftest import reference_greedy
from tests.ring_util import ring_generate

PROMPT = [1, 403, 407, 261, 378, 300, 265]


@pytest.mark.slow
def test_ring_of_fetched_stages_matches_transformers(stories_dir, tmp_path):
    ref = reference_greedy(stories_dir, PROMPT, 16, "float32")
    fresh = dict(os.environ, SWARM_CACHE=str(tmp_path / "fresh-cache"))  # the joiners hold nothing yet
    with LocalRing(str(stories_dir), [LayerRange(0, 5)], tmp_path / "keys-a", threads=1) as holder:
        joiners = LocalRing("stories260k", [LayerRange(0, 2), LayerRange(2, 5)], tmp_path / "keys-b", threads=1,
                            extra_args=["--fetch-from", holder.stages[0].addr], env=fresh)
        with joiners:
            spec = joiners.ring_spec(model=str(stories_dir))
            out = trio.run(ring_generate, spec, stories_dir, 5, PROMPT, 16, tmp_path)
    assert out == ref
    fetched = list((tmp_path / "fresh-cache" / "weights").glob(f"*/{SIDECAR}"))
    assert len(fetched) == 1 and (fetched[0].parent / "model.safetensors").is_file()
