"""Helpers shared by test modules; fixtures stay in ``tests/conftest.py``.

- ``models``: seeded tiny models of each family (``make_synthetic``, ``FAMILY_CONFIGS``), the
  single-process greedy reference (``reference_greedy``) and a chained-blocks greedy loop.
- ``cheats``: cheating stages as test doubles of a block's forward (issue 29's cheats).
- ``stats``: ``chi2_critical`` for the sampling tests.
- ``cli``: the ``swarm`` command in this process (``run_cli``) or as a child process (``run_swarm``).
- ``net``: ``free_port``.
- ``ring``: in-process rings (real StageServers on real libp2p hosts on loopback).
- ``transport``: a deadline-wrapped ``trio.run``, ``trio_test``, a scriptable raw stream, an echo handler.
- ``streams``: an in-memory FramedStream and a host without a network, for a stage driven directly.
- ``metrics``: ``scrape`` a Prometheus /metrics page.
- ``dht``: signed stage records for the discovery tests.
- ``weights``: resharded checkpoints, in-process weights servers, byte flips.
- ``natlab`` and ``nat_client``: the NAT lab of network namespaces and the client it runs
  (``python -m tests.support.nat_client CONFIG.json``).
- ``doc_commands``: the documented benchmark and pytest commands, checked in one child process.
"""
