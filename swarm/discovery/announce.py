"""Keeping a stage's record fresh on the DHT: republish, state changes, RTTs to the next holders.

Owns: ``Announcer``, the stage's task that signs and publishes its ``StageRecord`` (at start, every
``interval_s``, at once on a state change), measures RTTs to the stages whose blocks can follow its own, warns
when no DHT node stored the record, and ``withdraw`` (a last short-lived ``draining`` record). No torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from swarm.discovery.clock import RESYNC_S
from swarm.discovery.dht import DiscoveryError, RecordRefused, SwarmDHT
from swarm.discovery.records import DEFAULT_TTL_S, MAX_TTL_S, RecordInvalid, StageRecord, sign_record
from swarm.transport.identity import peer_id_of

log = logging.getLogger(__name__)

MAX_RTT_PEERS = 16
LEAVING_TTL_S = 3.0  # the last record of a stage that leaves stays valid this long
# a stage's record while its weights load (minutes for a large block over a slow link); its first online
# record replaces it (a higher seq), and one that dies while loading holds its block at most this long
JOINING_TTL_S = MAX_TTL_S


def joining_fields(*, model_id: str, model_name: str, num_layers: int, layers: tuple[int, int],
                   addrs: tuple[str, ...], relay_addrs: tuple[str, ...] = (), throughput_tps: float = 0.0) -> dict:
    """The record fields (an ``Announcer`` snapshot) of a stage that chose its block and has not loaded it.

    Published as soon as the block is chosen, so that stages choosing while it loads count the
    block as taken (``swarm.routing.layer_capacity`` counts a joining holder at its ``throughput_tps``,
    which ``swarm.stage.membership.estimate_block_tps`` measures on one layer before choosing, or at
    the median speed when it is 0):
    without it, stages that join together read the same records and pick the same weakest window
    (issue 31's simulator; Petals announces a JOINING state the same way). Clients never route
    through it (only ``online`` holders serve hops).

    Args:
        model_id: 64-hex model id. model_name: display name. num_layers: L.
        layers: the chosen block ``(start, end)``, half-open.
        addrs, relay_addrs: where it can be dialed (a record needs one of the two).
        throughput_tps: decode steps/s it expects over the new block; 0: not measured (readers then
            count it at the median speed).
    Returns:
        A dict of StageRecord fields with ``state="joining"``.
    """
    return {"model_id": model_id, "model_name": model_name, "num_layers": num_layers, "layers": tuple(layers),
            "addrs": tuple(addrs), "relay_addrs": tuple(relay_addrs), "state": "joining", "sessions": 0,
            "throughput_tps": float(throughput_tps)}


def moved_fields(mine: dict, layers: tuple[int, int]) -> dict:
    """``joining_fields`` of a stage moving from its current block to ``layers``.

    Args:
        mine: its current record fields (an ``Announcer`` snapshot: layers, throughput_tps, addrs, ...).
        layers: the new block ``(start, end)``.
    Returns:
        The joining fields, with the throughput it measured over its old block carried over as a
        per-layer speed: ``throughput_tps * old width / new width`` (decode steps/s).
    """
    old_width, new_width = mine["layers"][1] - mine["layers"][0], layers[1] - layers[0]
    return joining_fields(model_id=mine["model_id"], model_name=mine["model_name"], num_layers=mine["num_layers"],
                          layers=tuple(layers), addrs=tuple(mine["addrs"]),
                          relay_addrs=tuple(mine.get("relay_addrs", ())),
                          throughput_tps=round(float(mine.get("throughput_tps", 0.0)) * old_width / new_width, 3))


class Announcer:
    """Publish one stage's record and keep it fresh.

    Args:
        dht: the stage's running SwarmDHT (server or client mode).
        key_pair: the stage's node key (signs the record; its PeerId is the record's).
        snapshot: returns the record's current fields except ``peer_id``, ``rtt_ms``, ``seq`` and
            ``expires_at`` (model id, layers, addrs, load, state, ...), read at each publish.
        interval_s: seconds between republishes (about half of ``ttl_s``).
        ttl_s: seconds each published record stays valid.
        clock: unix time (default: the DHT's, i.e. the swarm's time as measured at join).
    """

    def __init__(self, dht: SwarmDHT, key_pair, snapshot: Callable[[], dict], *, interval_s: float = 60.0,
                 ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] | None = None):
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"need 0 < interval_s ({interval_s}) < ttl_s ({ttl_s})")
        self.dht, self.key_pair, self.snapshot = dht, key_pair, snapshot
        self.interval_s, self.ttl_s, self.clock = interval_s, ttl_s, clock or dht.clock
        self.withdrawn = False
        self.peer_id = peer_id_of(key_pair)
        self.seq = 0
        self.rtt_ms: dict[str, float] = {}
        self.published: StageRecord | None = None
        self._poke = trio.Event()

    def record(self, ttl_s: float | None = None) -> StageRecord:
        """The record as it would be published now (a fresh sequence number and expiry ``ttl_s``
        out, default ``self.ttl_s``)."""
        now = self.clock()
        # a wall-clock sequence survives a restart: the new process's records still win
        self.seq = max(self.seq + 1, int(now * 1000))
        return StageRecord(peer_id=self.peer_id, rtt_ms=dict(self.rtt_ms), seq=self.seq,
                           expires_at=now + (self.ttl_s if ttl_s is None else ttl_s), **self.snapshot())

    async def publish(self, ttl_s: float | None = None) -> bool:
        """Sign and publish the current record; True when some DHT node stored it.

        Raises:
            RecordInvalid: the snapshot makes an invalid record (a bug of the caller).
        """
        record = self.record(ttl_s)
        value = sign_record(self.key_pair, record)
        try:
            await self.dht.announce(value, record.model_id)
        except RecordRefused as e:
            log.warning("announce.refused %s, so clients cannot find this stage (state=%s seq=%d). Likely causes: "
                        "those nodes unreachable from here, a clock off by more than the record's %.0f s lifetime "
                        "here or on those nodes (%s), nodes that do not accept this model, or an older swarm "
                        "version",
                        e, record.state, record.seq, record.expires_at - self.clock(), self.dht.describe_clock())
            await self.dht.rejoin()
            return False
        except DiscoveryError as e:
            log.warning("announce.failed state=%s error=%s", record.state, e)
            await self.dht.rejoin()
            return False
        self.published = record
        log.info("announce.ok state=%s layers=[%d, %d) seq=%d sessions=%d", record.state, *record.layers,
                 record.seq, record.sessions)
        return True

    async def withdraw(self, timeout_s: float = 5.0) -> bool:
        """Publish a last ``draining`` record valid only ``LEAVING_TTL_S`` and stop republishing
        (the stage is leaving: readers drop it seconds later instead of at the old expiry).
        The snapshot should already say ``draining``. Returns whether some node stored it."""
        self.withdrawn = True
        with trio.move_on_after(timeout_s):
            return await self.publish(ttl_s=LEAVING_TTL_S)
        return False

    async def move(self, layers: tuple[int, int], timeout_s: float = 5.0) -> bool:
        """Publish this stage's last record before it restarts on another block: that block as
        ``joining`` (``moved_fields``: its measured speed carried over), valid ``JOINING_TTL_S``, and
        stop republishing. Stages placing themselves or rebalancing while it reloads count the new
        block as taken instead of all moving to the same weakest window; clients stop routing to the old block at once (a
        joining holder serves no hops). Returns whether some node stored it."""
        self.withdrawn = True
        self.rtt_ms = {}  # measured from the old block's end
        fields = moved_fields(self.snapshot(), layers)
        snapshot, self.snapshot = self.snapshot, lambda: fields
        try:
            with trio.move_on_after(timeout_s):
                return await self.publish(ttl_s=JOINING_TTL_S)
            return False
        finally:
            self.snapshot = snapshot

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
            if self.withdrawn:
                return
            if not poked:
                with trio.move_on_after(self.interval_s / 2):
                    await self.dht.sync_clock(max_age_s=RESYNC_S)
                    await self.measure_rtts()
            if not self.withdrawn:
                await self.publish()
