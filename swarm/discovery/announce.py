"""Keeping a stage's record fresh on the DHT: republish, state changes, RTTs to the next holders.

Owns: ``Announcer``, the stage's task that signs and publishes its ``StageRecord`` at start, about
every ``interval_s`` after (each with a new expiry ``ttl_s`` out and a higher sequence number), at
once when poked (a state change such as ``draining``), and that measures round trips to the
stages whose blocks can follow its own (they start at or before its end layer and extend past it),
publishing them as ``rtt_ms`` for clients' routing. A failed publish is logged and retried at the
next tick after re-joining lost bootstrap nodes; it never stops the stage.
May import: stdlib, trio, ``swarm.discovery``, ``swarm.errors``. No torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from swarm.discovery.dht import DiscoveryError, SwarmDHT
from swarm.discovery.records import DEFAULT_TTL_S, RecordInvalid, StageRecord, sign_record
from swarm.transport.identity import peer_id_of

log = logging.getLogger(__name__)

MAX_RTT_PEERS = 16


class Announcer:
    """Publish one stage's record and keep it fresh.

    Args:
        dht: the stage's running SwarmDHT (server or client mode).
        key_pair: the stage's node key (signs the record; its PeerId is the record's).
        snapshot: returns the record's current fields except ``peer_id``, ``rtt_ms``, ``seq`` and
            ``expires_at`` (model id, layers, addrs, load, state, ...), read at each publish.
        interval_s: seconds between republishes (about half of ``ttl_s``).
        ttl_s: seconds each published record stays valid.
        clock: unix time.
    """

    def __init__(self, dht: SwarmDHT, key_pair, snapshot: Callable[[], dict], *, interval_s: float = 60.0,
                 ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time):
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"need 0 < interval_s ({interval_s}) < ttl_s ({ttl_s})")
        self.dht, self.key_pair, self.snapshot = dht, key_pair, snapshot
        self.interval_s, self.ttl_s, self.clock = interval_s, ttl_s, clock
        self.peer_id = peer_id_of(key_pair)
        self.seq = 0
        self.rtt_ms: dict[str, float] = {}
        self.published: StageRecord | None = None
        self._poke = trio.Event()

    def record(self) -> StageRecord:
        """The record as it would be published now (a fresh sequence number and expiry)."""
        now = self.clock()
        # a wall-clock sequence survives a restart: the new process's records still win
        self.seq = max(self.seq + 1, int(now * 1000))
        return StageRecord(peer_id=self.peer_id, rtt_ms=dict(self.rtt_ms), seq=self.seq,
                           expires_at=now + self.ttl_s, **self.snapshot())

    async def publish(self) -> bool:
        """Sign and publish the current record; True when the DHT took it.

        Raises:
            RecordInvalid: the snapshot makes an invalid record (a bug of the caller).
        """
        record = self.record()
        value = sign_record(self.key_pair, record)
        try:
            await self.dht.announce(value, record.model_id)
        except DiscoveryError as e:
            log.warning("announce.failed state=%s error=%s", record.state, e)
            await self.dht.rejoin()
            return False
        self.published = record
        log.info("announce.ok state=%s layers=[%d, %d) seq=%d sessions=%d", record.state, *record.layers,
                 record.seq, record.sessions)
        return True

    def poke(self) -> None:
        """Republish now (e.g. the state changed), without waiting for the next tick."""
        self._poke.set()

    async def measure_rtts(self) -> dict[str, float]:
        """Round trips to the holders of the layers after this stage's block, in ms.

        Returns:
            ``{peer_id: ms}`` of up to ``MAX_RTT_PEERS`` reachable holders; also kept for the record.
        """
        mine = self.snapshot()
        end = mine["layers"][1]
        if end >= mine["num_layers"]:
            self.rtt_ms = {}
            return {}
        try:
            records = await self.dht.find_records(mine["model_id"])
        except DiscoveryError as e:
            log.info("announce.rtt_lookup_failed error=%s", e)
            return self.rtt_ms
        nexts = [r for r in records if r.peer_id != self.peer_id and r.layers[0] <= end < r.layers[1]]
        out: dict[str, float] = {}

        async def one(r: StageRecord) -> None:
            for addr in r.addrs:
                ms = await self.dht.rtt_ms(addr)
                if ms is not None:
                    out[r.peer_id] = round(ms, 3)
                    return

        async with trio.open_nursery() as nursery:
            for r in nexts[:MAX_RTT_PEERS]:
                nursery.start_soon(one, r)
        self.rtt_ms = out
        return out

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Publish now, report started, then republish every ``interval_s`` or when poked.

        RTTs to the next holders are re-measured before each republish after the first, so the
        first record goes out without waiting on them.
        """
        try:
            await self.publish()
        except RecordInvalid:
            raise
        task_status.started()
        while True:
            with trio.move_on_after(self.interval_s):
                await self._poke.wait()
            poked = self._poke.is_set()
            self._poke = trio.Event()
            if not poked:
                with trio.move_on_after(self.interval_s / 2):
                    await self.measure_rtts()
            await self.publish()
