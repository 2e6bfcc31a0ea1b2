"""The stage daemon: serve one block of layers to the ring over libp2p.

Data path per frame: the head receives token ids from the coordinator, every stage runs its
layers in a worker thread (so trio and the libp2p host stay responsive), forwards hidden states to
its successor over one persistent stream, and the tail returns argmax token ids straight to the
coordinator on the stream that opened the session.

Scheduling (continuous batching, after Orca, Yu et al. OSDI 2022, with Sarathi-Serve's chunked
prefill, Agrawal et al. OSDI 2024): arriving chunks queue per session; one scheduler task takes,
each step, the next chunk of every ready session that is short (decode/verify rows, at most
``BATCH_CHUNK_MAX`` positions, up to ``--max-batch-rows`` in all) into one packed forward, plus one
``--prefill-slice`` of a long (prefill) chunk, only ``--prefill-slice-shared`` while other sessions
have work waiting, so a long prompt never stalls other sessions. Only
sessions opened with ``batch: true`` (``swarm serve``) are packed; their rows run in fixed
``--batch-tile``-row GEMMs. The others (a single ``swarm coordinate`` stream) run alone, one GEMV
per row, as fast as plain decode. Either way every forward is row-invariant
(:mod:`swarm.kernels.invariant`): a position's bits do not depend on the chunk or the step it
shares, which the stage proves at start-up (:func:`swarm.kernels.check.check_block`) before it
serves a mode. Outputs leave through one ordered outbox per stream.

Layout (each module's docstring says what it owns; tests/test_layout.py holds who may import what):

- ``server``     ``StageServer``: info, inbound streams, dispatch of frames, sessions' lifecycle; it wires
                 together the objects below, each given what it uses (no mixins, no shared attributes)
- ``session``    ``Session`` and ``Job``: per-session state and queued work (data only)
- ``runtime``    ``StageRuntime``: the host, nursery and key the parts reach once the stage serves
- ``admission``  the open frame's checks and the KV budget: pure ``decide``, ``Reservations``
- ``scheduler``  ``Scheduler``: a step planned (pure ``plan_step`` -> ``StepPlan``), run (-> ``StepResult``),
                 applied to the queues
- ``kernel_proofs`` the start-up proof of the kernels (one GEMV per row) and of ``--batch-tile``
- ``outbox``     ``Outboxes``: ordered per-stream outboxes, posting outputs, successor streams, mirrors
- ``signing``    ``ReceiptSigner``: the stage receipt, signing the session's rolling digests, its
                 reproducibility class and the Merkle root over its windows of rows
- ``openings``   ``Audits``: recent jobs' rows handed to retention, ``audit`` requests answered (rate-limited)
- ``retention``  ``RetentionStore``: signed receipts and window commitments of recent jobs, bounded in bytes,
                 spilled to ``--audit-retention-dir`` when evicted from memory
- ``auditor_role`` ``AuditorRole`` (``--audit-rate``): offered job receipts queued, audited in idle time
- ``repair``     ``Repairs``: a heal's ``repair``, re-pointing a surviving session or promoting a shadow
- ``prefix``     the prefix store: KV blocks of prompts kept for the next session
- ``reuse``      ``PrefixReuse``: the store's budget, reuse at open and keeping at close
- ``metrics``    ``StageMetrics``: Prometheus metrics served by ``--metrics-listen``
- ``membership`` the stage in the swarm: announcing its record, drain announcements, auto placement
- ``preflight``  ``swarm stage --check``: everything a stage needs, checked without the network
- ``acquire``    where the weights come from at start-up: the cache, then peers, then the hub
- ``daemon``     the process: ``serve``, ``run_stage``, ``run_check``, lifecycle lines, SIGTERM drain

Rule: may import the shared core, ``transport``, ``kernels``, ``discovery``, ``weights`` and
``model``, ``auditor``; never ``coordinator`` (its peer), ``serve`` or ``cli``. Only ``cli`` imports it. Importing this package imports nothing (so the weights fetch path
through ``acquire`` stays free of torch).
"""
