"""swarm.config.from_flags: a config dataclass from the command line's parsed flags, one per field."""

from __future__ import annotations

import argparse

import pytest

from swarm.config import SamplingParams, SpecConfig, from_flags
from swarm.errors import ConfigError


def test_each_field_takes_the_flag_of_its_name():
    args = argparse.Namespace(draft="ngram", k=None, depth=2, prefill_chunk=64, temperature=0.5, top_k=3,
                              top_p=0.9, seed=7, unrelated="ignored")
    assert from_flags(SpecConfig, args) == SpecConfig(draft="ngram", k=4, depth=2, prefill_chunk=64)
    assert SamplingParams.from_args(args) == SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7)
    assert SpecConfig.from_args(args) == from_flags(SpecConfig, args)


@pytest.mark.parametrize("argv, spec, sampling", [
    (["coordinate", "--ring", "r.yaml", "--prompt", "hi", "--draft", "ngram", "--k", "3", "--top-k", "5",
      "--temperature", "0.7"], SpecConfig("ngram", 3), SamplingParams(temperature=0.7, top_k=5)),
    (["coordinate", "--ring", "r.yaml", "--prompt", "hi"], SpecConfig(), SamplingParams()),
    (["serve", "--ring", "r.yaml", "--depth", "2", "--prefill-chunk", "16"], SpecConfig(depth=2, prefill_chunk=16),
     None),
])
def test_from_the_real_command_line(argv, spec, sampling):
    from swarm.cli.main import build_parser

    args = build_parser().parse_args(argv)
    assert SpecConfig.from_args(args) == spec
    if sampling is not None:
        assert SamplingParams.from_args(args) == sampling


def test_bad_values_are_the_config_errors_of_the_class():
    with pytest.raises(ConfigError, match="--k must be in 0..64"):
        SpecConfig.from_args(argparse.Namespace(draft="none", k=65, depth=1, prefill_chunk=1))
    with pytest.raises(AttributeError, match="top_p"):
        SamplingParams.from_args(argparse.Namespace(temperature=0.0, top_k=0, seed=0))


def test_stage_audit_retention_is_checked_and_stated_in_help():
    import argparse

    from swarm.cli.main import build_parser
    from swarm.config import StageConfig
    from swarm.ranges import LayerRange

    assert StageConfig.of(model="m", layers=LayerRange(0, 1)).audits.audit_retention_mb == 256.0
    assert StageConfig.of(model="m", layers=LayerRange(0, 1), audit_retention_mb=0).audits.audit_retention_mb == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--audit-retention-mb must be a finite number of MiB >= 0"):
            StageConfig.of(model="m", layers=LayerRange(0, 1), audit_retention_mb=bad)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["stage"].format_help()
    assert "--audit-retention-mb" in text and "default 256" in text
    args = build_parser().parse_args(["stage", "--model", "m", "--audit-retention-mb", "64"])
    assert args.audit_retention_mb == 64.0


def test_stage_auditor_role_and_retention_spill_are_checked_and_stated_in_help(tmp_path):
    import argparse

    from swarm.cli.main import build_parser
    from swarm.config import StageConfig
    from swarm.ranges import LayerRange

    def stage(**kw):
        return StageConfig.of(model="m", layers=LayerRange(0, 1), **kw)

    assert stage().audits.audit_rate == 0 and stage().audits.audit_retention_dir is None
    assert stage(audit_rate=0.5, audit_tally=tmp_path / "t.json").audits.audit_rate == 0.5
    for kw, msg in (({"audit_rate": 1.5}, "--audit-rate must be in"), ({"audit_rate": float("nan")}, "--audit-rate"),
                    ({"audit_tally": tmp_path / "t.json"}, "--audit-tally needs --audit-rate"),
                    ({"audit_rate": 0.1, "audit_queue": 0}, "--audit-queue must be"),
                    ({"audit_retention_disk_mb": -1.0}, "--audit-retention-disk-mb must be"),
                    ({"audit_retention_dir": tmp_path, "audit_retention_mb": 0}, "--audit-retention-dir needs")):
        with pytest.raises(ConfigError, match=msg):
            stage(**kw)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["stage"].format_help().split())
    for flag in ("--audit-rate S", "--audit-tally FILE", "--audit-queue", "--audit-retention-dir DIR",
                 "--audit-retention-disk-mb"):
        assert flag in text
    assert "default 0: off" in text and "deleted at start-up" in text and "default 1024" in text
    args = build_parser().parse_args(["stage", "--model", "m", "--audit-rate", "0.2", "--audit-retention-dir",
                                      str(tmp_path), "--audit-retention-disk-mb", "8"])
    assert (args.audit_rate, args.audit_retention_dir, args.audit_retention_disk_mb) == (0.2, tmp_path, 8.0)
