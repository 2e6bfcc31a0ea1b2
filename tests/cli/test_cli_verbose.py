"""`-v/--verbose` is accepted after any subcommand, not only before it (issue 27)."""

from __future__ import annotations

import pytest

from swarm.cli.main import build_parser


@pytest.mark.parametrize("argv, level", [
    (["peers", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/x", "-v"], 1),
    (["-v", "peers", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/x", "-v"], 2),
    (["coordinate", "--prompt", "hi", "-vv"], 2),
    (["receipts", "verify", "r.json", "--verbose"], 1),
    (["model", "import", "x.gguf", "-v"], 1),
    (["stage", "--model", "m", "--layers", "0:1"], 0),
])
def test_verbose_after_the_subcommand(argv, level):
    args = build_parser().parse_args(argv)
    assert args.verbose + getattr(args, "verbose_sub", 0) == level
