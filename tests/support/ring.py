"""In-process rings for tests: real StageServers on real libp2p hosts (loopback), one trio run."""

from __future__ import annotations

from pathlib import Path

import trio

from swarm.config import RingSpec, StageConfig, StageSpec
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient
from swarm.errors import collapse
from swarm.model.block import load_block
from swarm.model.resolve import model_manifest_digest
from swarm.ranges import LayerRange
from swarm.stage.daemon import serve
from swarm.stage.server import StageServer
from swarm.transport import load_or_create_key, open_host

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


async def start_ring(nursery, model_dir: Path, ranges: list[tuple[int, int]], key_dir: Path,
                     dtype: str = "float64", **stage_kwargs) -> tuple[RingSpec, list[StageServer]]:
    """Start one StageServer per range in ``nursery``; return the ring spec and the servers.
    ``stage_kwargs`` go to every stage's StageConfig (e.g. allow_coordinators)."""
    digest = model_manifest_digest(model_dir)
    specs, servers = [], []
    for a, b in ranges:
        r = LayerRange(a, b)
        block = load_block(model_dir, r, dtype=dtype, device="cpu", quantize=stage_kwargs.get("quantize"))
        server = StageServer(StageConfig.of(model=str(model_dir), layers=r, **stage_kwargs), block, Path(model_dir).name, digest)
        ready = await nursery.start(serve, server, load_or_create_key(key_dir / f"s{a}-{b}.key"), LOOPBACK)
        specs.append(StageSpec(addr=ready["addrs"][0], layers=r))
        servers.append(server)
    return RingSpec(model=str(model_dir), stages=tuple(specs)), servers


async def ring_generate(spec: RingSpec, model_dir: Path, num_layers: int, prompt: list[int], new_tokens: int,
                        key_dir: Path, stop_ids: frozenset = frozenset(), hop_timeout_s: float = 30.0,
                        spec_config=None, drafter=None, info: dict | None = None, batch: bool = False,
                        **decode_kwargs) -> list[int]:
    """Connect a coordinator to ``spec`` and decode (speculatively with a drafter); returns the new ids.
    ``info``, if given, receives the timing and speculation record. ``decode_kwargs``: more
    ``DecodeOptions`` fields (``sampling``, ``job``, ...) or decode's hooks (``on_ids``, ``should_stop``,
    ``on_open``)."""
    try:
        async with open_host(load_or_create_key(key_dir / "coord.key"), [LOOPBACK]) as host, \
                trio.open_nursery() as nursery:
            ring = RingClient(host, spec, hop_timeout_s, 10.0, batch=batch)
            await ring.connect(num_layers, model_manifest_digest(model_dir), nursery)
            hooks = {k: decode_kwargs.pop(k) for k in ("on_ids", "should_stop", "on_open") if k in decode_kwargs}
            options = DecodeOptions(new_tokens, stop_ids=stop_ids, spec=spec_config, drafter=drafter, **decode_kwargs)
            decoded = await decode(ring, prompt, options, **hooks)
            out, record = decoded.output_ids, decoded.as_record()
            if info is not None:
                info.update(record)
                info["ring"] = [i.entry() for i in ring.infos]
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    return out


def greedy_and_speculative(model_dir: Path, ranges, prompt: list[int], new_tokens: int, key_dir: Path,
                           dtype: str = "float64", **stage_kwargs) -> tuple[list[int], list[int]]:
    """On one in-process ring (``stage_kwargs`` go to every stage), greedy ids, then n-gram speculative
    ids (k 3, depth 2) of the same prompt."""
    from swarm.config import SpecConfig
    from swarm.coordinator.drafters import NgramDrafter

    num_layers = ranges[-1][1]

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model_dir, ranges, key_dir, dtype, **stage_kwargs)
                greedy = await ring_generate(spec, model_dir, num_layers, prompt, new_tokens, key_dir)
                speculative = await ring_generate(spec, model_dir, num_layers, prompt, new_tokens, key_dir,
                                                  drafter=NgramDrafter(),
                                                  spec_config=SpecConfig(draft="ngram", k=3, depth=2))
                nursery.cancel_scope.cancel()
        return greedy, speculative

    return trio.run(main)


def run_inprocess(model_dir: Path, ranges, prompt, new_tokens, key_dir: Path, dtype="float64", num_layers=None,
                  stop_ids=frozenset(), spec_config=None, drafter=None, info=None, **decode_kwargs):
    """Start an in-process ring, generate, tear everything down; returns the new ids."""
    num_layers = num_layers or ranges[-1][1]

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model_dir, ranges, key_dir, dtype)
                out = await ring_generate(spec, model_dir, num_layers, prompt, new_tokens, key_dir, stop_ids,
                                          spec_config=spec_config, drafter=drafter, info=info, **decode_kwargs)
                nursery.cancel_scope.cancel()
        return out

    return trio.run(main)


