"""``swarm.serve.config.ServeConfig``: every setting of ``swarm serve`` checked on construction, with
the flag it comes from named in the error. Pure: no ring, no server."""

from __future__ import annotations

import math

import pytest

from swarm.errors import ConfigError
from swarm.serve.config import DEFAULT_MAX_BODY_MB, ServeConfig


def test_the_defaults_are_valid_and_match_the_flags():
    config = ServeConfig()
    life = config.lifecycle
    assert (config.listen.host, config.listen.port, config.ring.max_concurrency) == ("127.0.0.1", 8000, 16)
    assert (life.keepalive_s, life.max_body_mb, life.drain_timeout_s) == (15.0, DEFAULT_MAX_BODY_MB, 30.0)
    assert life.max_body_bytes == 8 * 2**20
    assert config.receipts.listed_receipts is None
    assert (life.header_timeout_s, life.body_timeout_s, life.max_connections) == (10.0, 60.0, None)
    assert life.send_timeout_s == 60.0


@pytest.mark.parametrize("fields, says", [
    ({"port": -1}, "--port must be in [0, 65535], got -1"),
    ({"port": 65536}, "--port must be in [0, 65535], got 65536"),
    ({"max_concurrency": 0}, "--max-concurrency must be >= 1, got 0"),
    ({"keepalive_s": -1.0}, "--keepalive-s must be a number >= 0"),
    ({"keepalive_s": math.inf}, "--keepalive-s must be a number >= 0"),
    ({"drain_timeout_s": math.nan}, "--drain-timeout-s must be a number >= 0"),
    ({"max_body_mb": 0.0}, "--max-body-mb must be > 0"),
    ({"max_body_mb": math.inf}, "--max-body-mb must be > 0"),
    ({"hop_timeout_s": 0.0}, "--hop-timeout-s must be a positive number of seconds"),
    ({"heartbeat_s": math.nan}, "--heartbeat-s must be a positive number of seconds"),
    ({"header_timeout_s": 0.0}, "--header-timeout-s must be a positive number of seconds"),
    ({"body_timeout_s": math.inf}, "--body-timeout-s must be a positive number of seconds"),
    ({"send_timeout_s": math.inf}, "--send-timeout-s must be a positive number of seconds"),
    ({"send_timeout_s": -1.0}, "--send-timeout-s must be a positive number of seconds"),
    ({"max_connections": 0}, "--max-connections must be >= 1, got 0"),
    ({"cors_origins": ("https://app.example/",)}, "--cors-origin 'https://app.example/' is not an origin"),
])
def test_a_bad_setting_is_refused_naming_its_flag(fields, says):
    with pytest.raises(ConfigError) as err:
        ServeConfig.of(**fields)
    assert says in str(err.value)


def test_zero_means_never_or_any_port():
    config = ServeConfig.of(port=0, keepalive_s=0.0, drain_timeout_s=0.0)
    assert (config.listen.port, config.lifecycle.keepalive_s, config.lifecycle.drain_timeout_s) == (0, 0.0, 0.0)


def test_the_dashboard_lists_the_receipt_dir_unless_told_another(tmp_path):
    assert ServeConfig.of(receipt_dir=tmp_path / "r").receipts.listed_receipts == tmp_path / "r"
    assert ServeConfig.of(receipt_dir=tmp_path / "r",
                          dashboard_receipts=tmp_path / "d").receipts.listed_receipts == tmp_path / "d"


def test_lists_become_tuples_so_the_config_stays_frozen():
    config = ServeConfig.of(bootstrap=["/ip4/127.0.0.1/tcp/1"], cors_origins=["*"])
    assert config.ring.bootstrap == ("/ip4/127.0.0.1/tcp/1",) and config.listen.cors_origins == ("*",)
    with pytest.raises(AttributeError):
        config.listen.port = 1  # type: ignore[misc]
