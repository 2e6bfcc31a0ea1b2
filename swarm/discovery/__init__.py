"""Discovery: DHT membership, signed stage records, swarm time and the bootstrap node.

Rule: may import the shared core and ``transport``; trio, libp2p, PyNaCl; never torch.

- ``records``    the signed stage record, its checks, which value wins
- ``providers``  a provider store stale entries cannot fill, a lookup without side effects
- ``clock``      swarm time: this node's offset from the swarm's clock, measured against peers
- ``reach``      reachability: can the swarm dial this node (a dial-back asked of a bootstrap node)
- ``lookup``     the iterative Kademlia lookup: the k nodes closest to a key, and the values they hold
- ``dht``        the swarm's Kademlia DHT: pinned protocol id, join, announce, read
- ``announce``   keeping a stage's record fresh: republish, state changes, RTTs to the next holders
- ``client``     a client's view: records -> holders, RTT probes, a route as a ring, replacements
- ``peers``      ``swarm peers``: per model a layer-coverage map, per stage its record
- ``bootstrap``  ``swarm bootstrap`` and ``swarm relay``: nodes that hold no model
"""
