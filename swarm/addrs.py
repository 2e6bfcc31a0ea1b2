"""Multiaddr strings, read without libp2p: the PeerId an address names.

Owns: :func:`peer_id_from_addr`. Pure string work, so the config, the stage and the transport can
all use it without loading libp2p. May import: the standard library only.
"""

from __future__ import annotations

_P2P = "/p2p/"


def peer_id_from_addr(addr: str) -> str:
    """The PeerId after the last ``/p2p/`` of a multiaddr.

    For a circuit address (``/ip4/H/tcp/P/p2p/RELAY/p2p-circuit/p2p/PEER``) that is the peer reached
    through the relay; pass the part before ``/p2p-circuit`` for the relay's own PeerId.

    Args:
        addr: a multiaddr as text, e.g. ``/ip4/10.0.0.5/tcp/4001/p2p/12D3KooW...``.
    Returns:
        The PeerId (base58 text, not checked), or ``''`` when ``addr`` names none.
    """
    if _P2P not in addr:
        return ""
    return addr.rsplit(_P2P, 1)[1].split("/", 1)[0]
