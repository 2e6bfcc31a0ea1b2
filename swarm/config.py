"""Role configurations and the ring file. Standard library + PyYAML only.

Owns: ``StageConfig`` (in sections whose fields declare their ``swarm stage`` flags), ``CoordinatorConfig``,
``SpecConfig``, ``SamplingParams`` and ``RingSpec`` (frozen, validated on construction, each built by
``from_args`` from parsed flags), the ring file's reading (its format: docs/commands.md) and ``cache_root``.
"""

from __future__ import annotations

import errno
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from swarm.addrs import peer_id_from_addr
from swarm.errors import CacheUnwritable, ConfigError, IdentityError
from swarm.flags import add_sections, build, option
from swarm.ranges import LayerRange

DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"
# --quantize: int8 / int4 (torch's ops, bfloat16); q8_0 / q4_0 / q4_1 / q4_k / q6_k (llama.cpp's block formats,
# quantized at load) and gguf (the blocks of the GGUF file itself), float32 activations in swarm's kernels
QUANTIZE_SCHEMES = ("int8", "int4", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "gguf")


QUANTIZE_HELP = (
    "hold the decoder layers' Linear weights (and the LM head's) quantized, CPU only, the start-up proof covering "
    "it. gguf: the model's own GGUF blocks as the file stores them (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; give --model the "
    ".gguf file or a built-in name), the decoder layers' and LM head's never expanded (norms and, on the first "
    "stage, the embedding stay float32); q8_0, q4_0, q4_1, q4_k, q6_k: a float checkpoint quantized at load into "
    "those llama.cpp block formats, as llama-quantize writes them (a weight whose inputs are no multiple of 256 "
    "takes q4_1 under q4_k, q8_0 under q6_k). Both run swarm's integer kernels (activations rounded to 16 bits per "
    "block of 32, exact integer dots, float32 sums in a fixed order): the same bits on every CPU. int8 (per output "
    "row) or int4 (groups of 32): torch's own CPU ops in bfloat16, an untied LM head only. A weight a scheme cannot "
    "take stays as loaded")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


def _positive_mib(flag: str, value, zero_ok: bool = False) -> None:
    """ConfigError unless ``value`` is a finite number of MiB (> 0, or >= 0 with ``zero_ok``); also refuses NaN."""
    if not (0 <= value if zero_ok else 0 < value) or not value < 2**40:
        kind = "finite number of MiB >= 0" if zero_ok else "positive, finite number of MiB"
        raise ConfigError(f"{flag} must be a {kind}, got {value}")


def _int_in(flag: str, value, low: int, high: int) -> None:
    """ConfigError unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{flag} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class ModelSection:
    """Which model and layers a stage serves, and how it computes them."""

    name: str = option("", "local HF directory, a .gguf file, smollm2-135m, or a hub id", flag="--model",
                       required=True)
    layers: LayerRange | None = option(
        None, "half-open layer range start:end, e.g. 12:24 (write --layers=-1:2 for a value that starts with '-'); "
              "omit it with --bootstrap to let the stage pick the block the swarm needs most", convert=LayerRange.parse)
    threads: int | None = option(None, "CPU threads for this process's compute (default: torch's, the machine's "
                                       "cores); a stage in the fma kernel mode gives them to swarm's kernels and "
                                       "keeps torch at one")
    dtype: str = option("auto", "the dtype weights and activations are held in (default auto: float32 on a CPU, "
                                "bfloat16 on CUDA, float16 on MPS)", choices=DTYPES)
    device: str = option("auto", "where the layers run (default auto: CUDA, else MPS, else the CPU; a CPU "
                                 "with --quantize)", choices=("auto", "cpu", "cuda", "mps"))
    quantize: str | None = option(None, QUANTIZE_HELP, choices=QUANTIZE_SCHEMES)

    def __post_init__(self) -> None:
        if self.quantize is not None and self.quantize not in QUANTIZE_SCHEMES:
            raise ConfigError(f"--quantize {self.quantize!r} is not one of {', '.join(QUANTIZE_SCHEMES)}")
        if not self.name:
            raise ConfigError("--model is required")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class WeightsSection:
    """Where a stage's weights come from besides a local copy, and the id they must have."""

    fetch_from: tuple[str, ...] = option(
        (), "fetch this stage's shards from the stage at this address (/p2p/ PeerId; repeatable, tried in order; "
            "never a relay; `swarm`: the holders found on the DHT, with --bootstrap), each tensor checked against "
            "the model's manifest; falls back to the hub for a hub id. Weights fetched earlier are re-verified and "
            "used without fetching. Without --layers: the peers' manifest and config first, then the shards of the "
            "block the stage picks", metavar="MULTIADDR|swarm")
    model_id: str | None = option(None, "the model id (sha256 over the weights' manifest) the weights must have; "
                                        "default: the first peer's, whose model name must be --model", metavar="HEX")

    def __post_init__(self) -> None:
        for addr in self.fetch_from:
            if addr != FETCH_FROM_SWARM:
                check_fetch_addr(addr)
        if self.model_id is not None and not re.fullmatch(r"[0-9a-f]{64}", str(self.model_id)):
            raise ConfigError(f"--model-id {self.model_id!r} is not a model id (64 lowercase hex characters, as "
                              "`swarm peers` and the fetch errors print)")


