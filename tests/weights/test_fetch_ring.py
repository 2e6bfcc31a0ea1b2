"""Real ``swarm stage`` processes on loopback: stages that fetched their weights from another stage
(``--fetch-from ADDR``, and ``--fetch-from swarm`` finding it on the DHT) form a ring whose answer
equals transformers'."""

from __future__ import annotations

import os

import pytest
import trio

from swarm.cli.launch import BootstrapNode, LocalRing
from swarm.ranges import LayerRange
from swarm.weights.store import SIDECAR
from tests.support.models import reference_greedy
from tests.support.ring import ring_generate

pytestmark = [pytest.mark.ring, pytest.mark.process]

PROMPT = [1, 403, 407, 261, 378, 300, 265]


@pytest.mark.slow
def test_ring_of_fetched_stages_matches_transformers(stories_dir, tmp_path):
    ref = reference_greedy(stories_dir, PROMPT, 16, "float32")
    fresh = dict(os.environ, SWARM_CACHE=str(tmp_path / "fresh-cache"))  # the joiners hold nothing yet
    with BootstrapNode(tmp_path / "boot.key") as boot, \
            LocalRing(str(stories_dir), [LayerRange(0, 5)], tmp_path / "keys-a", threads=1,
                      extra_args=["--bootstrap", boot.addr]) as holder:
        # one joiner is given the holder's address, the other finds it on the DHT (--fetch-from swarm)
        joiners = LocalRing("stories260k", [LayerRange(0, 2), LayerRange(2, 5)], tmp_path / "keys-b", threads=1,
                            per_stage_args={0: ["--fetch-from", holder.stages[0].addr],
                                            1: ["--fetch-from", "swarm", "--bootstrap", boot.addr]}, env=fresh)
        with joiners:
            assert joiners.stages[1].ready["model_id"] == holder.stages[0].ready["model_id"]
            spec = joiners.ring_spec(model=str(stories_dir))
            out = trio.run(ring_generate, spec, stories_dir, 5, PROMPT, 16, tmp_path)
    assert out == ref
    fetched = list((tmp_path / "fresh-cache" / "weights").glob(f"*/{SIDECAR}"))
    assert len(fetched) == 1 and (fetched[0].parent / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_stage_without_layers_places_itself_then_fetches_its_block(stories_dir, tmp_path):
    """No --layers and --fetch-from swarm: the manifest and config come from the holder first, the
    stage picks its block on the DHT (here all 5 layers: --num-layers 5), then fetches and serves it."""
    ref = reference_greedy(stories_dir, PROMPT, 16, "float32")
    fresh = dict(os.environ, SWARM_CACHE=str(tmp_path / "fresh-cache"))
    with BootstrapNode(tmp_path / "boot.key") as boot, \
            LocalRing(str(stories_dir), [LayerRange(0, 2)], tmp_path / "keys-a", threads=1,
                      extra_args=["--bootstrap", boot.addr]) as holder, \
            LocalRing("stories260k", [None], tmp_path / "keys-b", threads=1, env=fresh,
                      extra_args=["--fetch-from", "swarm", "--bootstrap", boot.addr, "--num-layers", "5"]) as placed:
        ready = placed.stages[0].ready
        assert ready["layers"] == [0, 5] and ready["model_id"] == holder.stages[0].ready["model_id"]
        spec = placed.ring_spec(model=str(stories_dir))
        out = trio.run(ring_generate, spec, stories_dir, 5, PROMPT, 16, tmp_path)
    assert out == ref
    (sidecar,) = (tmp_path / "fresh-cache" / "weights").glob(f"*/{SIDECAR}")
    assert (sidecar.parent / "model.safetensors").is_file()
