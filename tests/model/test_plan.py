"""``swarm plan`` and ``swarm.model.plan``: bytes per layer and per token of KV, splits over cards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.config import StageConfig
from swarm.errors import ConfigError, ModelError
from swarm.model import plan
from swarm.ranges import LayerRange
from swarm.stage.preflight import preflight
from tests.support.models import make_synthetic

# Llama-3-70B's published dimensions (configs/llama-3-70b/config.json, as on the hub); its parameter count
LLAMA_70B = Path(__file__).resolve().parents[2] / "configs" / "llama-3-70b" / "config.json"
LLAMA_70B_PARAMS = 70_553_706_496


@pytest.fixture(scope="module")
def llama70b() -> Path:
    return LLAMA_70B


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # 6 layers, untied: head and tail hold different tensors
    return make_synthetic("llama", tmp_path_factory.mktemp("tiny"), dtype="float32", num_hidden_layers=6,
                          tie_word_embeddings=False)


@pytest.mark.parametrize("text,expected", [("24GB", 24 * 10**9), ("24GiB", 24 * 2**30), ("512 MB", 512 * 10**6),
                                           ("1.5TB", 1.5e12), ("1000", 1000), ("12gib", 12 * 2**30)])
def test_sizes(text, expected) -> None:
    assert plan.parse_size(text) == int(expected)


@pytest.mark.parametrize("text", ["", "GB", "12XB", "-1GB", "0", "1e3GB", "12 G B"])
def test_bad_sizes_say_how_to_write_one(text) -> None:
    with pytest.raises(ConfigError, match="size"):
        plan.parse_size(text)


def test_zero_only_where_asked() -> None:
    assert plan.parse_size("0", zero=True) == 0


def test_a_70b_config_alone_gives_its_published_size(llama70b) -> None:
    model = plan.model_shapes(llama70b)
    assert model.source == "config"
    fp = plan.footprint(model, "bfloat16")
    assert fp.total == 2 * LLAMA_70B_PARAMS
    assert plan.footprint(model, "float32").total == 4 * LLAMA_70B_PARAMS
    assert fp.kv_token_layer == 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128 dims, bfloat16
    assert fp.head == fp.tail - 8192 * 2 == 128256 * 8192 * 2  # embedding; LM head + final norm
    int4, int8 = plan.footprint(model, "int4"), plan.footprint(model, "int8")
    assert 0.3 < int4.total / fp.total < 0.33 < int8.total / fp.total < 0.52


def test_the_split_over_cards_fits_each_card_and_tiles_the_layers(llama70b) -> None:
    fp = plan.footprint(plan.model_shapes(llama70b), "bfloat16")
    cards, reserve, kv = [24 * 10**9] * 7, 10**9, 4096
    placements = plan.split(fp, cards, kv_tokens=kv, reserve=reserve)
    ranges = [p.layers for p in placements]
    assert all(ranges) and ranges[0].start == 0 and ranges[-1].end == 80
    assert all(a.end == b.start for a, b in zip(ranges, ranges[1:]))
    for p in placements:
        assert p.bytes == fp.stage_bytes(p.layers, kv) <= p.capacity - reserve
    # equal cards are filled alike: no card holds more than one layer past another's fill
    assert max(p.bytes for p in placements) - min(p.bytes for p in placements) <= fp.layer + fp.head


def test_a_bigger_card_takes_more_layers(llama70b) -> None:
    fp = plan.footprint(plan.model_shapes(llama70b), "int4")
    placements = plan.split(fp, [24 * 10**9, 24 * 10**9, 12 * 10**9], kv_tokens=4096, reserve=10**9)
    sizes = [len(p.layers) for p in placements]
    assert sum(sizes) == 80 and sizes[2] < min(sizes[:2])


def test_too_small_cards_say_by_how_much(llama70b) -> None:
    fp = plan.footprint(plan.model_shapes(llama70b), "bfloat16")
    with pytest.raises(ConfigError, match=r"do not fit these cards.*left over.*the cards have 96 GB"):
        plan.split(fp, [24 * 10**9] * 4, kv_tokens=4096, reserve=10**9)
    with pytest.raises(ConfigError, match="--gpus"):
        plan.split(fp, [], kv_tokens=1)


def _reported(model_dir: Path, layers: LayerRange, dtype: str, key: Path) -> int:
    """weights_bytes of the stage's preflight (what its SWARM_STAGE_OK line says it loads)."""
    return preflight(StageConfig.of(model=str(model_dir), layers=layers, dtype=dtype, device="cpu",
                                 key_path=key))["weights_bytes"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_bytes_are_what_a_stage_reports(tiny, dtype, tmp_path, monkeypatch) -> None:
    """Every block of a split, and every range, costs what the stage's own preflight (its
    SWARM_STAGE_OK line's weights_bytes) says it loads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # preflight sets it; restored afterwards
    model = plan.model_shapes(tiny)
    assert model.source == "safetensors"
    fp = plan.footprint(model, dtype)
    per_card = max(fp.stage_bytes(LayerRange(a, a + 2), 16) for a in (0, 2, 4))
    placements = plan.split(fp, [per_card] * 3, kv_tokens=16)
    assert [p.layers.as_list() for p in placements] == [[0, 2], [2, 4], [4, 6]]
    for r in [p.layers for p in placements] + [LayerRange(0, 6), LayerRange(3, 4), LayerRange(5, 6)]:
        reported = _reported(tiny, r, dtype, tmp_path / "stage.key")
        assert plan.range_bytes(model, r, dtype) == fp.stage_bytes(r, 0) == reported, r


def test_a_tied_head_counts_once_for_a_whole_model(tmp_path, monkeypatch) -> None:
    model_dir = make_synthetic("llama", tmp_path / "m", dtype="float32", tie_word_embeddings=True)
    model = plan.model_shapes(model_dir)
    fp = plan.footprint(model, "float32")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reported = _reported(model_dir, LayerRange(0, 4), "float32", tmp_path / "stage.key")
    assert fp.stage_bytes(LayerRange(0, 4), 0) == plan.range_bytes(model, LayerRange(0, 4), "float32") == reported
    assert fp.tail > fp.head  # the tail of a split reads the embedding as its LM head, plus the norm
    from swarm.model.block import load_block

    whole = load_block(model_dir, LayerRange(0, 4), dtype="float32", device="cpu")
    assert whole.lm_head.weight is whole.embed.weight  # read once, held once
    assert whole.loaded_bytes == reported


def test_the_command_prints_tables_and_a_split(llama70b, capsys) -> None:
    assert main(["plan", str(llama70b), "--gpus", "24GB,24GB,12GB", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "80 layers (shapes from config)" in out and "(--quantize, CPU)" in out
    assert "--layers 0:" in out and ":80 " in out
    assert main(["plan", str(llama70b), "--gpus", "24GB,24GB,12GB", "--dtype", "int4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["split"]["fits"] and doc["dtypes"]["bfloat16"]["model_bytes"] == 2 * LLAMA_70B_PARAMS
    assert all(s["free_bytes"] >= 0 for s in doc["split"]["stages"])


def test_the_command_says_when_the_cards_are_too_small(llama70b, capsys) -> None:
    assert main(["plan", str(llama70b), "--gpus", "24GB,24GB,24GB,24GB"]) == 1
    captured = capsys.readouterr()
    assert "do not fit" in captured.err and captured.err.count("\n") == 1
    assert main(["plan", str(llama70b), "--ctx", "9000"]) == 1
    assert "--ctx must be in [1, 8192]" in capsys.readouterr().err


def test_a_path_without_a_config_is_one_line(tmp_path, capsys) -> None:
    assert main(["plan", str(tmp_path)]) == 1
    assert "has no config.json" in capsys.readouterr().err
    with pytest.raises(ModelError, match="not supported"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 2}))
        plan.model_shapes(tmp_path)


def test_stage_max_memory_is_the_memory_budget(capsys) -> None:
    assert main(["stage", "--model", "x", "--max-memory", "12XB"]) != 0
    assert "is not a size" in capsys.readouterr().out
    assert main(["stage", "--model", "x", "--max-memory", "1GB", "--mem-budget-mb", "100"]) != 0
    assert "not both" in capsys.readouterr().out


def test_split_refusals_name_the_cause(llama70b, capsys) -> None:
    fp = plan.footprint(plan.model_shapes(llama70b), "bfloat16")
    with pytest.raises(ConfigError, match=r"--reserve 30 GB leaves nothing of card 0"):
        plan.split(fp, [24 * 10**9], kv_tokens=1, reserve=30 * 10**9)
    assert main(["plan", str(llama70b), "--gpus", "24GB,,24GB"]) == 1
    assert "empty entry" in capsys.readouterr().err
    assert main(["plan", str(llama70b), "--gpus", "24GB,24GB,12GB", "--dtype", "int4"]) == 0
    assert "note: int4 stages run on the CPU" in capsys.readouterr().out


def test_a_bad_config_file_is_named_as_given(tmp_path, capsys) -> None:
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": -64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "vocab_size": 10}))
    assert main(["plan", str(bad)]) == 1
    assert str(bad) in capsys.readouterr().err


def test_max_memory_sizes_only_a_stage_that_picks_its_layers(capsys) -> None:
    assert main(["stage", "--model", "x", "--layers", "0:1", "--max-memory", "1GB"]) != 0
    assert "drop --layers" in capsys.readouterr().out