@dataclass(frozen=True)
class NetworkSection:
    """Where a stage listens, who it is, whom it answers, and its metrics endpoint."""

    listen: str = option(DEFAULT_LISTEN, "multiaddr to listen on (default: loopback, any port)")
    key_path: Path | None = option(
        None, "ed25519 identity key file, created 0600 if absent (default: $SWARM_CACHE/keys/stage-START-END.key, "
              "or stage-auto.key without --layers: give each stage on one machine its own)", flag="--key")
    # key_path is a default whose identity nobody relies on (a stage that picks its block): when another
    # running process holds it, take the next free slot (stage-auto-2.key, ...) instead of refusing
    key_fallback: bool = False
    hop_timeout_s: float = option(30.0, "deadline for sending to the successor, seconds (default 30)")
    allow_coordinators: tuple[str, ...] = option(
        (), "only this coordinator PeerId may open sessions (repeatable; default: any). Whatever the list, a session "
            "takes frames only from the peers its signed open assigns", flag="--allow-coordinator", metavar="PEER_ID")
    admins: tuple[str, ...] = option((), "this PeerId may send a drain request (repeatable; default: nobody, "
                                         "SIGTERM only)", flag="--admin", metavar="PEER_ID")
    metrics_listen: str | None = option(
        None, "serve Prometheus metrics on http://HOST:PORT/metrics (sessions, queue, step time, frames and bytes, KV "
              "memory, refusals by reason, heals, receipts, prefix cache); no prompt text or key material in them. "
              "Bind a private address (default: off)", metavar="HOST:PORT")

    def __post_init__(self) -> None:
        if not self.listen.startswith("/ip4/") and not self.listen.startswith("/ip6/"):
            raise ConfigError(f"--listen {self.listen!r} is not an /ip4/ or /ip6/ TCP multiaddr")
        if "/tcp/" not in self.listen:
            raise ConfigError(f"--listen {self.listen!r} must be a TCP multiaddr (e.g. /ip4/127.0.0.1/tcp/0)")
        port = self.listen.split("/tcp/", 1)[1].split("/", 1)[0]
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"--listen {self.listen!r}: the TCP port must be 0..65535")
        if not self.hop_timeout_s > 0:  # also refuses NaN
            raise ConfigError(f"--hop-timeout-s must be a positive number of seconds, got {self.hop_timeout_s}")
        for flag, peers in (("--allow-coordinator", self.allow_coordinators), ("--admin", self.admins)):
            for peer in peers:
                _check_peer_id(flag, peer)
        if self.metrics_listen is not None:
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ConfigError(f"--metrics-listen must be HOST:PORT (e.g. 127.0.0.1:9100; port 0 picks one), "
                                  f"got {self.metrics_listen!r}")


