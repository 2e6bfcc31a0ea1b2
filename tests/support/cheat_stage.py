"""A real ``swarm stage`` process whose block cheats (a test double, never a product flag).

``python -m tests.support.cheat_stage KIND -- <python> -m swarm stage ...``: the tail of the command
line is what ``swarm.cli.launch.LocalRing`` would run (pass ``["python", "-m",
"tests.support.cheat_stage", KIND, "--"]`` as the stage's ``per_stage_prefix``). The stage daemon runs
as usual (``swarm.cli.main.main``) except that every block it loads is wrapped by
``tests.support.cheats.cheat(block, KIND)``. Use a deterministic cheat (``skip``, ``bf16``, ``ulp``):
the stage's start-up proof of row invariance runs on the cheating block and passes for those.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[1] != "--" or argv[3:5] != ["-m", "swarm"]:
        print("usage: python -m tests.support.cheat_stage KIND -- PYTHON -m swarm stage ...", file=sys.stderr)
        return 2
    kind, rest = argv[0], argv[5:]
    from swarm.model import block as block_module
    from tests.support.cheats import cheat

    honest_load = block_module.load_block

    def load_block(*args, **kwargs):
        block = honest_load(*args, **kwargs)
        cheat(block, kind, layer=1)
        return block

    block_module.load_block = load_block
    from swarm.cli.main import main as swarm_main

    return swarm_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
