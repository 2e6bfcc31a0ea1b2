"""Role configurations and the ring file. Standard library + PyYAML only.

Owns: ``StageConfig``, ``CoordinatorConfig``, ``SpecConfig``, ``SamplingParams`` and ``RingSpec``
(frozen, validated on construction; ``from_args`` builds the coordinator's settings from parsed
flags), and reading a ring file::

    model: smollm2-135m            # as for --model
    stages:                        # in ring order; ranges must tile [0, L)
      - {addr: /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW..., layers: "0:10"}
      - {addr: ..., layers: "10:20"}
    spares: []                     # same shape; used by the heal work
"""

from __future__ import annotations

import errno
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from swarm.addrs import peer_id_from_addr
from swarm.errors import CacheUnwritable, ConfigError
from swarm.ranges import LayerRange

DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"
# --quantize: int8 / int4 (torch's ops, bfloat16); q8_0 / q4_0 / q4_1 / q4_k / q6_k (llama.cpp's block formats,
# quantized at load) and gguf (the blocks of the GGUF file itself), float32 activations in swarm's kernels
QUANTIZE_SCHEMES = ("int8", "int4", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "gguf")


@dataclass(frozen=True)
class StageConfig:
    """Everything ``swarm stage`` needs. Validated on construction (raises ConfigError)."""

    model: str
    layers: LayerRange | None  # None: pick a block from the swarm (needs bootstrap)
    listen: str = DEFAULT_LISTEN
    key_path: Path | None = None
    # key_path is a default whose identity nobody relies on (a stage that picks its block): when another
    # running process holds it, take the next free slot (stage-auto-2.key, ...) instead of refusing
    key_fallback: bool = False
    threads: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    quantize: str | None = None  # int8 / int4 (swarm.kernels.quant); q8_0 ... q6_k / gguf (swarm.model.qformats)
    hop_timeout_s: float = 30.0
    allow_coordinators: tuple[str, ...] = ()  # PeerIds that may open sessions; empty: anyone
    admins: tuple[str, ...] = ()  # PeerIds that may send a drain request
    max_ctx: int | None = None  # positions per session; None: the model's maximum
    kv_budget_mb: float | None = None  # KV memory all sessions may reserve; None: no limit
    # hidden states one session keeps of what it sent on, for a heal that replaces its successor
    # (reserved with the KV cache); None: up to max_len positions; 0: none (such heals replay in full)
    heal_log_mb: float | None = None
    # finished sessions' KV kept as reusable prefix blocks (issue 17): at most this many MiB, and within
    # --kv-budget-mb (live sessions always come first); 0: no prefix cache
    prefix_cache_mb: float = 512.0
    prefix_block: int = 32  # positions per prefix block (reuse is in whole blocks)
    # recent jobs' input and output rows kept for audits (swarm.openings), oldest evicted first; 0: none
    audit_retention_mb: float = 256.0
    # ... and evicted from memory to this directory (bounded by audit_retention_disk_mb); None: no spill
    audit_retention_dir: Path | None = None
    audit_retention_disk_mb: float = 1024.0
    # the auditor role (swarm.stage.auditor_role): audit offered jobs' stages at this rate while idle; 0: off
    audit_rate: float = 0.0
    audit_tally: Path | None = None  # add the role's audited / passed / failed to this JSON file
    audit_queue: int = 64  # offered jobs waiting for idle time; past it the oldest is dropped
    session_ttl_s: float = 600.0  # an idle session is dropped after this long
    metrics_listen: str | None = None  # HOST:PORT of the Prometheus /metrics endpoint; None: none
    drain_timeout_s: float = 30.0  # on SIGTERM / drain: how long running sessions may finish
    max_batch_rows: int = 64  # decode/verify rows of different sessions one batched forward takes
    batch_tile: int = 2  # rows per fixed-shape GEMM of packed sessions (1: one GEMV per row; proven at start-up)
    prefill_slice: int = 128  # positions of a long (prefill) chunk computed per scheduling step
    prefill_slice_shared: int = 2  # ... the most that ride along in a decoding session's step
    # while another session's decode row is due, a long chunk's rows only ride along in its steps,
    # sized by measured cost, and wait in between (swarm.stage.scheduler.ride_rows)
    prefill_piggyback: bool = True
    batch_wait_ms: float = 10.0  # how long a step may wait for more batching sessions' rows
    # a step of short chunks only whose recent compute took less than this runs in the trio thread
    # itself (no worker-thread round trip); 0: every step in the worker thread
    inline_step_ms: float = 30.0
    bootstrap: tuple[str, ...] = ()  # multiaddrs of bootstrap nodes: join the swarm's DHT and announce
    announce_addrs: tuple[str, ...] = ()  # addresses to advertise instead of the bound one
    dht_client: bool = False  # not dialable from outside: read the DHT, do not serve it
    relays: tuple[str, ...] = ()  # relay multiaddrs to hold reservations on (reachable through their circuits)
    hole_punch: bool = True  # DCUtR on relayed connections; hops move onto a punched direct connection
    fit_layers: int | None = None  # with layers None: how many layers to take (None: what memory allows)
    mem_budget_mb: float | None = None  # with layers None: memory for weights (None: half of what is free)
    announce_interval_s: float = 60.0  # republish the record this often
    record_ttl_s: float = 120.0  # each record stays valid this long
    rebalance_s: float = 300.0  # with a picked block: re-check placement this often (0: never)
    fetch_from: tuple[str, ...] = ()  # multiaddrs of stages to fetch this stage's weights from, in order
    model_id: str | None = None  # the model id (64 hex) the weights must have; None: the first peer's

    @property
    def kv_budget_bytes(self) -> int | None:
        """``--kv-budget-mb`` in bytes (None: no limit)."""
        return None if self.kv_budget_mb is None else int(self.kv_budget_mb * 2**20)

    def __post_init__(self) -> None:
        if self.quantize is not None and self.quantize not in QUANTIZE_SCHEMES:
            raise ConfigError(f"--quantize {self.quantize!r} is not one of {', '.join(QUANTIZE_SCHEMES)}")
        if not self.model:
            raise ConfigError("--model is required")
        if self.layers is None and not self.bootstrap:
            raise ConfigError("--layers is required unless --bootstrap lets the stage pick its block from the swarm")
        for relay in self.relays:
            if "/p2p/" not in relay or "/p2p-circuit" in relay or not relay.startswith("/"):
                raise ConfigError(f"--relay {relay!r} must be a relay's direct multiaddr ending in /p2p/<PeerId> "
                                  "(the addr `swarm relay` prints)")
        if self.fit_layers is not None and not 1 <= self.fit_layers <= 100_000:
            raise ConfigError(f"--num-layers must be >= 1, got {self.fit_layers}")
        if self.mem_budget_mb is not None and not 0 < self.mem_budget_mb < 2**40:
            raise ConfigError(f"--mem-budget-mb must be a positive number of MiB, got {self.mem_budget_mb}")
        if not 0 < self.announce_interval_s < self.record_ttl_s <= 600:
            raise ConfigError(f"need 0 < --announce-interval-s ({self.announce_interval_s}) < --record-ttl-s "
                              f"({self.record_ttl_s}) <= 600")
        if not 0 <= self.rebalance_s < 1e9:
            raise ConfigError(f"--rebalance-s must be >= 0 seconds, got {self.rebalance_s}")
        for addr in self.fetch_from:
            if addr == FETCH_FROM_SWARM:
                if not self.bootstrap:
                    raise ConfigError("--fetch-from swarm needs --bootstrap: the holders are found on the swarm's DHT")
                continue
            check_fetch_addr(addr)
        if self.model_id is not None and not re.fullmatch(r"[0-9a-f]{64}", str(self.model_id)):
            raise ConfigError(f"--model-id {self.model_id!r} is not a model id (64 lowercase hex characters, as "
                              "`swarm peers` and the fetch errors print)")
        if not self.listen.startswith("/ip4/") and not self.listen.startswith("/ip6/"):
            raise ConfigError(f"--listen {self.listen!r} is not an /ip4/ or /ip6/ TCP multiaddr")
        if "/tcp/" not in self.listen:
            raise ConfigError(f"--listen {self.listen!r} must be a TCP multiaddr (e.g. /ip4/127.0.0.1/tcp/0)")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if not self.hop_timeout_s > 0:  # also refuses NaN
            raise ConfigError(f"--hop-timeout-s must be a positive number of seconds, got {self.hop_timeout_s}")
        for flag, peers in (("--allow-coordinator", self.allow_coordinators), ("--admin", self.admins)):
            for peer in peers:
                _check_peer_id(flag, peer)
        if self.max_ctx is not None and self.max_ctx < 1:
            raise ConfigError(f"--max-ctx must be >= 1 position, got {self.max_ctx}")
        if not 0 <= self.prefix_cache_mb < 2**40:  # also refuses NaN and inf
            raise ConfigError(f"--prefix-cache-mb must be a finite number of MiB >= 0, got {self.prefix_cache_mb}")
        if self.metrics_listen is not None:
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ConfigError(f"--metrics-listen must be HOST:PORT (e.g. 127.0.0.1:9100; port 0 picks one), "
                                  f"got {self.metrics_listen!r}")
        block = self.prefix_block
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 4096:
            raise ConfigError(f"--prefix-block must be an integer in [1, 4096], got {self.prefix_block}")
        if self.kv_budget_mb is not None and not 0 < self.kv_budget_mb < 2**40:  # also refuses NaN and inf
            raise ConfigError(f"--kv-budget-mb must be a positive, finite number of MiB, got {self.kv_budget_mb}")
        if self.heal_log_mb is not None and not 0 <= self.heal_log_mb < 2**40:
            raise ConfigError(f"--heal-log-mb must be a finite number of MiB >= 0, got {self.heal_log_mb}")
        if not 0 <= self.audit_retention_mb < 2**40:  # also refuses NaN and inf
            raise ConfigError(f"--audit-retention-mb must be a finite number of MiB >= 0, got "
                              f"{self.audit_retention_mb}")
        if not 0 <= self.audit_retention_disk_mb < 2**40:
            raise ConfigError(f"--audit-retention-disk-mb must be a finite number of MiB >= 0, got "
                              f"{self.audit_retention_disk_mb}")
        if self.audit_retention_dir is not None and self.audit_retention_mb <= 0:
            raise ConfigError("--audit-retention-dir needs --audit-retention-mb > 0 (jobs reach the disk when "
                              "evicted from memory)")
        if not 0 <= self.audit_rate <= 1:  # also refuses NaN
            raise ConfigError(f"--audit-rate must be in [0, 1], got {self.audit_rate}")
        if isinstance(self.audit_queue, bool) or not isinstance(self.audit_queue, int) or \
                not 1 <= self.audit_queue <= 4096:
            raise ConfigError(f"--audit-queue must be an integer in [1, 4096], got {self.audit_queue!r}")
        if self.audit_tally is not None and self.audit_rate <= 0:
            raise ConfigError("--audit-tally needs --audit-rate > 0 (the auditor role writes it)")
        for flag, value, low in (("--max-batch-rows", self.max_batch_rows, 1), ("--batch-tile", self.batch_tile, 1),
                                 ("--prefill-slice", self.prefill_slice, 1),
                                 ("--prefill-slice-shared", self.prefill_slice_shared, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 4096:
                raise ConfigError(f"{flag} must be an integer in [{low}, 4096], got {value!r}")
        if not 0 <= self.batch_wait_ms <= 1000:  # also refuses NaN
            raise ConfigError(f"--batch-wait-ms must be in [0, 1000], got {self.batch_wait_ms}")
        if not 0 <= self.inline_step_ms <= 1000:
            raise ConfigError(f"--inline-step-ms must be in [0, 1000], got {self.inline_step_ms}")
        for name, low in (("session_ttl_s", 0.1), ("drain_timeout_s", 0.0)):
            value = getattr(self, name)
            if not low < value < 1e9 and not (low == 0.0 and value == 0.0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds in ({low:g}, 1e9), "
                                  f"got {value}")
        port = self.listen.split("/tcp/", 1)[1].split("/", 1)[0]
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"--listen {self.listen!r}: the TCP port must be 0..65535")


FETCH_FROM_SWARM = "swarm"  # --fetch-from swarm: the holders of the model's layers, found on the DHT


def check_fetch_addr(addr: object) -> str:
    """A multiaddr a stage may fetch weights from (``--fetch-from``).

    Raises:
        ConfigError: not a multiaddr ending in ``/p2p/<PeerId>``, or a circuit (relayed) address.
    """
    if not isinstance(addr, str) or not addr.startswith("/") or "/p2p/" not in addr:
        raise ConfigError(f"--fetch-from {addr!r} must be a stage's multiaddr ending in /p2p/<PeerId> "
                          "(as its SWARM_STAGE_READY line prints)")
    if "/p2p-circuit" in addr:
        raise ConfigError(f"--fetch-from {addr}: a circuit (relayed) address; weights are never fetched through "
                          "a relay: give the stage's direct address")
    return addr


def _check_peer_id(flag: str, peer) -> None:
    """A well-formed ed25519 PeerId (base58, the public key inlined), or ConfigError naming ``flag``."""
    from swarm.errors import IdentityError
    from swarm.transport.identity import public_key_of_peer

    try:
        public_key_of_peer(peer if isinstance(peer, str) else "")
    except IdentityError:
        raise ConfigError(f"{flag} {peer!r} is not an ed25519 PeerId (12D3KooW..., as `swarm keygen` prints)") \
            from None


@dataclass(frozen=True)
class StageSpec:
    """One stage as named in a ring file: its multiaddr (with /p2p/PeerId) and claimed layers."""

    addr: str
    layers: LayerRange

    @property
    def peer_id(self) -> str:
        return peer_id_from_addr(self.addr)


@dataclass(frozen=True)
class RingSpec:
    """A parsed ring file (see the module docstring)."""

    model: str
    stages: tuple[StageSpec, ...]
    spares: tuple[StageSpec, ...] = ()

    @classmethod
    def from_dict(cls, data: object, origin: str = "ring file") -> RingSpec:
        """Build from the YAML mapping. Raises ConfigError naming the bad entry."""
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: expected a mapping with 'model' and 'stages'")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{origin}: 'model' must name a model (a directory, a .gguf file or smollm2-135m)")
        stages = _stage_list(data.get("stages"), "stages", origin, required=True)
        spares = _stage_list(data.get("spares") or [], "spares", origin, required=False)
        return cls(model=model, stages=tuple(stages), spares=tuple(spares))

    @classmethod
    def load(cls, path: str | os.PathLike) -> RingSpec:
        """Read a ring YAML file. Raises ConfigError if missing or malformed."""
        import yaml

        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"ring file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"ring file {p} is not valid YAML: {exc}") from exc
        return cls.from_dict(data, origin=str(p))

    def to_dict(self) -> dict:
        def one(s: StageSpec) -> dict:
            return {"addr": s.addr, "layers": f"{s.layers.start}:{s.layers.end}"}

        return {"model": self.model, "stages": [one(s) for s in self.stages], "spares": [one(s) for s in self.spares]}


