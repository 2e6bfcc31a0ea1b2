"""The stage daemon: serve one block of layers to the ring over libp2p (docs/architecture.md, "Processes and roles").

Rule: may import the shared core, ``transport``, ``kernels``, ``discovery``, ``weights``, ``model`` and ``auditor``;
never ``coordinator`` (its peer), ``serve`` or ``cli``. Importing it imports nothing (``acquire`` stays torch-free).

- ``server``        ``StageServer``: info, inbound streams, dispatch of frames, sessions' lifecycle; wires the rest
- ``session``       ``Session`` and ``Job``: per-session state and queued work (data only)
- ``runtime``       ``StageRuntime``: the host, nursery and key the parts reach once the stage serves
- ``admission``     the open frame's checks and the KV budget: pure ``decide``, ``Reservations``
- ``scheduler``     ``Scheduler``: a step planned (pure ``plan_step``), run and applied to the queues
- ``kernel_proofs`` the start-up proof of the kernels (one GEMV per row) and of ``--batch-tile``
- ``outbox``        ``Outboxes``: ordered per-stream outboxes, posting outputs, successor streams, mirrors
- ``signing``       ``ReceiptSigner``: the stage receipt over the session's digests, class and window root
- ``openings``      ``Audits``: recent jobs' rows handed to retention, ``audit`` requests answered (rate-limited)
- ``retention``     ``RetentionStore``: recent jobs' receipts and windows, bounded, spilled to disk when evicted
- ``auditor_role``  ``AuditorRole`` (``--audit-rate``): offered job receipts queued, audited in idle time
- ``repair``        ``Repairs``: a heal's ``repair``, re-pointing a surviving session or promoting a shadow
- ``prefix``        the prefix store: KV blocks of prompts kept for the next session
- ``reuse``         ``PrefixReuse``: the store's budget, reuse at open and keeping at close
- ``metrics``       ``StageMetrics``: Prometheus metrics served by ``--metrics-listen``
- ``membership``    the stage in the swarm: announcing its record, drain announcements, auto placement
- ``preflight``     ``swarm stage --check``: everything a stage needs, checked without the network
- ``acquire``       where the weights come from at start-up: the cache, then peers, then the hub
- ``daemon``        the process: ``serve``, ``run_stage``, ``run_check``, lifecycle lines, SIGTERM drain
"""
