"""The ``swarm`` command and the tools around it.

Rule: may import anything in swarm; nothing in swarm imports it (``swarm.__main__`` aside). Importing this
package imports nothing.

- ``main``    argument parsing and one ``cmd_*`` per subcommand; ``main(argv) -> int``
- ``demo``    ``swarm demo``: a local ring, one generation (or ``--serve``), a clean shutdown
- ``launch``  ``LocalRing``: stage daemons on loopback as child processes, always reaped; ``set_spawner``
- ``watch``   ``swarm receipts watch``: a live table of jobs as receipts arrive
- ``output``  what the commands print for a person: streamed text, rates, receipts
- ``audit``   ``swarm audit run`` (audit jobs' stages, write and publish fraud proofs) and ``swarm audit verify``
- ``plan``    ``swarm plan``: bytes per layer and per token of KV at each dtype, a split of the layers over cards
"""