@dataclass(frozen=True)
class AdmissionSection:
    """What a stage admits and keeps: context, KV memory, the heal log, the prefix cache, idle sessions."""

    TITLE = "limits"

    max_ctx: int | None = option(None, "maximum positions per session (default: the model's maximum)")
    kv_budget_mb: float | None = option(
        None, "KV cache memory all sessions together may reserve; a session reserves max_len positions on open and "
              "is refused with a 'busy' error when the budget is full (default: no limit)")
    heal_log_mb: float | None = option(
        None, "MiB of the hidden states it sent on that a session keeps, so a heal that replaces its successor "
              "resends them instead of replaying through every stage; reserved with the KV cache (default: up to "
              "the session's max_len positions; 0: keep none)")
    prefix_cache_mb: float = option(
        512.0, "MiB of finished sessions' KV kept as reusable prefix blocks, so a prompt that starts like an earlier "
               "one of the same coordinator (a chat's next turn, a shared system prompt) skips their prefill; inside "
               "--kv-budget-mb, evicted least recently used before any session is refused (default 512; 0: off)")
    prefix_block: int = option(32, "positions per prefix-cache block; reuse is in whole blocks (default 32)")
    session_ttl_s: float = option(600.0, "drop a session idle this long (default 600)")
    drain_timeout_s: float = option(30.0, "on SIGTERM or a drain request: stop admitting sessions, let open ones "
                                          "finish this long, fail the rest, print SWARM_STAGE_DRAINED and exit 0 "
                                          "(default 30)")

    @property
    def kv_budget_bytes(self) -> int | None:
        """``--kv-budget-mb`` in bytes (None: no limit)."""
        return None if self.kv_budget_mb is None else int(self.kv_budget_mb * 2**20)

    def __post_init__(self) -> None:
        if self.max_ctx is not None and self.max_ctx < 1:
            raise ConfigError(f"--max-ctx must be >= 1 position, got {self.max_ctx}")
        if self.kv_budget_mb is not None:
            _positive_mib("--kv-budget-mb", self.kv_budget_mb)
        if self.heal_log_mb is not None:
            _positive_mib("--heal-log-mb", self.heal_log_mb, zero_ok=True)
        _positive_mib("--prefix-cache-mb", self.prefix_cache_mb, zero_ok=True)
        _int_in("--prefix-block", self.prefix_block, 1, 4096)
        for name, low in (("session_ttl_s", 0.1), ("drain_timeout_s", 0.0)):
            value = getattr(self, name)
            if not low < value < 1e9 and not (low == 0.0 and value == 0.0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds in ({low:g}, 1e9), "
                                  f"got {value}")


@dataclass(frozen=True)
class AuditSection:
    """The rows a stage keeps so others can audit its jobs, and its own auditor role."""

    TITLE = "audits (rows kept for auditors; the auditor role re-runs other stages' work on offered jobs in idle time)"

    audit_retention_mb: float = option(
        256.0, "MiB of recent jobs' input and output rows kept in memory, so an auditor can open any window of a "
               "signed receipt (an 'audit' request); the oldest jobs are evicted first and an audit of an evicted "
               "job is refused (default 256; 0: keep none)")
    audit_retention_dir: Path | None = option(
        None, "spill jobs evicted from --audit-retention-mb to files in DIR (written to a temporary file, then "
              "renamed), read back when an audit opens one, oldest deleted first past --audit-retention-disk-mb; "
              "spill files already in DIR are deleted at start-up, so give each stage its own DIR (default: no "
              "spill, evicted jobs are forgotten)", metavar="DIR")
    audit_retention_disk_mb: float = option(1024.0, "MiB of spill files --audit-retention-dir may hold (default 1024)")
    audit_rate: float = option(
        0.0, "take the auditor role: accept job receipts coordinators offer (audit_offer), and while this stage has "
             "no live session, audit the offered jobs' stages whose layers lie within its own, at rate S (picked by "
             "a hash of the signed job receipt; every session of an identity's first 20); announced in its info and "
             "DHT record. With --bootstrap, fraud proofs go on the DHT (default 0: off, offers are refused)",
        metavar="S")
    audit_tally: Path | None = option(
        None, "with --audit-rate: add the role's audited / passed / failed per stage to this JSON file after each "
              "job (the format of `swarm audit run --tally`)", metavar="FILE")
    audit_queue: int = option(64, "with --audit-rate: offered jobs waiting for idle time; past it the oldest is "
                                  "dropped and counted (default 64)")

    def __post_init__(self) -> None:
        _positive_mib("--audit-retention-mb", self.audit_retention_mb, zero_ok=True)
        _positive_mib("--audit-retention-disk-mb", self.audit_retention_disk_mb, zero_ok=True)
        if self.audit_retention_dir is not None and self.audit_retention_mb <= 0:
            raise ConfigError("--audit-retention-dir needs --audit-retention-mb > 0 (jobs reach the disk when "
                              "evicted from memory)")
        if not 0 <= self.audit_rate <= 1:  # also refuses NaN
            raise ConfigError(f"--audit-rate must be in [0, 1], got {self.audit_rate}")
        _int_in("--audit-queue", self.audit_queue, 1, 4096)
        if self.audit_tally is not None and self.audit_rate <= 0:
            raise ConfigError("--audit-tally needs --audit-rate > 0 (the auditor role writes it)")


