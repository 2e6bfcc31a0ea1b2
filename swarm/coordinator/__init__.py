"""The coordinator: the client side of a ring (``swarm coordinate``, and what ``swarm serve`` drives).

Rule: may import the shared core, ``transport``, ``kernels``, ``discovery``, ``weights``, ``model`` and ``auditor``;
never ``stage`` (its peer), ``serve`` or ``cli``. Importing this package imports nothing.

- ``generation``    ``generate``: prompt text -> the result record (tokenize, connect, decode, stream, receipt)
- ``decoding``      ``decode`` (``DecodeOptions`` -> ``DecodeResult``): a session driven round the ring, healed
- ``heal_ops``      ``RingOps``: the ring-side operations a heal runs (``swarm.heal.SwarmOps``)
- ``routing``       ``connect_ring``: a ring file's stages, or a route through the swarm's DHT
- ``jobs``          a job's signed receipt written and verified, and offered to auditors
- ``books``         ``SessionBook``: what the ring client keeps of one session (progress, receipt ledger, prefix)
- ``ring``          ``RingClient``: sessions, chunks, results, cancels, receipts; ``net`` + ``repair`` below
- ``links``         ``StageInfo``, ``Link``, ``RingLinks``: dialing and checking stages, readers, progress probes
- ``repair``        ``RingRepair``: warm spares, swapping a link, keeping a session at the survivors, shadows
- ``spec``          ``SpecLoop``: speculative chunk scheduling and the greedy accept rule (pure)
- ``drafters``      drafters that propose tokens for verify chunks (n-gram, a draft model)
- ``chat``          chat messages -> token ids with the model's template, content always literal
- ``text``          ``Detokenizer``: committed ids -> the text safe to emit now, with stop strings
- ``conversation``  a conversation kept in a file across ``swarm coordinate --session`` runs
- ``measured``      the stage timings this client measured in its sessions, kept for routing over claims
"""
