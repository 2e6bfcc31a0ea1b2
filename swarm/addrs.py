"""Multiaddr strings, read without libp2p: the PeerId an address names, and where it is.

Owns: :func:`peer_id_from_addr` and :func:`without_peer_id`. Pure string work, so the config, the
stage, the transport and the CLI can all use it without loading libp2p. May import: the standard
library only.
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


def without_peer_id(addr: str) -> str:
    """The part of a multiaddr before its first ``/p2p/``: where to connect, without whom.

    For a circuit address that is the relay's own transport address.

    Args:
        addr: a multiaddr as text, e.g. ``/ip4/10.0.0.5/tcp/4001/p2p/12D3KooW...``.
    Returns:
        e.g. ``/ip4/10.0.0.5/tcp/4001``; ``addr`` itself when it names no PeerId.
    """
    return addr.split(_P2P, 1)[0]
