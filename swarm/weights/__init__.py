"""Weights: getting and verifying a stage's own tensors. No torch anywhere in this package.

Rule: may import the shared core and ``transport``; never ``model`` (which imports this package). The order of
sources at start-up (cache, peers, hub) is ``swarm.stage.acquire``.

- ``manifest``  per-tensor sha256 manifest of a checkpoint and the model id (sha256 of it)
- ``select``    pure: the tensors and shard files of a layer range, the small files a stage needs
- ``store``     a weights directory holding only some shards, its sidecar, ``ShardVerifier``, warm restart
- ``hub``       only a range's shards from the Hugging Face hub, pinned to a commit, verified
- ``peer``      ``/swarm/weights/1.0.0``: every stage serves its files; ``fetch_weights`` from peers
- ``identify``  the model id of a directory (whole, or only some shards with a sidecar), cached
- ``families``  where each transformers family keeps its pieces: attribute paths, hence tensor names
"""
