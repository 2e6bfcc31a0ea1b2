"""Discovery: DHT membership and signed stage records (trio, libp2p, PyNaCl; no torch).

- ``swarm.discovery.records``  the signed stage record, its checks, which value wins
- ``swarm.discovery.dht``      the swarm's Kademlia DHT: pinned protocol id, join, announce, read
"""