async def signed_job(ring_spec: RingSpec, model_dir: Path, key_dir: Path, prompt: list[int], receipt_dir: Path,
                     new_tokens: int = 6, **decode_kwargs) -> dict:
    """One job with receipts on the running ring ``ring_spec``; returns ``write_job_receipt``'s result plus
    ``doc`` (the signed job receipt) and ``output_ids``. ``decode_kwargs``: more ``DecodeOptions`` fields."""
    import json

    from swarm import receipts
    from swarm.coordinator.jobs import write_job_receipt

    key = load_or_create_key(key_dir / "coord.key")
    num_layers = ring_spec.stages[-1].layers.end
    async with open_host(key, [LOOPBACK]) as host, trio.open_nursery() as inner:
        ring = RingClient(host, ring_spec, 30.0, 10.0)
        digest = model_manifest_digest(model_dir)
        await ring.connect(num_layers, digest, inner)
        job = {"id": receipts.new_nonce()[:32], "nonce": receipts.new_nonce()}
        decoded = await decode(ring, prompt, DecodeOptions(new_tokens, job=job, **decode_kwargs))
        out, rec = decoded.output_ids, decoded.as_record()
        res = write_job_receipt(receipt_dir, key, job, rec.pop("receipt_parts"), model=Path(model_dir).name,
                                model_digest=digest, num_layers=num_layers, prompt_ids=prompt,
                                output_ids=out, ring=[i.entry() for i in ring.infos], record=rec)
        inner.cancel_scope.cancel()
    res["doc"] = json.loads(Path(res["path"]).read_text())
    res["output_ids"] = out
    return res


def job_receipt(model_dir: Path, key_dir: Path, ranges, prompt: list[int], receipt_dir: Path, new_tokens: int = 6,
                **stage_kwargs) -> dict:
    """Run one job with receipts on a fresh in-process ring; return ``write_job_receipt``'s result
    (``path`` of the signed job receipt, ``verified``)."""

    async def main():
        async with trio.open_nursery() as nursery:
            spec, _ = await start_ring(nursery, model_dir, ranges, key_dir, **stage_kwargs)
            res = await signed_job(spec, model_dir, key_dir, prompt, receipt_dir, new_tokens)
            nursery.cancel_scope.cancel()
        return res

    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


async def serve_in_scope(server, key, scope_box, task_status=trio.TASK_STATUS_IGNORED):
    with trio.CancelScope() as scope:
        scope_box.append(scope)
        await serve(server, key, LOOPBACK, task_status=task_status)


async def start_stages(nursery, model_dir: Path, ranges, key_dir: Path, tag: str, block_dtype: str = "float64",
                       **stage_kwargs):
    """One in-process stage per range, each in its own cancel scope (cancelled = the stage is gone), its block
    in ``block_dtype`` (and ``stage_kwargs``' ``quantize``); ``stage_kwargs`` go to every StageConfig."""
    digest = model_manifest_digest(model_dir)
    out = []
    for a, b in ranges:
        r = LayerRange(a, b)
        block = load_block(model_dir, r, dtype=block_dtype, device="cpu", quantize=stage_kwargs.get("quantize"))
        server = StageServer(StageConfig.of(model=str(model_dir), layers=r, **stage_kwargs), block, model_dir.name, digest)
        scopes: list = []
        ready = await nursery.start(serve_in_scope, server, load_or_create_key(key_dir / f"{tag}{a}-{b}.key"), scopes)
        out.append((StageSpec(addr=ready["addrs"][0], layers=r), server, scopes[0]))
    return out


async def start_announced(nursery, model_dir: Path, layers: tuple[int, int], key_path: Path, bootstrap: str,
                          model_id: str, throughput_tps: float, dtype: str = "float32", **config_kw):
    """One in-process stage that announces its signed record on the swarm's DHT (joined through
    ``bootstrap``, in client mode), claiming ``throughput_tps`` (routing prefers the higher), in its
    own cancel scope (cancelled = the stage is gone, its record left to expire). ``config_kw``: more
    StageConfig fields (e.g. ``audit_rate``).

    Returns:
        (READY's payload, the StageServer, its cancel scope).
    """
    from functools import partial

    from swarm.stage.membership import announce

    r = LayerRange(*layers)
    config = StageConfig.of(model=str(model_dir), layers=r, bootstrap=(bootstrap,), dht_client=True, **config_kw)
    block = load_block(model_dir, r, dtype=dtype, device="cpu")
    server = StageServer(config, block, Path(model_dir).name, model_manifest_digest(model_dir))
    server.model_id = model_id
    membership = partial(announce, config=config, model_id=model_id, throughput_tps=throughput_tps, placed=False)
    scopes: list = []

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            scopes.append(scope)
            await serve(server, load_or_create_key(key_path), LOOPBACK, membership=membership, task_status=task_status)

    ready = await nursery.start(run)
    return ready, server, scopes[0]


async def open_bootstrap(stack) -> str:
    """An in-process DHT bootstrap node on loopback (a fresh key), closed with ``stack`` (an
    ``AsyncExitStack``); returns its multiaddr."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from swarm.discovery.dht import open_dht

    host = await stack.enter_async_context(open_host(create_new_key_pair(), [LOOPBACK]))
    await stack.enter_async_context(open_dht(host, server=True))
    return host.addrs()[0]
