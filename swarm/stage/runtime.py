"""What a serving stage's parts reach at run time: its libp2p host, the nursery of its background
tasks and its node key. One :class:`StageRuntime` per stage, filled in once by
:func:`swarm.stage.daemon.serve`; the parts are built before (they hold its bound methods)."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.wire import PROTOCOL_ID


@dataclass
class StageRuntime:
    """The host, nursery and key a stage serves with; None until ``serve`` sets them.

    Attributes:
        hop_timeout_s: seconds a dial to a successor may take (``--hop-timeout-s``).
        host: the ``swarm.transport`` host (``peer_id``, ``open_stream``, ``addrs``).
        nursery: the trio nursery of background tasks (outboxes, successor drains, mirrors).
        key: the node's ed25519 KeyPair: signs receipts and openings.
    """

    hop_timeout_s: float
    host: object | None = None
    nursery: object | None = None
    key: object | None = None

    def peer_id(self) -> str:
        """This stage's PeerId (its host's)."""
        return self.host.peer_id

    def node_key(self):
        """The KeyPair that signs this stage's receipts and openings."""
        return self.key

    def dial(self, addr: str):
        """A new ``/swarm/ring/1`` stream to ``addr`` (a successor, or a mirror's shadow)."""
        return self.host.open_stream(addr, PROTOCOL_ID, timeout_s=self.hop_timeout_s)

    def spawn(self, fn, *args) -> None:
        """Start ``fn(*args)`` as a background task of the stage."""
        self.nursery.start_soon(fn, *args)
