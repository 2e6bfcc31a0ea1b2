import pytest

from swarm.errors import ConfigError
from swarm.ranges import LayerRange, check_tiling, even_split


@pytest.mark.parametrize("text,expected", [("0:10", (0, 10)), ("12:24", (12, 24)), (" 3:4 ", (3, 4))])
def test_parse(text, expected):
    r = LayerRange.parse(text)
    assert (r.start, r.end) == expected
    assert str(r) == f"[{expected[0]}, {expected[1]})"


@pytest.mark.parametrize("text", ["10", "a:b", "5:5", "6:5", "-1:3", "1:2:3", ""])
def test_parse_rejects(text):
    with pytest.raises(ConfigError):
        LayerRange.parse(text)


def test_out_of_bounds():
    with pytest.raises(ConfigError, match="out of bounds.*30 layers"):
        LayerRange(20, 31).check_within(30)


@pytest.mark.parametrize("ranges,msg", [
    ([(0, 10), (12, 30)], r"gap.*\[10, 12\)"),
    ([(0, 10), (8, 30)], r"overlap.*stage 1"),
    ([(0, 10), (10, 20)], r"gap.*\[20, 30\)"),
    ([(2, 10), (10, 30)], r"gap.*\[0, 2\)"),
    ([(0, 10), (10, 31)], r"overruns"),
    ([], r"no stages"),
])
def test_tiling_errors(ranges, msg):
    with pytest.raises(ConfigError, match=msg):
        check_tiling([LayerRange(*r) for r in ranges], 30)


@pytest.mark.parametrize("layers,stages", [(30, 3), (5, 2), (5, 3), (4, 4), (7, 1)])
def test_even_split_tiles(layers, stages):
    ranges = even_split(layers, stages)
    check_tiling(ranges, layers)
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and len(ranges) == stages


def test_even_split_too_many():
    with pytest.raises(ConfigError):
        even_split(3, 4)


def test_out_of_order_is_named():
    with pytest.raises(ConfigError, match="out of order"):
        check_tiling([LayerRange(10, 20), LayerRange(0, 10), LayerRange(20, 30)], 30)


def test_unquoted_yaml_layers_named():
    import yaml

    from swarm.config import RingSpec

    data = yaml.safe_load("model: m\nstages:\n  - {addr: /ip4/127.0.0.1/tcp/1/p2p/X, layers: 10:20}\n")
    with pytest.raises(ConfigError, match=r"stages\[0\] layers must be a quoted string"):
        RingSpec.from_dict(data, "ring.yaml")