@dataclass(frozen=True)
class SchedulingSection:
    """How a stage's scheduler packs sessions' rows into steps (``swarm.stage.scheduler``)."""

    TITLE = "batching (sessions opened to batch, as swarm serve does, share forwards when ready together)"

    max_batch_rows: int = option(64, "most decode/verify rows of different sessions one forward takes (default 64; "
                                     "1: one session per forward)")
    batch_tile: int = option(
        2, "rows per fixed-shape GEMM of packed sessions: more rows share each read of the weights; a session's bits "
           "never depend on what shares its forward. Proven at start-up; a BLAS that fails the proof makes the "
           "stage fall back to 1 and log why (default 2; 1: one GEMV per row, as unbatched sessions always run)")
    prefill_slice_shared: int = option(
        2, "the most positions of a long prompt that ride along in a decoding session's step (default 2; fewer "
           "where a row costs more than half the step); with --no-prefill-piggyback, positions per step while other "
           "sessions decode")
    # while another session's decode row is due, a long chunk's rows only ride along in its steps,
    # sized by measured cost, and wait in between (swarm.stage.scheduler.ride_rows)
    prefill_piggyback: bool = option(
        True, "by default, while another session's decode row is due (within two of its own gaps between rows, at "
              "least 0.25 s), a long prompt is computed only inside that session's steps (Sarathi-Serve's stall-free "
              "batching): its rows ride along within half the step's time and it waits in between; with this flag "
              "the prompt goes --prefill-slice-shared rows a step, alone or not. Either way a slice computed alone "
              "pauses at its next layer for a decode row that arrives", negate="--no-prefill-piggyback")
    prefill_slice: int = option(128, "positions of a long prompt chunk computed per step while no other session has "
                                     "work waiting (default 128)")
    inline_step_ms: float = option(
        30.0, "a step of decode/verify rows only whose recent compute took less than this many ms runs in the "
              "network thread itself, saving the worker-thread round trip (about 0.5 ms a step here); longer steps "
              "(prefill) always run in the worker thread so the node stays responsive (default 30; 0: always the "
              "worker thread)")
    batch_wait_ms: float = option(
        10.0, "while other batching sessions are open but not all ready, wait this long for their rows before a "
              "step, so steps pack more rows (default 10; 0: start at once). A lone session, or one that did not "
              "ask to batch, never waits")

    def __post_init__(self) -> None:
        for flag, value in (("--max-batch-rows", self.max_batch_rows), ("--batch-tile", self.batch_tile),
                            ("--prefill-slice", self.prefill_slice),
                            ("--prefill-slice-shared", self.prefill_slice_shared)):
            _int_in(flag, value, 1, 4096)
        if not 0 <= self.batch_wait_ms <= 1000:  # also refuses NaN
            raise ConfigError(f"--batch-wait-ms must be in [0, 1000], got {self.batch_wait_ms}")
        if not 0 <= self.inline_step_ms <= 1000:
            raise ConfigError(f"--inline-step-ms must be in [0, 1000], got {self.inline_step_ms}")


