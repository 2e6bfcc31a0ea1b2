"""swarm: a peer-to-peer, pipeline-parallel LLM inference swarm.

Layer map, lower first: each part may import only the parts its rule names, checked by ``tests/test_layout.py``;
``stage`` and ``coordinator`` are peers that never import each other. Importing this package has no side effects
and loads neither torch nor libp2p.

- ``errors``      the error hierarchy                                  (stdlib only)
- ``ranges``      half-open layer ranges, tilings, even splits            (core)
- ``heal``        heal decisions, pure                                    (core)
- ``routing``     choosing a route (a chain of stages) and spares, pure   (core)
- ``files``       writing a file atomically (temp file + rename)          (stdlib only)
- ``addrs``       multiaddr strings: the PeerId an address names, pure    (stdlib only)
- ``merkle``      RFC 6962 hash trees: roots, inclusion paths, checks     (stdlib only)
- ``repro``       reproducibility classes: facts in, class id out, pure  (stdlib only)
- ``flags``       config fields that are also command-line flags          (stdlib only)
- ``frames``      the ring protocol's frames, one dataclass per type      (stdlib only)
- ``config``      the frozen per-role configs, the cache root             (core, transport)
- ``receipts``    receipt schema, signing, verification                   (core, transport)
- ``wire``        tensor <-> bytes, frame schema and validation           (core, transport)
- ``listen``      binding a TCP port before anything loads                (core, transport)
- ``mirror``      a hop's copy of its input sent to a shadow              (core, transport)
- ``metrics``     Prometheus plumbing shared by stage and serve           (core, transport)
- ``openings``    openable receipts: window leaves, openings, the client  (core, transport)
- ``proofs``      audit selection by hash, fraud proofs and their check   (core, transport)
- ``transport``   libp2p host, identity, framed streams, relays, deadlines (core; never torch)
- ``kernels``     the arithmetic a stage runs and its start-up proof       (core)
- ``discovery``   the DHT, signed stage records, clocks, the bootstrap node (core, transport; no torch)
- ``weights``     getting and verifying a stage's tensors, model ids      (core, transport; no torch)
- ``model``       model resolution, layer blocks, KV cache, sampling      (core, kernels, weights; no networking)
- ``auditor``     re-running other stages' opened work, judging proofs   (core, transport, kernels,
                  discovery, weights, model)
- ``stage``       the stage daemon                                        (everything above)
- ``coordinator`` the client: generation, the ring client, heal, speculation (everything above; not stage)
- ``serve``       the OpenAI-compatible HTTP API and the dashboard        (everything above and coordinator)
- ``cli``         the ``swarm`` command, the demo, local rings            (anything; nothing imports it)
- ``__main__``    ``python -m swarm``                                     (cli)
"""

__version__ = "0.1.0"
