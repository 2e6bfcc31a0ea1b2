"""Transport layer of a swarm node: identity, the libp2p host, framed streams, relays, deadlines.

Everything between "send this map to that stage" and TCP; ``import swarm.transport`` never loads torch (tested).
Rule: may import ``swarm.errors``, ``swarm.files`` and ``swarm.addrs`` only (the stdlib-only core).

- ``identity``  key file (0600), PeerId, sign / verify from a PeerId alone
- ``framing``   wire format, pure encoder/decoder, ``FramedStream``
- ``host``      ``open_host`` -> ``SwarmHost`` (listen, dial, serve protocols)
- ``peerstore`` the peer store, bounded by forgetting departed peers; handler faults stay local
- ``names``     ``/dns4`` / ``/dns6`` / ``/dns`` names resolved as the system does (getaddrinfo)
- ``dataplane`` fewer Python steps per byte on libp2p's Noise and Yamux, same bytes on the wire
- ``circuit``   circuit relay v2: serving as a relay, reserving on one, dialing through one
- ``migrate``   moving hops off relays once a direct connection (a hole punch) appears
- ``relay``     link emulation for benchmarks: a delaying TCP relay on loopback
"""

from swarm.transport.framing import (
    LENGTH_PREFIX_BYTES,
    MAX_FRAME_BYTES,
    QUEUE_FRAMES,
    FrameDecoder,
    FramedStream,
    decode_body,
    decode_length_prefix,
    encode_frame,
)
from swarm.transport.host import DEFAULT_LISTEN_ADDRS, SwarmHost, open_host
from swarm.transport.identity import (
    load_or_create_key,
    peer_id_of,
    public_key_of_peer,
    sign,
    verify_peer_signature,
)

__all__ = [
    "DEFAULT_LISTEN_ADDRS",
    "LENGTH_PREFIX_BYTES",
    "MAX_FRAME_BYTES",
    "QUEUE_FRAMES",
    "FrameDecoder",
    "FramedStream",
    "SwarmHost",
    "decode_body",
    "decode_length_prefix",
    "encode_frame",
    "load_or_create_key",
    "open_host",
    "peer_id_of",
    "public_key_of_peer",
    "sign",
    "verify_peer_signature",
]