@dataclass(frozen=True)
class MembershipSection:
    """A stage in a self-organizing swarm: the DHT, its record, reachability, the block it picks."""

    TITLE = "swarm membership (a self-organizing swarm instead of a hand-written ring file)"

    bootstrap: tuple[str, ...] = option(
        (), "join the swarm's DHT through this bootstrap node (repeatable; e.g. the addr `swarm bootstrap` prints) "
            "and announce this stage in a signed record", metavar="MULTIADDR")
    announce_addrs: tuple[str, ...] = option(
        (), "advertise this /ip4/H/tcp/P instead of the bound address (a port forward; repeatable)",
        flag="--announce-addr", metavar="MULTIADDR")
    dht_client: bool = option(False, "read the DHT but do not serve it, without asking (default: a bootstrap node "
                                     "dials this stage back; if it cannot, the stage runs client mode and logs why)")
    relays: tuple[str, ...] = option(
        (), "hold a reservation on this relay (the addr `swarm relay` prints; repeatable), so the stage is reachable "
            "at its circuit address (READY relay_addrs, its record) even behind NAT", flag="--relay",
        metavar="MULTIADDR")
    hole_punch: bool = option(True, "keep relayed connections relayed (default: DCUtR punches a direct connection "
                                    "and the hops move onto it at a frame boundary)", negate="--no-hole-punch")
    fit_layers: int | None = option(None, "without --layers: take this many layers (default: what --mem-budget-mb "
                                          "allows)", flag="--num-layers")
    mem_budget_mb: float | None = option(None, "without --layers: memory for weights + one full-context KV cache "
                                               "(default: half of the free memory)")
    announce_interval_s: float = option(60.0, "republish the record this often (60)")
    record_ttl_s: float = option(120.0, "each published record is valid this long (120)")
    rebalance_s: float = option(300.0, "without --layers: re-check every this many seconds whether another block "
                                       "helps the swarm clearly more, and move there after draining (default 300; "
                                       "0: never)")

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class StageConfig:
    """Everything ``swarm stage`` needs, in sections; each component takes only its own. Validated on
    construction (raises ConfigError naming the flag); ``of`` builds one from flat field names."""

    model: ModelSection
    network: NetworkSection = field(default_factory=NetworkSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    audits: AuditSection = field(default_factory=AuditSection)
    scheduling: SchedulingSection = field(default_factory=SchedulingSection)
    membership: MembershipSection = field(default_factory=MembershipSection)

    def __post_init__(self) -> None:
        if self.model.layers is None and not self.membership.bootstrap:
            raise ConfigError("--layers is required unless --bootstrap lets the stage pick its block from the swarm")
        if FETCH_FROM_SWARM in self.weights.fetch_from and not self.membership.bootstrap:
            raise ConfigError("--fetch-from swarm needs --bootstrap: the holders are found on the swarm's DHT")

    @classmethod
    def of(cls, model: str, layers: LayerRange | None, **flat) -> StageConfig:
        """A StageConfig from flat field names (``StageConfig.of("m", r, threads=1, bootstrap=(...))``).

        Raises:
            ConfigError: a value its section refuses. TypeError: a name no section declares.
        """
        return build(cls, dict(flat, name=model, layers=layers))

    @staticmethod
    def add_cli_args(parser) -> dict:
        """Every section's flags on ``swarm stage``'s parser, an argument group per titled section;
        returns where each section's went, by section name."""
        return add_sections(parser, StageConfig)

    @classmethod
    def from_args(cls, args, **overrides) -> StageConfig:
        """From ``swarm stage``'s parsed flags (``add_cli_args``); ``overrides`` (flat field names) set
        the fields no flag gives, or replace a parsed value. Raises as ``of`` does."""
        return build(cls, overrides, args)


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
        if p.is_dir():
            raise ConfigError(f"ring file {p} is a directory, not a ring file (a YAML file with model and stages)")
        if not p.is_file():
            raise ConfigError(f"ring file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"ring file {p} is not valid YAML: {_yaml_problem(exc)}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"ring file {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                              f"{exc.start})") from None
        except OSError as exc:
            raise ConfigError(f"ring file {p} cannot be read: {exc.strerror}") from exc
        return cls.from_dict(data, origin=str(p))

    def to_dict(self) -> dict:
        def one(s: StageSpec) -> dict:
            return {"addr": s.addr, "layers": f"{s.layers.start}:{s.layers.end}"}

        return {"model": self.model, "stages": [one(s) for s in self.stages], "spares": [one(s) for s in self.spares]}


def _yaml_problem(exc) -> str:
    """PyYAML's error in one line: ``line L, column C: problem (while parsing ... at line L', column C')``,
    1-based as editors count (its own text spans lines and names "<unicode string>")."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, at = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and at is not None:
        where += f" ({context} at line {at.line + 1}, column {at.column + 1})"
    elif context:
        where += f" ({context})"
    return where


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
_NOT_CREATABLE = (errno.ENOENT, errno.ENOTDIR, errno.EEXIST)  # a mkdir in /proc, through a file, onto a file


def cache_fault(exc: BaseException) -> CacheUnwritable | None:
    """The ``CacheUnwritable`` behind ``exc`` when it is (or wraps, in exception groups or as a cause) a
    refused write at, under or above ``cache_root()``, or a failure to create the cache directory itself
    (it is still no directory); else None.

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
        if isinstance(e, OSError) and e.errno in _NOT_WRITABLE + _NOT_CREATABLE and e.filename:
            path = Path(os.fsdecode(e.filename)).absolute()
            above = path == root or path in root.parents
            if e.errno in _NOT_WRITABLE and (above or root in path.parents):
                return CacheUnwritable(path, e.strerror)
            # the root cannot be made: its mkdir failed (a read under it fails below it), or a file stands there
            making_root = above or (e.errno == errno.ENOTDIR and root in path.parents)
            if e.errno in _NOT_CREATABLE and making_root and not root.is_dir():
                return CacheUnwritable(root, e.strerror if path == root else f"{path}: {e.strerror}", create=True)
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        stack.extend((e.__cause__, e.__context__))
    return None
