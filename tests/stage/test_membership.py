"""stage/membership.py: the speed a stage estimates before choosing its block (issue 31)."""

from __future__ import annotations

import pytest

import swarm.model.block as block_mod
from swarm.config import StageConfig
from swarm.errors import ConfigError
from swarm.ranges import LayerRange
from swarm.stage import membership


def _config(stories_dir) -> StageConfig:
    return StageConfig.of(model=str(stories_dir), layers=None, bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/x",),
                       device="cpu", dtype="float32")


@pytest.mark.parametrize("num_layers, layer", [(1, 0), (2, 1), (5, 2), (80, 40)])
def test_the_probe_layer_is_a_middle_one(num_layers, layer):
    assert membership.probe_layer(num_layers) == layer


def test_estimate_times_one_middle_layer_and_divides_by_the_width(stories_dir, monkeypatch):
    real_load = block_mod.load_block
    loaded = []

    def spy(model_dir, layer_range, **kw):
        loaded.append((layer_range, kw))
        return real_load(model_dir, layer_range, **kw)

    monkeypatch.setattr(block_mod, "load_block", spy)
    monkeypatch.setattr(membership, "measure_decode_tps", lambda block, steps=8: 120.0 * len(block.layers))
    assert membership.estimate_block_tps(stories_dir, _config(stories_dir), 5, 3) == pytest.approx(40.0)
    assert [r for r, _ in loaded] == [LayerRange(2, 3)]  # one layer, neither head nor tail
    assert loaded[0][1]["dtype"] == "float32" and loaded[0][1]["device"] == "cpu"


def test_estimate_is_a_real_positive_speed(stories_dir):
    config = _config(stories_dir)
    assert membership.estimate_block_tps(stories_dir, config, 5, 1, steps=4) > 0
    with pytest.raises(ConfigError, match="at least one layer"):
        membership.estimate_block_tps(stories_dir, config, 5, 0)
