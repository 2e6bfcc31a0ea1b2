"""Settings declared once (``swarm.flags``): ``swarm stage`` and ``swarm serve`` get their flags from the
fields of ``StageConfig``'s and ``ServeConfig``'s sections, and parsed flags come back as those fields."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from swarm.cli.main import build_parser
from swarm.config import MembershipSection, StageConfig
from swarm.errors import ConfigError
from swarm.flags import Flag, add_flags, flag_name, from_args, option, sections
from swarm.ranges import LayerRange
from swarm.serve.config import ServeConfig

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
# the flags of each command before they were declared on the configs (the CLI must keep every one)
STAGE_FLAGS = {
    "--model", "--layers", "--listen", "--key", "--threads", "--dtype", "--quantize", "--device", "--hop-timeout-s",
    "--allow-coordinator", "--check", "--admin", "--fetch-from", "--model-id", "--bootstrap", "--announce-addr",
    "--dht-client", "--relay", "--no-hole-punch", "--num-layers", "--mem-budget-mb", "--max-memory",
    "--announce-interval-s", "--record-ttl-s", "--rebalance-s", "--max-ctx", "--kv-budget-mb", "--heal-log-mb",
    "--audit-retention-mb", "--audit-retention-dir", "--audit-retention-disk-mb", "--audit-rate", "--audit-tally",
    "--audit-queue", "--prefix-cache-mb", "--metrics-listen", "--prefix-block", "--session-ttl-s",
    "--drain-timeout-s", "--max-batch-rows", "--batch-tile", "--prefill-slice-shared", "--no-prefill-piggyback",
    "--prefill-slice", "--inline-step-ms", "--batch-wait-ms"}
SERVE_FLAGS = {
    "--ring", "--model", "--bootstrap", "--host", "--port", "--key", "--hop-timeout-s", "--heartbeat-s",
    "--max-concurrency", "--keepalive-s", "--max-body-mb", "--header-timeout-s", "--body-timeout-s",
    "--send-timeout-s", "--max-connections", "--drain-timeout-s", "--draft", "--k", "--depth", "--prefill-chunk",
    "--wire-dtype", "--no-prefix-cache", "--receipt-dir", "--dashboard-receipts", "--audits", "--cors-origin"}
# a valid value other than the default for the flags whose checks a generic value would fail
SAMPLES = {"--listen": "/ip4/127.0.0.1/tcp/4001", "--metrics-listen": "127.0.0.1:9100", "--model-id": "ab" * 32,
           "--allow-coordinator": PEER, "--admin": PEER, "--relay": f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}",
           "--fetch-from": f"/ip4/127.0.0.1/tcp/2/p2p/{PEER}", "--layers": "2:5", "--audit-rate": "0.5",
           "--cors-origin": "https://app.example", "--port": "8123", "--record-ttl-s": "300"}


def _command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("name, expected", [("stage", STAGE_FLAGS), ("serve", SERVE_FLAGS)])
def test_every_flag_of_the_command_is_still_there(name, expected):
    flags = {o for a in _command(name)._actions for o in a.option_strings if o.startswith("--")} - {"--help", "--verbose"}
    assert flags == expected


def _every_flag_set(cls) -> tuple[list[str], dict]:
    """A command line setting every flag field of the sectioned ``cls`` to a value other than its
    default, and ``{field name: the value the config must hold}``."""
    argv, want = [], {}
    for section in sections(cls).values():
        for f in dataclasses.fields(section):
            flag = f.metadata.get("flag")
            if flag is None:
                continue
            name = flag_name(f, flag)
            if flag.negate:
                argv.append(flag.negate)
                want[f.name] = False
            elif f.type in ("bool",):
                argv.append(name)
                want[f.name] = True
            elif flag.choices:
                argv += [name, flag.choices[-1]]
                want[f.name] = flag.choices[-1]
            else:
                text = SAMPLES.get(name, "7")
                argv += [name, text]
                base = f.type.split(" |")[0]
                want[f.name] = {"int": int, "float": float, "Path": Path, "LayerRange": LayerRange.parse}.get(
                    base.split("[")[0], str)(text)
                if base.startswith("tuple"):
                    want[f.name] = (text,)
    return argv, want


@pytest.mark.parametrize("cls, command", [(StageConfig, "stage"), (ServeConfig, "serve")])
def test_each_flag_lands_in_its_field(cls, command):
    argv, want = _every_flag_set(cls)
    args = _command(command).parse_args(argv)
    config = cls.from_args(args)
    got = {name: getattr(getattr(config, s), name) for s in sections(cls) for name in want
           if name in {f.name for f in dataclasses.fields(sections(cls)[s])}}
    assert got == want
    assert len(want) >= (40 if cls is StageConfig else 15)


def test_the_defaults_of_the_flags_are_the_defaults_of_the_fields():
    args = _command("stage").parse_args(["--model", "m", "--layers", "0:1"])
    assert StageConfig.from_args(args) == StageConfig.of("m", LayerRange(0, 1))
    assert ServeConfig.from_args(_command("serve").parse_args([])) == ServeConfig()


def test_flat_names_go_to_their_sections_and_unknown_ones_are_refused():
    config = StageConfig.of("m", None, bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/x",), max_batch_rows=3, audit_rate=0.5)
    assert (config.membership.bootstrap, config.scheduling.max_batch_rows, config.audits.audit_rate) == \
        (("/ip4/127.0.0.1/tcp/1/p2p/x",), 3, 0.5)
    with pytest.raises(TypeError, match="no setting called 'batch_rows'"):
        StageConfig.of("m", LayerRange(0, 1), batch_rows=3)
    with pytest.raises(TypeError, match="no setting called 'hots'"):
        ServeConfig.of(hots="x")


def test_checks_that_span_sections_still_hold():
    with pytest.raises(ConfigError, match="--layers is required unless --bootstrap"):
        StageConfig.of("m", None)
    with pytest.raises(ConfigError, match="--fetch-from swarm needs --bootstrap"):
        StageConfig.of("m", LayerRange(0, 1), fetch_from=("swarm",))
    with pytest.raises(ConfigError, match="--relay"):
        StageConfig.of("m", LayerRange(0, 1), relays=("/ip4/1.2.3.4/tcp/1",))


def test_a_bad_layers_value_is_a_config_error_naming_it():
    args = _command("stage").parse_args(["--model", "m", "--layers", "5:2"])
    with pytest.raises(ConfigError, match=r"layer range \[5, 2\) is empty"):
        StageConfig.from_args(args)


def test_the_machinery_on_a_section_of_its_own():
    @dataclasses.dataclass(frozen=True)
    class Section:
        TITLE = "things"
        count: int | None = option(None, "how many")
        names: tuple[str, ...] = option((), "a name (repeatable)", flag="--name", metavar="N")
        fast: bool = option(True, "go slow", negate="--slow")
        loud: bool = option(False, "shout")
        unflagged: float = 1.5

    parser = argparse.ArgumentParser()
    group = add_flags(parser, Section, Section.TITLE)
    assert group.title == "things"
    got = from_args(Section, parser.parse_args(["--count", "3", "--name", "a", "--name", "b", "--slow", "--loud"]),
                    unflagged=2.5)
    assert got == Section(3, ("a", "b"), False, True, 2.5)
    assert from_args(Section, parser.parse_args([])) == Section()
    assert isinstance(dataclasses.fields(Section)[0].metadata["flag"], Flag)
    assert "--unflagged" not in parser.format_help()


def test_membership_is_a_section_of_the_stage_config():
    assert sections(StageConfig)["membership"] is MembershipSection
