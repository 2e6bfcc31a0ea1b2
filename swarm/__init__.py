"""swarm: a peer-to-peer, pipeline-parallel LLM inference swarm.

Layer map (each module's docstring says what it owns and may import):

- ``swarm.errors``      the error hierarchy (stdlib only)
- ``swarm.heal``        recovery decisions (stdlib only)
- ``swarm.transport``   libp2p host, identity, framed streams, deadlines (no torch)
- ``swarm.wire``        tensor <-> bytes, frame schema and validation
- ``swarm.model``       model resolution, layer blocks, KV cache (no networking)
- ``swarm.kernels``     attention backends and wire kernels
- ``swarm.receipts``    receipt schema, signing, verification
- ``swarm.stage``, ``swarm.coordinator``  the daemons (glue; nothing imports them)
- ``swarm.ring``        the coordinator's streams to a ring: sessions, chunks, probes, swaps
- ``swarm.output``      what commands print for a person (stdlib only)
- ``swarm.cli``         the ``swarm`` command

Importing this package has no side effects and loads neither torch nor libp2p.
"""

__version__ = "0.1.0"
