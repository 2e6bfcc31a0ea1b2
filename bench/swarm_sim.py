"""A swarm of volunteer stages in virtual time, driving swarm's own decision code (issue 31, item 1).

Owns the model of the world: peers (region, card class, relay, lifetime), the network (RTT,
jitter, loss, dial costs, dead peers), churn (departures, a correlated shock, a bootstrap outage),
clients opening sessions and generating, and a Kademlia DHT model (XOR distance, k-buckets that
lag behind churn; the product's iterative walk, ``swarm.discovery.lookup.walk``, runs over it; provider
stores bounded as the product bounds them, values at the k closest nodes and the bootstrap nodes).

What runs for real, unchanged: record building (``Announcer.record``: seq and expiry),
``sign_record``, ``open_record``/``select_record`` (every record a reader opens), the client's whole
read and route (``discover_ring`` -> ``SwarmDHT.read_records`` -> ``lookup_providers``,
``probe_rtts``, ``holders_of``, ``plan_route``), a heal's choice (``locate_failure``, ``plan_replay``,
``find_replacement`` -> ``plan_replacement``), placement of a joining stage (``plan_placement`` over what
``read_records(placement=True)`` sees: the model key's providers and every placement shard's, then its
``joining`` record from ``joining_fields`` carrying the speed ``estimate_block_tps`` measured, modelled as
the peer's true speed times a log-normal error of ``PROBE_ERROR``) and
the rebalance check (``should_move``). The async product code runs under ``trio.run`` with a
``MockClock`` (virtual time) against ``SimDHT``: a real ``SwarmDHT`` whose libp2p objects are
stand-ins that sleep the modelled network time, and whose ping (``rtt_ms``) is the RTT model.

Clients run on ``CLIENT_MACHINES`` machines; each keeps a peer cache (the DHT servers its last route's
lookups met, those that named providers first, as ``open_dht`` writes on the way out), through which it
joins during the bootstrap outage (``open_dht``'s known peers, timed as ``_join_any`` joins them); a
machine that never ran waits.

Modelled, not real: the network and libp2p (connections, streams, the routing tables), the DHT's
storage, a stage's compute (per-layer ms from its card class), loading weights, sessions' KV
room (not checked), speculative decoding (plain decode), and the world stays frozen during one
client operation (a read, a heal: a few seconds), so a peer dying mid-read is not modelled.
A stage's periodic reads (rebalance check, RTT measurement) see the records the DHT model holds
(validated when stored, as DHT nodes do, and filtered by expiry) instead of running the full read.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import trio
import trio.testing

from swarm.discovery import client as disc_client
from swarm.discovery.announce import JOINING_TTL_S, LEAVING_TTL_S, Announcer, joining_fields, moved_fields
from swarm.discovery.dht import (GET_ENOUGH, JOIN_GRACE_S, OUTAGE_READ_ALPHA, PEER_CACHE_SIZE, PLACEMENT_SHARDS,
                                 SwarmDHT, peer_cache_order, placement_key, placement_shard)
from swarm.discovery.lookup import ALPHA as LOOKUP_ALPHA, QUERY_TIMEOUT_S as LOOKUP_QUERY_TIMEOUT_S, walk
from swarm.discovery.providers import MAX_PROVIDERS_PER_KEY, PROVIDER_TTL_S
from swarm.discovery.records import StageRecord, open_record, record_key, sign_record
from swarm.heal import StageReport, locate_failure, plan_replay
from swarm.routing import Holder, layer_capacity, plan_placement, should_move
from swarm.config import AdmissionSection, MembershipSection

MODEL_ID = hashlib.sha256(b"sim-70b").hexdigest()
NUM_LAYERS = 80  # a 70B-class model
REF_LAYER_MS = 1.0  # one decode step of one layer on the reference card (speed 1.0)
PROBE_ERROR = 0.15  # sigma (log scale) of a stage's one-layer speed probe before choosing (membership.estimate_block_tps)
PREFILL_GAIN = 32.0  # a prefill or replay position costs 1/32 of a decode step (batched)
K = 20  # Kademlia bucket size and replication
# py-libp2p's dial waits up to 250 ms for more connections (happy eyeballs; DESIGN.md) unless it has
# max_connections_per_peer of them: swarm's hosts set that to 1 (swarm/transport/host.py), so a dial
# is its round trips only (a loopback connect measured 5-12 ms). This was 0.25 s until 2026-12-04.
DIAL_WAIT_S = 0.0
TABLE_REFRESH_S = 600.0  # a node's routing table lags the swarm by up to this long
LOSS = 0.005
DETECT_CRASH_S = 1.8  # the connection health monitor finds a frozen/vanished peer (DESIGN.md)
DETECT_EOF_S = 0.05  # a stage that exits closes its connections: EOF
CARDS = (  # (name, speed vs reference, layers that fit, share of volunteers)
    ("T4-16G", 0.2, 10, 0.10), ("3060-12G", 0.35, 8, 0.20), ("3090-24G", 0.8, 16, 0.25),
    ("4090-24G", 1.0, 16, 0.25), ("A100-40G", 1.3, 28, 0.12), ("A100-80G", 1.5, 40, 0.08))
NUM_REGIONS = 6
CLIENT_MACHINES = 100  # machines the clients run on; each session is from one of them, at random
EPOCH = 1.8e9  # unix seconds at virtual time 0 (records carry unix expiries)
ANNOUNCE_INTERVAL_S = MembershipSection().announce_interval_s  # the stages' defaults
RECORD_TTL_S = MembershipSection().record_ttl_s
REBALANCE_S = MembershipSection().rebalance_s
DRAIN_TIMEOUT_S = AdmissionSection().drain_timeout_s


def node_key(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


@dataclass
class Peer:
    idx: int
    key_pair: object
    peer_id: str
    key: int
    region: int
    access_ms: float
    relay_ms: float  # 0: directly reachable; else the extra round trip through its relay
    speed: float
    fit: int
    card: str
    join_t: float
    death_t: float
    graceful: bool
    layers: tuple[int, int] | None = None
    state: str = "loading"  # loading | online | draining | gone
    announcer: Announcer | None = None
    value: bytes | None = None  # its latest signed record (what it answers a GET for its key)
    record: StageRecord | None = None
    holder: Holder | None = None
    sessions: int = 0
    moves: int = 0
    gone_t: float = math.inf  # when it stopped answering (death, or the end of its drain)

    @property
    def server(self) -> bool:  # a stage behind NAT runs the DHT in client mode (swarm.discovery.reach)
        return self.relay_ms == 0

    def layer_ms(self) -> float:
        return REF_LAYER_MS / self.speed

    def tps(self) -> float:
        return 1000.0 / (self.layer_ms() * (self.layers[1] - self.layers[0]))


@dataclass
class Endpoint:
    """A client (or a bootstrap node): somewhere on the network."""

    name: str
    region: int
    access_ms: float
    relay_ms: float = 0.0


class World:
    """The swarm, the network and the DHT model at virtual time ``now`` (seconds)."""

    def __init__(self, *, peers: int, seed: int, churn: bool):
        self.rng = random.Random(seed)
        self.now = 0.0
        self.churn = churn
        r = self.rng
        self.region_rtt = [[0.0] * NUM_REGIONS for _ in range(NUM_REGIONS)]
        for a in range(NUM_REGIONS):
            for b in range(a, NUM_REGIONS):
                v = r.uniform(5, 30) if a == b else r.uniform(60, 250)
                self.region_rtt[a][b] = self.region_rtt[b][a] = v
        self.region_weight = [r.uniform(0.5, 2.0) for _ in range(NUM_REGIONS)]
        self.peers: dict[str, Peer] = {}
        self.by_idx: list[Peer] = []
        self.bootstrap = [Endpoint(f"bootstrap-{i}", i % NUM_REGIONS, 1.0) for i in range(3)]
        self.boot_ids = [f"boot{i}" for i in range(3)]
        self.boot_keys = {b: node_key(b) for b in self.boot_ids}
        self.boot_down = (math.inf, -math.inf)
        self.boot_providers: dict[str, OrderedDict] = {b: OrderedDict() for b in self.boot_ids}
        self.boot_values: dict[str, dict[str, bytes]] = {b: {} for b in self.boot_ids}
        self.providers: dict[int, OrderedDict] = {}  # server key -> provider entries of the model key
        self.model_key = node_key(MODEL_ID)
        # placement shards (swarm.discovery.dht.placement_key): one store per shard at the bootstrap
        # nodes (they all get every write while up) and at the k closest servers of the shard's key
        self.shard_keys = [node_key(placement_key(MODEL_ID, i)) for i in range(PLACEMENT_SHARDS)]
        self.boot_shards: list[OrderedDict] = [OrderedDict() for _ in range(PLACEMENT_SHARDS)]
        self.shard_providers: dict[tuple[int, int], OrderedDict] = {}  # (server key, shard) -> entries
        self._shard_closest: dict[int, tuple[int, list]] = {}
        self.tables_at = -math.inf
        self.table_keys: list[int] = []
        self.table_peer: dict[int, Peer | str] = {}
        self.n_initial = peers
        self._next_idx = 0

    # ---- peers -----------------------------------------------------------------------------------------------
    def region(self) -> int:
        return self.rng.choices(range(NUM_REGIONS), weights=self.region_weight)[0]

    def new_peer(self, join_t: float) -> Peer:
        from libp2p.crypto.ed25519 import create_new_key_pair
        from swarm.transport.identity import peer_id_of

        r = self.rng
        kp = create_new_key_pair(r.randbytes(32))
        pid = peer_id_of(kp)
        name, speed, fit, _ = r.choices(CARDS, weights=[c[3] for c in CARDS])[0]
        # about half of new peers leave within 2 hours, heavy tail (lognormal, median 2 h)
        life = math.exp(r.gauss(math.log(7200.0), 1.6)) if self.churn else math.inf
        p = Peer(self._next_idx, kp, pid, node_key(pid), self.region(), r.uniform(1, 10),
                 r.uniform(40, 120) if r.random() < 0.15 else 0.0, speed, fit, name, join_t, join_t + life,
                 graceful=r.random() < 0.6)
        self._next_idx += 1
        self.peers[pid] = p
        self.by_idx.append(p)
        return p

    def alive(self, p: Peer, t: float | None = None) -> bool:
        return (self.now if t is None else t) < p.gone_t

    def boot_up(self, t: float | None = None) -> bool:
        t = self.now if t is None else t
        return not self.boot_down[0] <= t < self.boot_down[1]

    # ---- network -----------------------------------------------------------------------------------------------
    def rtt_s(self, a, b, jitter: random.Random | None = None) -> float:
        """One round trip between two endpoints or peers, seconds (relayed ones add their relay's leg)."""
        ms = self.region_rtt[a.region][b.region] + a.access_ms + b.access_ms + a.relay_ms + b.relay_ms
        if jitter is not None:
            ms *= 1.0 + abs(jitter.gauss(0, 0.1))
            if jitter.random() < LOSS:  # a lost segment: a retransmission after RTO (>= 200 ms)
                ms += max(200.0, 2 * ms)
        return ms / 1000.0

    def connect_s(self, a, b, jitter: random.Random) -> float:
        """A cold py-libp2p dial: TCP, Noise XX, multistream + yamux (about 3 RTT; ``DIAL_WAIT_S``)."""
        extra = 1.0 if jitter.random() < LOSS else 0.0  # a lost SYN waits for the 1 s initial RTO
        return DIAL_WAIT_S + 3 * self.rtt_s(a, b, jitter) + extra

    # ---- DHT model -------------------------------------------------------------------------------------------
    def servers(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.server and p.state != "loading" and self.alive(p)]

    def refresh_tables(self) -> None:
        """Routing tables as the swarm's nodes know it: refreshed every TABLE_REFRESH_S, so nodes that
        left since are still named (and cost a dial), and nodes that joined since are not yet."""
        if self.now - self.tables_at < TABLE_REFRESH_S:
            return
        self.tables_at = self.now
        entries: dict[int, Peer | str] = {p.key: p for p in self.servers()}
        entries.update({k: b for b, k in self.boot_keys.items()})
        self.table_keys = sorted(entries)
        self.table_peer = entries

    def closest_in_table(self, asker: int, target: int, salt: int) -> list[int]:
        """The k entries node ``asker`` returns for ``target``: its bucket holding ``target`` is a random
        k of the nodes in that subtree (as of the last table refresh), closest to ``target`` first."""
        shared = 256 - (asker ^ target).bit_length()  # bits asker and target share
        depth = min(255, shared + 1)
        lo = (target >> (256 - depth)) << (256 - depth)
        hi = lo + (1 << (256 - depth))
        i, j = bisect.bisect_left(self.table_keys, lo), bisect.bisect_left(self.table_keys, hi)
        subtree = self.table_keys[i:j]
        if len(subtree) > K:
            subtree = random.Random(asker ^ salt ^ int(self.tables_at)).sample(subtree, K)
        if len(subtree) < K:  # a small subtree: fill with the nearest others (closer buckets of the asker)
            near = self.table_keys[max(0, i - K):j + K]
            subtree = list(dict.fromkeys(subtree + near))
        return sorted(subtree, key=lambda x: x ^ target)[:K]

    def k_closest_alive(self, target: int) -> list[Peer]:
        return sorted(self.servers(), key=lambda p: p.key ^ target)[:K]

    def provide(self, p: Peer) -> None:
        """ADD_PROVIDER of the model key at the bootstrap nodes and the k closest servers, under the
        product's provider-store policy (``bound_provider_store``: MAX_PROVIDERS_PER_KEY entries, the
        least recently refreshed evicted, PROVIDER_TTL_S)."""
        stores = [self.boot_providers[b] for b in self.boot_ids] if self.boot_up() else []
        stores += [self.providers.setdefault(q.key, OrderedDict()) for q in self._closest_model_servers()]
        for store in stores:
            store.pop(p.peer_id, None)
            store[p.peer_id] = self.now
            while len(store) > MAX_PROVIDERS_PER_KEY:
                store.popitem(last=False)
        if self.boot_up():
            for b in self.boot_ids:
                self.boot_values[b][p.peer_id] = p.value
        # SwarmDHT.announce also provides the placement shard of the block's start
        shard = placement_shard(p.layers[0], NUM_LAYERS)
        stores = [self.boot_shards[shard]] if self.boot_up() else []
        stores += [self.shard_providers.setdefault((q.key, shard), OrderedDict()) for q in self._shard_servers(shard)]
        for store in stores:
            store.pop(p.peer_id, None)
            store[p.peer_id] = self.now
            while len(store) > MAX_PROVIDERS_PER_KEY:
                store.popitem(last=False)

    def _shard_servers(self, shard: int) -> list[Peer]:
        stamp = int(self.now // 30)  # the k closest to a shard key, as of the last 30 s
        got = self._shard_closest.get(shard)
        if got is None or got[0] != stamp:
            got = self._shard_closest[shard] = (stamp, sorted(self.servers(),
                                                              key=lambda q: q.key ^ self.shard_keys[shard])[:K])
        return got[1]

    def _closest_model_servers(self) -> list[Peer]:
        if getattr(self, "_cms_at", None) != self.now:
            self._cms_at, self._cms = self.now, self.k_closest_alive(self.model_key)
        return self._cms

    def fresh_providers(self, store: OrderedDict) -> list[str]:
        return [pid for pid, t in store.items() if self.now - t <= PROVIDER_TTL_S]

    def visible_records(self, reader: Peer | None = None, placement: bool = False) -> list[StageRecord]:
        """What a stage's periodic read returns in the model: the providers the closest node (or a
        bootstrap node) names, their records as stored (validated on store), unexpired now.
        ``placement``: ``read_records(placement=True)``, the providers of every placement shard too."""
        if self.boot_up():
            names = self.fresh_providers(self.boot_providers[self.boot_ids[0]])
        else:
            cms = self._closest_model_servers()
            names = self.fresh_providers(self.providers.get(cms[0].key, OrderedDict())) if cms else []
        if placement:
            for shard in range(PLACEMENT_SHARDS):
                if self.boot_up():
                    names += self.fresh_providers(self.boot_shards[shard])
                else:
                    near = self._shard_servers(shard)
                    names += self.fresh_providers(self.shard_providers.get((near[0].key, shard), OrderedDict())) \
                        if near else []
            names = list(dict.fromkeys(names))
        out = []
        for pid in names:
            q = self.peers.get(pid)
            if q is None or q.record is None or q.record.expires_at <= EPOCH + self.now:
                continue
            out.append(q.record)
        if reader is not None and reader.record is not None and reader.record.expires_at > EPOCH + self.now \
                and all(r.peer_id != reader.peer_id for r in out):
            out.append(reader.record)
        return out


# ---- the product's SwarmDHT over modelled libp2p objects ------------------------------------------------------

class _Info:
    def __init__(self, peer_id: str, addrs=("x",)):
        self.peer_id, self.addrs = peer_id, list(addrs)


class _Net:
    def get_connections(self, peer_id):
        return []

    def unblock_peer(self, peer_id):
        pass


class _Store:
    def clear_addrs(self, peer_id):
        pass

    def add_addrs(self, peer_id, addrs, ttl):
        pass


class _LibHost:
    def __init__(self, name):
        self.name = name

    def get_id(self):
        return self.name

    def get_peerstore(self):
        return _Store()

    def get_network(self):
        return _Net()


class _Host:
    def __init__(self, name):
        self.peer_id = name
        self.libp2p_host = _LibHost(name)


class _Op:
    """One client operation's view of the network: who it is, what it has dialed, its jitter."""

    def __init__(self, world: World, me: Endpoint, seed: int, through: list[str] | None = None):
        self.world, self.me = world, me
        self.jitter = random.Random(seed)
        # the peers it joined through during an outage are connected already (the join's dials are
        # timed in its route, ``Sim.join_via_cache``)
        self.connected: set[str] = set(through or ())
        self.key = node_key(me.name)
        # the nodes it joined through: the bootstrap nodes, or its cached peers during their outage
        self.seed_names = dict((k, b) for b, k in world.boot_keys.items()) if through is None else \
            {world.peers[n].key: n for n in through}

    def endpoint(self, name: str):
        w = self.world
        if name in w.boot_keys:
            return w.bootstrap[w.boot_ids.index(name)]
        return w.peers.get(name)

    async def request(self, name: str, timeout_s: float = math.inf) -> bool:
        """Dial if needed and make one request to ``name``: sleeps its time; False when it does not answer."""
        w, peer = self.world, self.endpoint(name)
        if peer is None:
            return False
        if name in w.boot_keys:
            dead, refused = not w.boot_up(), False
        else:
            dead = not w.alive(peer) or peer.state == "loading"
            # a stage restarting on a new block, or one that exited, on a live machine: refused at once
            refused = dead and (peer.state == "loading" or peer.graceful)
        if dead:
            # a process that exited on a live machine refuses at once; a crashed one never answers
            await trio.sleep(w.rtt_s(self.me, peer, self.jitter) if refused else min(timeout_s, 1e6))
            return False
        cost = 0.0
        if name not in self.connected:
            cost += w.connect_s(self.me, peer, self.jitter)
            self.connected.add(name)
        cost += w.rtt_s(self.me, peer, self.jitter)
        await trio.sleep(cost)
        return True


class _ProviderStore:
    def __init__(self, op: _Op):
        self.op = op

    def get_providers(self, key):
        return []

    async def _get_providers_from_peer_with_closers(self, peer, key):
        w = self.op.world
        if not await self.op.request(str(peer)):
            return [], []  # libp2p 0.8.1 logs a failed query and answers nothing
        if str(peer) in w.boot_keys:
            names = w.fresh_providers(w.boot_providers[str(peer)])
        else:
            p = w.peers[str(peer)]
            names = w.fresh_providers(w.providers.get(p.key, OrderedDict()))
        return [_Info(n) for n in names], []


class _ValueStore:
    def __init__(self, op: _Op):
        self.op, self.store = op, {}

    def get(self, kb):
        return None

    async def _get_from_peer(self, peer, kb):
        w, name = self.op.world, str(peer)
        if not await self.op.request(name, 2.0):
            raise OSError("no answer")
        pid = kb.decode().rsplit("/", 1)[-1]
        if name in w.boot_keys:
            return w.boot_values[name].get(pid)
        return w.peers[name].value if name == pid else None


class _Kad:
    def __init__(self, op: _Op):
        self.op = op
        self.host = _LibHost(op.me.name)
        self.provider_store = _ProviderStore(op)
        self.value_store = _ValueStore(op)


class SimDHT(SwarmDHT):
    """The product's SwarmDHT (read_records, _fresh_providers, _value_from_owner, _fresh_value run as
    written) over the modelled libp2p objects; only the ping is the RTT model."""

    def __init__(self, op: _Op, clock, through: list[str] | None = None):
        """``through``: the PeerIds ``open_dht`` joined through when no bootstrap node answered (a
        peer cache's servers); None: the bootstrap nodes."""
        super().__init__(_Host(op.me.name), _Kad(op), [_Info(b) for b in (op.world.boot_ids if through is None
                                                                          else through)], clock)
        self.op = op
        if through is not None:  # as open_dht sets it for a node joined through known peers
            self.read_alpha = OUTAGE_READ_ALPHA

    def _name_of(self, k: int) -> str:
        """The PeerId of the node whose table key is ``k``."""
        names = self.op.seed_names
        if k in names:
            return names[k]
        entry = self.op.world.table_peer[k]
        return entry if isinstance(entry, str) else entry.peer_id

    def _start(self) -> list[int]:
        """Where a lookup starts, as the product's: the nodes it joined through and its table's nearest."""
        op = self.op
        op.world.refresh_tables()
        return list(op.seed_names) + op.world.closest_in_table(op.key, op.key, 7)

    async def closest_nodes(self, key: bytes, on_answer=None, *, alpha: int = LOOKUP_ALPHA) -> list:
        """What the product's ``closest_nodes`` runs: ``swarm.discovery.lookup.walk`` (the iterative
        walk of ``lookup``, ``LOOKUP_QUERY_TIMEOUT_S`` per request) over the network model, from
        ``_start``. Nodes are table keys here; the target is the model key (routes read it)."""
        op, w = self.op, self.op.world
        target = w.model_key

        async def query(k: int):
            ok = await op.request(self._name_of(k), LOOKUP_QUERY_TIMEOUT_S)
            return w.closest_in_table(k, target, 11) if ok else None

        walked = await walk(self._start(), query, lambda k: k ^ target, k=K, alpha=alpha,
                            on_answer=None if on_answer is None else lambda k: on_answer(self._name_of(k)))
        return [self._name_of(k) for k in walked.closest]

    async def get_value(self, key: str, *, enough: int = GET_ENOUGH, timeout_s: float = 5.0) -> bytes | None:
        """The product's ``get_value`` over the network model: ``walk`` towards the key until ``enough``
        valid copies arrived or the walk ends, within ``timeout_s``. The k nodes nearest the key (as of
        the last table refresh) hold what the stage last published (``announce`` stores it there), also
        after the stage left; a copy counts once it passes the product's check (``_valid``: its expiry)."""
        op, w = self.op, self.op.world
        target = node_key(key)
        start = self._start()
        holders = set(sorted(w.table_keys, key=lambda x: x ^ target)[:K])
        owner = w.peers.get(key.rsplit("/", 1)[-1])
        value = owner.value if owner is not None else None
        copies: list[bytes] = []

        async def query(k: int):
            if not await op.request(self._name_of(k), LOOKUP_QUERY_TIMEOUT_S):
                return None
            if k in holders and value is not None and self._valid(key, value):
                copies.append(value)
            return w.closest_in_table(k, target, 11)

        with trio.move_on_after(timeout_s):
            await walk(start, query, lambda k: k ^ target, k=K, done=lambda: len(copies) >= enough)
        return copies[0] if copies else None

    async def rtt_ms(self, addr: str, rounds: int = 3, timeout_s: float = 3.0) -> float | None:
        name = addr.rsplit("/", 1)[-1]
        with trio.move_on_after(timeout_s):
            if not await self.op.request(name, timeout_s):
                return None
            best = math.inf
            peer = self.op.endpoint(name)
            for _ in range(rounds):
                one = self.op.world.rtt_s(self.op.me, peer, self.op.jitter)
                await trio.sleep(one)
                best = min(best, one * 1000)
            return best
        return None


def run_op(world: World, me: Endpoint, seed: int, fn, through: list[str] | None = None) -> tuple[object, float, float]:
    """Run ``await fn(dht)`` against the frozen world in virtual time (``through``: as for SimDHT).

    Returns:
        (result or the exception it raised, virtual seconds, CPU seconds of this process).
    """
    op = _Op(world, me, seed, through)
    clock = trio.testing.MockClock(autojump_threshold=0)
    t0 = world.now

    async def main():
        start = trio.current_time()
        dht = SimDHT(op, lambda: EPOCH + t0 + (trio.current_time() - start), through)
        try:
            out = await fn(dht)
        except Exception as e:  # noqa: BLE001 - the caller decides what a failure means
            out = e
        return out, trio.current_time() - start

    # trio reverses its run queue at random (to shake out ordering bugs): seeded here, so a simulation
    # is a function of its seed (trio's own hook for Hypothesis, a private name of trio 0.2x)
    trio._core._run._r.seed(seed)
    cpu = time.process_time()
    out, virt = trio.run(main, clock=clock)
    return out, virt, time.process_time() - cpu


# ---- the event loop ------------------------------------------------------------------------------------------

@dataclass
class Session:
    sid: int
    client: Endpoint
    start_t: float
    prompt: int
    new_tokens: int
    committed: int = 0
    route: tuple = ()
    records: tuple = ()
    rtt_ms: dict = field(default_factory=dict)  # the client's RTTs measured when routing
    epoch: int = 0  # bumps when the route changes: events of an older route are ignored
    heals: int = 0
    done: bool = False
    waited: bool = False  # waited out the bootstrap outage (no live peer in its client's cache)


@dataclass
class Metrics:
    route_s: list = field(default_factory=list)
    route_parts: list = field(default_factory=list)
    routes: int = 0
    dead_routes: int = 0
    stale_s: list = field(default_factory=list)
    heal_s: list = field(default_factory=list)
    heals_no_spare: int = 0
    sessions_started: int = 0
    sessions_completed: int = 0
    sessions_failed: int = 0
    tokens: int = 0
    token_s: float = 0.0
    capacity_ratio: list = field(default_factory=list)
    capacity_greedy: list = field(default_factory=list)
    uncovered_samples: int = 0
    moves: int = 0
    node_s: float = 0.0
    hops: list = field(default_factory=list)
    route_failures: dict = field(default_factory=dict)
    outage_route_s: list = field(default_factory=list)  # routes during the bootstrap outage (joined via a cache)
    route_s_outside: list = field(default_factory=list)  # the other routes
    outage_waits: int = 0  # sessions of clients without a peer cache that waited out the outage
    heal_parts: list = field(default_factory=list)  # per heal: detection, finding the replacement, refill (s)


class Sim:
    """The discrete-event loop: a heap of (time, seq, callback)."""

    def __init__(self, *, peers: int = 1000, minutes: float = 60.0, seed: int = 0, churn: bool = True,
                 sessions_per_min: float = 20.0, warmup_s: float = 900.0):
        self.w = World(peers=peers, seed=seed, churn=churn)
        self.rng = random.Random(seed + 1)
        self.end_t = minutes * 60.0
        self.warmup_s = warmup_s
        self.sessions_per_min = sessions_per_min
        self.heap: list = []
        self.seq = 0
        self.m = Metrics()
        self.sessions: list[Session] = []
        self.machines: dict[int, Endpoint] = {}
        self.caches: dict[str, list[str]] = {}  # client machine -> its peer cache (PeerIds of DHT servers)
        self.churn = churn
        self.shock_t = 0.4 * self.end_t
        self.w.boot_down = (0.6 * self.end_t, 0.6 * self.end_t + 300.0)
        w = self.w
        w.now = -warmup_s
        for _ in range(peers):  # the initial swarm joins during the warm-up
            p = w.new_peer(self.rng.uniform(-warmup_s, -warmup_s / 3))
            if churn:
                p.death_t = max(p.death_t, 1.0)
            self.at(p.join_t, self.join, p)
        if churn:
            self.at(self.shock_t, self.shock)
        self.at(0.0, self.open_session)
        for t in range(0, int(self.end_t) + 1, 60):
            self.at(float(t), self.sample)

    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def run(self) -> dict:
        wall, cpu = time.perf_counter(), time.process_time()
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            if t > self.end_t and all(s.done for s in self.sessions):
                break
            self.w.now = max(self.w.now, t)
            fn(*args)
        return self.report(time.perf_counter() - wall, time.process_time() - cpu)

    # ---- stages ----------------------------------------------------------------------------------------------
    def join(self, p: Peer) -> None:
        w = self.w
        if w.now >= p.death_t:
            return
        if not w.boot_up():  # open_dht: no bootstrap node answers; the daemon's supervisor retries
            self.at(w.now + 30.0, self.join, p)
            return
        holders = self.holders(w.visible_records(placement=True))
        p.layers = plan_placement(holders, NUM_LAYERS, min(p.fit, NUM_LAYERS))
        # membership.estimate_block_tps: one layer timed before choosing, with the probe's error
        probe = p.tps() * math.exp(self.rng.gauss(0.0, PROBE_ERROR))
        self.announce_joining(p, throughput_tps=round(probe, 3))
        self.at(w.now + self.load_s(p), self.online, p)

    def announce_joining(self, p: Peer, fields: dict | None = None, throughput_tps: float = 0.0) -> None:
        """membership.place's joining record: the chosen block, state joining, ``throughput_tps`` the
        speed its one-layer probe measured before choosing (or a move's ``fields``), valid JOINING_TTL_S, published before the weights load (signed, validated by
        the storing nodes, provided)."""
        w = self.w
        where = {k: v for k, v in self.snapshot(p).items() if k in ("addrs", "relay_addrs")}
        fields = fields or joining_fields(model_id=MODEL_ID, model_name="sim-70b", num_layers=NUM_LAYERS,
                                          layers=p.layers, throughput_tps=throughput_tps, **where)
        rec = Announcer(None, p.key_pair, lambda: fields, interval_s=JOINING_TTL_S / 2, ttl_s=JOINING_TTL_S,
                        clock=lambda: EPOCH + w.now).record()
        p.value = sign_record(p.key_pair, rec)
        p.record = open_record(record_key(p.peer_id), p.value, now=EPOCH + w.now)
        p.holder = None
        w.provide(p)

    def load_s(self, p: Peer) -> float:
        return 30.0 + (p.layers[1] - p.layers[0]) * self.rng.uniform(3.0, 12.0)  # ~1 GB a layer at 100-300 MB/s

    def online(self, p: Peer) -> None:
        w = self.w
        if w.now >= p.death_t:
            p.gone_t = min(p.gone_t, p.death_t)
            return
        p.state = "online"
        if p.announcer is None:
            p.announcer = Announcer(None, p.key_pair, lambda p=p: self.snapshot(p), interval_s=ANNOUNCE_INTERVAL_S,
                                    ttl_s=RECORD_TTL_S, clock=lambda: EPOCH + self.w.now)
        p.gone_t = p.death_t if not p.graceful else math.inf
        self.publish(p)
        self.at(p.death_t, self.depart, p)
        self.at(w.now + self.rng.uniform(0, REBALANCE_S) + REBALANCE_S, self.rebalance, p, p.moves)

    def snapshot(self, p: Peer) -> dict:
        return {"model_id": MODEL_ID, "model_name": "sim-70b", "num_layers": NUM_LAYERS, "layers": p.layers,
                "addrs": (f"/ip4/10.0.0.1/tcp/4001/p2p/{p.peer_id}",) if p.server else (),
                "relay_addrs": () if p.server else (f"/ip4/10.9.9.9/tcp/4001/p2p/relay/p2p-circuit/p2p/{p.peer_id}",),
                "state": "draining" if p.state == "draining" else "online", "sessions": p.sessions,
                "throughput_tps": round(p.tps(), 3)}

    def publish(self, p: Peer, ttl_s: float | None = None, reschedule: bool = True) -> None:
        """Announcer.publish without the network: the product's record, signed, validated by the storing
        nodes (open_record), stored at the bootstrap and k closest nodes, provided."""
        w = self.w
        if not w.alive(p) or p.state in ("gone", "loading"):
            return
        p.announcer.rtt_ms = self.measure_rtts(p)
        rec = p.announcer.record(ttl_s)
        value = sign_record(p.key_pair, rec)
        p.record = open_record(record_key(p.peer_id), value, now=EPOCH + w.now)
        p.value = value
        p.holder = None
        w.provide(p)
        if reschedule:  # Announcer.run: wait interval_s, then measure RTTs (up to interval_s / 2), then publish
            self.at(w.now + ANNOUNCE_INTERVAL_S + self.rng.uniform(1.0, 4.0), self.republish, p, p.record.seq)

    def republish(self, p: Peer, seq: int) -> None:
        if p.record is not None and p.record.seq == seq and p.state == "online":
            self.publish(p)

    def measure_rtts(self, p: Peer) -> dict:
        """Announcer.measure_rtts as a model: up to MAX_RTT_PEERS holders of the layers after its block."""
        from swarm.discovery.announce import MAX_RTT_PEERS

        end = p.layers[1]
        if end >= NUM_LAYERS:
            return {}
        nxt = [q for q in self.nexts.get(end, ()) if q is not p and self.w.alive(q) and q.state == "online"]
        return {q.peer_id: round(self.w.rtt_s(p, q) * 1000, 3) for q in nxt[:MAX_RTT_PEERS]}

    @property
    def nexts(self) -> dict:
        """Layer -> online peers holding it, rebuilt once a simulated minute (a stage's RTT list is a minute old)."""
        stamp = int(self.w.now // 60)
        if getattr(self, "_nexts_at", None) != stamp:
            idx: dict[int, list[Peer]] = {}
            for q in self.w.peers.values():
                if q.state == "online" and self.w.alive(q):
                    for layer in range(q.layers[0], q.layers[1]):
                        idx.setdefault(layer, []).append(q)
            for v in idx.values():
                self.rng.shuffle(v)
            self._nexts_at, self._nexts = stamp, idx
        return self._nexts

    def holders(self, records) -> list[Holder]:
        out = []
        for r in records:
            p = self.w.peers[r.peer_id]
            if p.record is not r or p.holder is None:
                h = disc_client.holders_of([r])[0]
                if p.record is r:
                    p.holder = h
            else:
                h = p.holder
            out.append(h)
        return out

    def rebalance(self, p: Peer, moves: int) -> None:
        """The stage's --rebalance-s check (swarm.stage.membership.announce): should_move over what it reads."""
        w = self.w
        if p.moves != moves or p.state != "online" or not w.alive(p) or w.now >= p.death_t:
            return
        self.at(w.now + REBALANCE_S, self.rebalance, p, moves)
        records = w.visible_records(reader=p, placement=True)
        try:
            target = should_move(self.holders(records), p.peer_id, NUM_LAYERS, p.layers[1] - p.layers[0])
        except Exception:  # noqa: BLE001 - as the stage: log and try at the next check
            self.m.__dict__.setdefault("rebalance_errors", 0)
            self.m.rebalance_errors += 1
            return
        if target is None or tuple(target) == p.layers:
            return
        # a move drains the stage's sessions, then restarts it on the new block
        self.m.moves += 1
        p.moves += 1
        p.state = "draining"
        self.publish(p, ttl_s=LEAVING_TTL_S, reschedule=False)
        self.at(w.now + DRAIN_TIMEOUT_S, self.reload, p, tuple(target))

    def reload(self, p: Peer, target) -> None:
        if not self.w.alive(p) or self.w.now >= p.death_t:
            return
        fields = moved_fields(self.snapshot(p), tuple(target))  # the daemon's last record: Announcer.move
        p.state = "loading"
        p.layers = target
        self.announce_joining(p, fields)
        self.at(self.w.now + self.load_s(p), self.online, p)

    def depart(self, p: Peer) -> None:
        w = self.w
        if p.state == "gone" or w.now < p.death_t:
            return
        if p.graceful and p.state == "online":  # SIGTERM: withdraw, let sessions finish for drain_timeout_s
            p.state = "draining"
            self.publish(p, ttl_s=LEAVING_TTL_S, reschedule=False)
            p.gone_t = w.now + DRAIN_TIMEOUT_S
            self.at(p.gone_t, self.depart, p)
            return
        p.gone_t = min(p.gone_t, w.now)
        p.state = "gone"
        if self.churn:  # another volunteer arrives to keep the swarm near its size
            q = w.new_peer(w.now + self.rng.expovariate(1 / 60.0))
            self.at(q.join_t, self.join, q)

    def shock(self) -> None:
        """A correlated failure: 10% of the live stages vanish at once (a region's ISP, a cloud zone)."""
        w = self.w
        live = [p for p in w.peers.values() if w.alive(p) and p.state != "gone"]
        for p in self.rng.sample(live, len(live) // 10):
            p.graceful, p.death_t = False, w.now
            p.gone_t = w.now
            self.depart(p)

    # ---- clients ---------------------------------------------------------------------------------------------
    def open_session(self) -> None:
        w = self.w
        if w.now > self.end_t:
            return
        self.at(w.now + self.rng.expovariate(self.sessions_per_min / 60.0), self.open_session)
        machine = self.rng.randrange(CLIENT_MACHINES)  # people who ran a client before come back
        if machine not in self.machines:
            self.machines[machine] = Endpoint(f"client-{machine}", w.region(), self.rng.uniform(2, 20))
        s = Session(len(self.sessions), self.machines[machine],
                    w.now, prompt=int(min(2000, math.exp(self.rng.gauss(math.log(300), 0.8)))),
                    new_tokens=int(min(800, 16 + math.exp(self.rng.gauss(math.log(150), 0.8)))))
        self.sessions.append(s)
        self.m.sessions_started += 1
        self.route(s, first=True)

    def join_via_cache(self, client: Endpoint) -> tuple[list[str], float] | None:
        """``open_dht`` while no bootstrap node answers (``dht._join_any``): the bootstrap nodes and
        the servers of the client's peer cache are joined at once; the crashed bootstrap nodes never
        answer, so the round ends ``JOIN_GRACE_S`` after the first cached server answered. Returns
        the cached servers joined by then and the seconds the join took; None when the cache names
        no live server (or there is none: a first run)."""
        w = self.w
        cache = self.caches.get(client.name, [])
        live = [n for n in cache if w.alive(w.peers[n]) and w.peers[n].state != "loading"]
        if not live:
            return None
        jitter = random.Random(self.rng.getrandbits(32))
        dials = {n: w.connect_s(client, w.peers[n], jitter) for n in live}
        end = min(dials.values()) + JOIN_GRACE_S
        return [n for n in live if dials[n] <= end], end

    def route(self, s: Session, first: bool) -> None:
        """A cold route: a client's discover_ring (DHT read, probes, plan_route) in virtual time. During
        the bootstrap outage a client that ran before joins through its peer cache (``open_dht``'s
        known peers), the join's time counted in the route's; one without a cache waits."""
        w = self.w
        through, join_s = None, 0.0
        if not w.boot_up():
            joined = self.join_via_cache(s.client)
            if joined is None:  # open_dht: no bootstrap node answers and no known peer: cannot join yet
                self.m.route_failures["bootstrap down, no live cached peer: open_dht fails"] = \
                    self.m.route_failures.get("bootstrap down, no live cached peer: open_dht fails", 0) + 1
                if not s.waited:
                    s.waited = True
                    self.m.outage_waits += 1
                self.at(w.now + 30.0, self.route, s, first)
                return
            through, join_s = joined

        async def fn(dht):
            out = await disc_client.discover_ring(dht, "sim-70b", MODEL_ID, NUM_LAYERS,
                                                  context_tokens=s.prompt + s.new_tokens)
            met.extend(sorted(n for n in dht.op.connected if n in w.peers and w.peers[n].server))
            holders.extend(dht.holders)
            return out

        met: list[str] = []
        holders: list[str] = []
        out, virt, cpu = run_op(w, s.client, self.rng.getrandbits(32), fn, through=through)
        virt += join_s
        took = virt + cpu
        if met:  # the servers its lookups met, what open_dht writes to the cache on the way out:
            # those that named providers first (``peer_cache_order``), bootstrap nodes left out
            self.caches[s.client.name] = [n for n in peer_cache_order(met, holders) if n in w.peers][:PEER_CACHE_SIZE]
        if not isinstance(out, Exception):
            (self.m.outage_route_s if through is not None else self.m.route_s_outside).append(took)
        if isinstance(out, Exception):
            why = f"{type(out).__name__}: {str(out)[:60]}"
            self.m.route_failures[why] = self.m.route_failures.get(why, 0) + 1
            if w.now - s.start_t > 1800:
                s.done = True
                self.m.sessions_failed += 1
                return
            self.at(w.now + virt + 30.0, self.route, s, first)
            return
        self.m.route_s.append(took)
        self.m.route_parts.append((virt, cpu))
        self.m.routes += 1
        # the timeline runs on virtual time only (deterministic under a seed); the figure adds this CPU
        chosen_t = w.now + virt
        peers = [w.peers[h.peer_id] for h in out.route.hops]
        if any(not w.alive(p, chosen_t) for p in peers):
            self.m.dead_routes += 1
        for r in out.records:  # a record of a stage already gone: how long since it left
            p = w.peers[r.peer_id]
            if not w.alive(p):
                self.m.stale_s.append(w.now - p.gone_t)
        self.m.hops.append(len(peers))
        s.rtt_ms = dict(out.client_rtt_ms)
        self.start_route(s, out.route.hops, out.records, chosen_t)

    def start_route(self, s: Session, hops, records, t: float) -> None:
        w = self.w
        for p in (w.peers[h.peer_id] for h in s.route):
            p.sessions = max(0, p.sessions - 1)
        s.route, s.records = tuple(hops), tuple(records)
        s.epoch += 1
        peers = [w.peers[h.peer_id] for h in s.route]
        for p in peers:
            p.sessions += 1
        # prefill of the prompt (or replay of prompt + committed on a new ring), then decode
        prefill_s = (s.prompt + s.committed) * self.compute_s(s) / PREFILL_GAIN + self.ring_rtt_s(s)
        step_s = self.compute_s(s) + self.ring_rtt_s(s)
        remaining = s.new_tokens - s.committed
        gen_start = t + prefill_s
        end_t = gen_start + remaining * step_s
        # the first hop to stop answering before the end breaks the ring
        broken = min(((p.gone_t, i) for i, p in enumerate(peers) if p.gone_t < end_t), default=None)
        if broken is None:
            self.at(end_t, self.finish, s, s.epoch, remaining, end_t - gen_start)
        else:
            gone_t, i = broken
            done = max(0, min(remaining, int((gone_t - gen_start) / step_s)))
            detect = DETECT_EOF_S if peers[i].graceful else DETECT_CRASH_S
            self.at(max(t, gone_t) + detect, self.heal, s, s.epoch, i, done, max(t, gone_t), done * step_s)

    def compute_s(self, s: Session) -> float:
        w = self.w
        total = 0.0
        for h in s.route:
            p = w.peers[h.peer_id]
            total += (h.layers[1] - h.layers[0]) * p.layer_ms() * (1 + 0.25 * max(0, p.sessions - 1)) / 1000
        return total

    def ring_rtt_s(self, s: Session) -> float:
        w = self.w
        chain = [s.client] + [w.peers[h.peer_id] for h in s.route] + [s.client]
        return sum(w.rtt_s(a, b) / 2 for a, b in zip(chain, chain[1:]))

    def finish(self, s: Session, epoch: int, tokens: int, gen_s: float) -> None:
        if s.epoch != epoch or s.done:
            return
        s.committed = s.new_tokens
        self.m.tokens += tokens
        self.m.token_s += gen_s
        self.release(s)
        s.done = True
        self.m.sessions_completed += 1

    def release(self, s: Session) -> None:
        for h in s.route:
            p = self.w.peers[h.peer_id]
            p.sessions = max(0, p.sessions - 1)
        s.route = ()

    def heal(self, s: Session, epoch: int, index: int, done: int, broke_t: float, gen_s: float) -> None:
        """The coordinator's heal: locate the failure (heal.locate_failure), plan the replay, find a
        replacement (find_replacement over the records read at routing time, else the DHT), refill it."""
        w = self.w
        if s.epoch != epoch or s.done:
            return
        s.committed += done
        self.m.tokens += done
        self.m.token_s += gen_s
        chunk = s.committed
        reports = tuple(StageReport(i, reachable=(i != index), received=chunk, sent=chunk)
                        for i in range(len(s.route)))
        failure = locate_failure(reports, sent=chunk, returned=chunk)
        lost = s.route[failure.index if failure else index]
        plan_replay(list(range(s.prompt)), list(range(s.committed + 1)))
        prev_peer = s.route[index - 1].peer_id if index > 0 else None
        next_peer = s.route[index + 1].peer_id if index + 1 < len(s.route) else None
        exclude = frozenset(h.peer_id for h in s.route)

        async def fn(dht):
            return await disc_client.find_replacement(dht, MODEL_ID, lost.layers, prev_peer=prev_peer,
                                                      next_peer=next_peer, exclude=exclude,
                                                      context_tokens=s.prompt + s.new_tokens, known=s.records,
                                                      known_rtt_ms=s.rtt_ms)

        out, virt, cpu = run_op(w, s.client, self.rng.getrandbits(32), fn)
        s.heals += 1
        if isinstance(out, Exception) or any(not w.alive(w.peers[h.peer_id], w.now + virt) for h in out):
            self.m.heals_no_spare += 1
            self.release(s)
            self.m.heal_s.append(w.now - broke_t + virt + cpu)  # then a full re-route and replay
            if s.heals > 20:
                s.done = True
                self.m.sessions_failed += 1
                return
            self.at(w.now + virt, self.route, s, False)
            return
        hops = s.route[:index] + tuple(out) + s.route[index + 1:]
        refill_s = (s.prompt + s.committed) * sum((h.layers[1] - h.layers[0]) * w.peers[h.peer_id].layer_ms()
                                                  for h in out) / 1000 / PREFILL_GAIN
        repair_s = sum(w.rtt_s(s.client, w.peers[h.peer_id]) for h in out) + refill_s
        t = w.now + virt + repair_s
        self.m.heal_s.append(t - broke_t + cpu)
        self.m.heal_parts.append({"detect_s": _r(w.now - broke_t), "find_s": _r(virt + cpu), "refill_s": _r(repair_s),
                                  "positions": s.prompt + s.committed})
        self.start_route(s, hops, s.records, t)

    # ---- measurements ----------------------------------------------------------------------------------------
    def sample(self) -> None:
        """Once a minute: the swarm's throughput (its weakest layer's summed tok/s) against the best placement
        of the same online peers (an LP bound: every peer's compute spread evenly, C / L), node-time."""
        w = self.w
        online = [p for p in w.peers.values() if p.state == "online" and w.alive(p)]
        self.m.node_s += 60.0 * sum(1 for p in w.peers.values() if w.alive(p) and p.state != "gone"
                                    and p.join_t <= w.now)
        if not online:
            return
        cap = layer_capacity([Holder(p.peer_id, "-", p.layers, throughput_tps=p.tps()) for p in online], NUM_LAYERS)
        bound = sum(1000.0 / p.layer_ms() for p in online) / NUM_LAYERS
        if min(cap) == 0:
            self.m.uncovered_samples += 1
        self.m.capacity_ratio.append(min(cap) / bound)
        self.m.capacity_greedy.append(min(cap) / greedy_capacity(online))

    def report(self, wall_s: float, cpu_s: float) -> dict:
        m = self.m
        node_h = m.node_s / 3600.0
        return {
            "peers": self.w.n_initial, "minutes": self.end_t / 60.0, "churn": self.churn,
            "peers_ever": len(self.w.peers),
            "route_p50_s": _r(pct(m.route_s, 0.5)), "route_p99_s": _r(pct(m.route_s, 0.99)),
            "route_cpu_p50_s": _r(pct([c for _, c in m.route_parts], 0.5)),
            "route_network_p50_s": _r(pct([v for v, _ in m.route_parts], 0.5)),
            "routes": m.routes, "route_hops_mean": _r(sum(m.hops) / len(m.hops)) if m.hops else None,
            "dead_peer_route_fraction": _r(m.dead_routes / m.routes) if m.routes else None,
            "stale_record_max_s": _r(max(m.stale_s, default=0.0)), "record_ttl_s": RECORD_TTL_S,
            "throughput_vs_optimal": _r(sum(m.capacity_ratio) / len(m.capacity_ratio)) if m.capacity_ratio else None,
            "throughput_vs_optimal_min": _r(min(m.capacity_ratio, default=0.0)),
            "throughput_vs_greedy_offline": _r(sum(m.capacity_greedy) / len(m.capacity_greedy))
            if m.capacity_greedy else None,
            "uncovered_minutes": m.uncovered_samples,
            "rebalances": m.moves, "rebalances_per_node_hour": _r(m.moves / node_h) if node_h else None,
            "rebalance_check_errors": getattr(m, "rebalance_errors", 0),
            "sessions_started": m.sessions_started,
            "sessions_completed": _r(m.sessions_completed / m.sessions_started) if m.sessions_started else None,
            "sessions_failed": m.sessions_failed,
            "heals": len(m.heal_s), "heals_rerouted": m.heals_no_spare,
            "heal_p50_s": _r(pct(m.heal_s, 0.5)), "heal_p95_s": _r(pct(m.heal_s, 0.95)),
            "heal_slowest": sorted(m.heal_parts, key=lambda h: -sum(v for k, v in h.items() if k != "positions"))[:3],
            "client_tok_s_mean": _r(m.tokens / m.token_s) if m.token_s else None,
            "route_failures": dict(sorted(m.route_failures.items(), key=lambda kv: -kv[1])[:5]),
            # the bootstrap outage (5 minutes): routes of clients that joined through their peer cache
            # (included in route_p50_s / route_p99_s above), and sessions of clients without one that
            # waited for the bootstrap nodes to come back (their wait is in no route time)
            "route_p99_s_outside_outage": _r(pct(m.route_s_outside, 0.99)),
            "outage_routes": len(m.outage_route_s), "outage_route_p50_s": _r(pct(m.outage_route_s, 0.5)),
            "outage_route_max_s": _r(max(m.outage_route_s, default=None)),
            "outage_waits": m.outage_waits,
            "wall_s": _r(wall_s), "cpu_s": _r(cpu_s),
        }


def greedy_capacity(peers: list[Peer]) -> float:
    """An offline placement of the same peers for reference: fastest first, each into the weakest window
    of its width (a water-filling greedy). Its weakest layer's tok/s."""
    cap = [0.0] * NUM_LAYERS
    for p in sorted(peers, key=lambda q: -q.speed * q.fit):
        wdt = min(p.fit, NUM_LAYERS)
        s = min(range(NUM_LAYERS - wdt + 1), key=lambda i: (min(cap[i:i + wdt]), sum(cap[i:i + wdt])))
        tps = 1000.0 / (p.layer_ms() * wdt)
        for i in range(s, s + wdt):
            cap[i] += tps
    return min(cap)


def _r(x):
    return None if x is None else round(float(x), 4)