def _stage_list(raw: object, key: str, origin: str, required: bool) -> list[StageSpec]:
    if not isinstance(raw, list) or (required and not raw):
        raise ConfigError(f"{origin}: '{key}' must be a non-empty list of {{addr, layers}}" if required
                          else f"{origin}: '{key}' must be a list")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or "addr" not in entry or "layers" not in entry:
            raise ConfigError(f"{origin}: {key}[{i}] must have 'addr' and 'layers'")
        if not isinstance(entry["layers"], str):
            raise ConfigError(f"{origin}: {key}[{i}] layers must be a quoted string like \"10:20\" "
                              f"(got {entry['layers']!r}; YAML reads an unquoted 10:20 as a number)")
        addr = str(entry["addr"])
        if "/p2p/" not in addr or not addr.startswith("/"):
            raise ConfigError(f"{origin}: {key}[{i}] addr {addr!r} must be a multiaddr ending in /p2p/<PeerId>")
        out.append(StageSpec(addr=addr, layers=LayerRange.parse(entry["layers"])))
    return out


def from_flags(cls, args):
    """Build the frozen config dataclass ``cls`` from parsed command-line flags, one flag per field.

    Each field ``name`` takes ``args.name`` (``--top-k`` parses to ``args.top_k``); the class checks
    the values on construction.

    Args:
        cls: a dataclass whose every field has a flag of the same name (e.g. ``SpecConfig``).
        args: an ``argparse.Namespace`` (or any object with those attributes).
    Returns:
        ``cls(**{field: getattr(args, field)})``.
    Raises:
        ConfigError: a value out of range (raised by ``cls``).
        AttributeError: ``args`` lacks a field's flag.
    """
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class SpecConfig:
    """Speculation and chunking settings of the coordinator (``--draft``, ``--k``, ``--depth``,
    ``--prefill-chunk``). ``k=None`` means 4 with a drafter and 0 without. Validated on construction."""

    draft: str = "none"
    k: int | None = None
    depth: int = 1
    prefill_chunk: int = 128

    def __post_init__(self) -> None:
        if self.k is None:
            object.__setattr__(self, "k", 0 if self.draft == "none" else 4)
        if not (self.draft in ("none", "ngram") or (self.draft.startswith("model:") and len(self.draft) > 6)):
            raise ConfigError(f"--draft {self.draft!r} is not one of none, ngram, model:PATH")
        if not 0 <= self.k <= 64:
            raise ConfigError(f"--k must be in 0..64, got {self.k}")
        if not 1 <= self.depth <= 16:
            raise ConfigError(f"--depth must be in 1..16, got {self.depth}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")

    from_args = classmethod(from_flags)  # --draft, --k, --depth, --prefill-chunk


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; ``temperature == 0`` means greedy (argmax, no noise).

    Args:
        temperature: > 0 divides the logits; 0 = greedy.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = off).
        seed: the key of every draw (with the absolute position).
    Raises:
        ConfigError: on out-of-range values.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < 1e-4:  # logits / T would overflow; that close to 0 is greedy
            raise ConfigError(f"--temperature {self.temperature} is too small: use 0 for greedy, or >= 1e-4")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"--seed must be in [0, 2^63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_wire(self) -> dict:
        return {"temperature": float(self.temperature), "top_k": int(self.top_k), "top_p": float(self.top_p),
                "seed": int(self.seed)}

    @classmethod
    def from_wire(cls, m: object) -> SamplingParams:
        """Build from an ``open`` frame's ``sampling`` map. Raises ConfigError on bad fields."""
        if not isinstance(m, dict):
            raise ConfigError("sampling must be a map")
        try:
            return cls(temperature=float(m["temperature"]), top_k=int(m["top_k"]), top_p=float(m["top_p"]),
                       seed=int(m["seed"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"bad sampling map: {exc}") from exc

    from_args = classmethod(from_flags)  # --temperature, --top-k, --top-p, --seed


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything ``swarm coordinate`` needs besides the prompt."""

    ring: RingSpec
    max_new_tokens: int = 64
    chat: bool = False
    key_path: Path | None = None
    hop_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    wire_dtype: str | None = None
    heartbeat_s: float = 1.0
    heal: bool = True
    # open each session also at a warm spare per stage, as a shadow its predecessor mirrors to (a heal
    # onto it refills almost nothing); costs the spares' CPU and one more copy of every frame on each
    # predecessor's uplink, so off by default
    shadow: bool = False
    receipt_dir: Path | None = Path("receipts")  # where job receipts go; None: no receipts, no digests
    bootstrap: tuple[str, ...] = ()  # route through the swarm's DHT instead of the ring file's stages
    prefix_cache: bool = True  # offer prompts to the stages' prefix caches (same output bits either way)
    session_file: Path | None = None  # a conversation continued across invocations (swarm.coordinator.conversation)

    def __post_init__(self) -> None:
        if not self.ring.stages and not self.bootstrap:
            raise ConfigError("name the stages with --ring FILE, or --model and --bootstrap ADDR to route through "
                              "the swarm")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("hop_timeout_s", "connect_timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
        wire_dtypes = ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn")
        if self.wire_dtype is not None and self.wire_dtype not in wire_dtypes:
            raise ConfigError(f"--wire-dtype {self.wire_dtype!r} is not one of {', '.join(wire_dtypes)}")


def cache_root() -> Path:
    """``$SWARM_CACHE`` or ``~/.cache/swarm``."""
    env = os.environ.get("SWARM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swarm"


_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def cache_fault(exc: BaseException) -> CacheUnwritable | None:
    """The ``CacheUnwritable`` behind ``exc`` when it is (or wraps, in exception groups or as a cause) a
    refused write at, under or above ``cache_root()``; else None.

    Every writer under the cache (keys, converted models, manifests, kernels, proofs, fetched weights)
    thus fails with one line naming the path and SWARM_CACHE, however deep the write was.
    """
    seen: set[int] = set()
    stack = [exc]
    root = cache_root().absolute()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CacheUnwritable):
            return e
        if isinstance(e, OSError) and e.errno in _NOT_WRITABLE and e.filename:
            path = Path(os.fsdecode(e.filename)).absolute()
            if path == root or root in path.parents or path in root.parents:
                return CacheUnwritable(path, e.strerror)
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        stack.extend((e.__cause__, e.__context__))
    return None
