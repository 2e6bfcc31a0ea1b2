"""Where a stage's weights come from at start-up: its own cache, then peers, then the hub.

Owns: ``acquire_model`` for ``swarm stage --model M --layers A:B``: a local directory or ``.gguf`` as it is, else
a weights directory fetched earlier (re-verified), else ``--fetch-from`` peers (``swarm``: the DHT's holders),
else the hub for an ``org/name`` id (only the range's shards) or a built-in name converted locally. No torch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from swarm.config import FETCH_FROM_SWARM, StageConfig, cache_root
from swarm.errors import ModelError, WeightsMismatch, collapse

log = logging.getLogger(__name__)


def acquire_model(config: StageConfig, key=None):
    """The checkpoint directory a stage loads its layers from, fetching only what it needs.

    Args:
        config: the stage's config (``model``, ``layers``, ``fetch_from``, ``model_id``, ``bootstrap``).
        key: the stage's libp2p key pair (fetching from peers dials with it); None: a throwaway key.
    Returns:
        a ``swarm.model.resolve.ResolvedModel`` whose path holds config.json, the tokenizer files
        and at least the shards of ``config.model.layers`` (all of them for a local model). Without
        ``config.model.layers`` but with ``--fetch-from``, a weights directory of the peers' manifest,
        config and tokenizer and no shards yet (enough to place the stage and to know its model
        id; the caller asks again with the chosen layers).
    Raises:
        ModelError: no source could supply the weights (one line naming each peer's failure), or
            the weights do not have ``config.weights.model_id``. ConfigError: a bad peer address.
    """
    from swarm.model.resolve import BUILTIN_MODELS, ResolvedModel, is_hub_id, resolve_model
    from swarm.weights.store import find_cached

    spec = config.model.name
    path = Path(spec).expanduser()
    placing = config.model.layers is None
    if path.exists() or path.suffix.lower() == ".gguf" or (placing and not config.weights.fetch_from):
        if config.weights.fetch_from:
            log.info("weights.local model=%s: a local model, --fetch-from is not used", spec)
        return _checked(resolve_model(spec), config)
    builtin = spec.lower() in BUILTIN_MODELS
    hub = not builtin and is_hub_id(spec)
    if not hub and not config.weights.fetch_from:
        return _checked(resolve_model(spec), config)
    name = spec.lower() if builtin else spec
    root = cache_root() / "weights"
    if config.model.layers is None:  # placing itself: the peers' manifest and config first, shards once placed
        return _metadata(config, key, root, name, fallback=hub or builtin)
    need_id = bool(config.membership.bootstrap)  # a stage announcing on the DHT names its model by id
    cached = find_cached(root, name, config.weights.model_id, config.model.layers)
    if cached is not None and not cached.missing and (cached.manifest.model_id or not need_id):
        log.info("weights.cache.hit dir=%s model_id=%s layers=%s", cached.path,
                 (cached.manifest.model_id or "unknown")[:16], config.model.layers)
        return ResolvedModel(cached.path, name=name, source=spec)
    manifest = cached.manifest if cached is not None and cached.manifest.model_id else None
    failures: list[str] = []
    if config.weights.fetch_from:
        result = _fetch_from_peers(config, key, root, name)
        if result.path is not None:
            return ResolvedModel(result.path, name=name, source=spec)
        manifest = result.manifest or manifest
        failures = result.failures
        log.warning("weights.peers.incomplete missing=%s failures=%s; falling back to %s", result.missing,
                    failures, "the hub" if hub else "a local conversion" if builtin else "nothing")
    if hub:
        from swarm.weights.hub import fetch_from_hub

        try:
            dest = fetch_from_hub(spec, config.model.layers, root, name=name, manifest=manifest,
                                  expect_model_id=config.weights.model_id, need_model_id=need_id)
        except WeightsMismatch:
            raise
        except ModelError as e:  # offline or unreachable: a full snapshot downloaded earlier still serves
            try:
                resolved = resolve_model(spec)
            except ModelError:
                raise e from None
            log.warning("weights.hub.fallback reason=%s; using the local snapshot %s", e, resolved.path)
            return _checked(resolved, config, manifest.model_id if manifest is not None else None)
        return ResolvedModel(dest, name=name, source=spec)
    if builtin:
        return _checked(resolve_model(spec), config, manifest.model_id if manifest is not None else None)
    raise ModelError(f"no peer could supply {spec!r} for layers {config.model.layers} "
                     f"({'; '.join(failures) or 'no peer answered'}), and it is neither a hub id nor a built-in "
                     "model to fall back to")


def _metadata(config: StageConfig, key, root: Path, name: str, *, fallback: bool):
    """A stage placing itself with ``--fetch-from``: the peers' manifest, config and tokenizer (no
    shards yet), else the whole model when ``fallback`` (a hub id or a built-in model).

    Raises:
        ModelError: no peer supplied the manifest and there is nothing to fall back to.
    """
    from swarm.model.resolve import ResolvedModel, resolve_model

    spec = config.model.name
    result = _fetch_from_peers(config, key, root, name)
    if result.path is not None:
        log.info("weights.metadata dir=%s model_id=%s (shards follow once the stage is placed)", result.path,
                 result.model_id[:16])
        return ResolvedModel(result.path, name=name, source=spec)
    log.warning("weights.peers.no_metadata failures=%s; falling back to %s", result.failures,
                "the whole model" if fallback else "nothing")
    if fallback:
        return _checked(resolve_model(spec), config)
    why = "; ".join(result.failures) or "no peer answered"
    raise ModelError(f"no peer could supply the manifest of {spec!r} ({why}), and it is neither a hub id nor a "
                     "built-in model to fall back to")


def _checked(resolved, config: StageConfig, peers_id: str | None = None):
    """``resolved``, after checking it has ``config.weights.model_id`` when one is given (another id than the
    peers' only logs a warning: without ``--model-id`` the first peer's id is a claim, not a requirement).

    Raises:
        WeightsMismatch: the local weights do not have ``--model-id``.
    """
    expect = config.weights.model_id or peers_id
    if expect:
        from swarm.weights.identify import model_id

        actual = model_id(resolved.path, cache_root() / "manifests")
        if actual != expect and config.weights.model_id:
            raise WeightsMismatch(f"the weights of {config.model.name!r} at {resolved.path} have model id {actual}, "
                                  f"not --model-id {expect}")
        if actual != expect:
            log.warning("weights.other_id local=%s peers=%s path=%s", actual[:16], expect[:16], resolved.path)
    return resolved


def _fetch_from_peers(config: StageConfig, key, root: Path, name: str):
    """Run ``fetch_weights`` over a short-lived host (the stage's key; loopback listen, dials out)."""
    import trio

    from swarm.transport import open_host
    from swarm.weights.peer import fetch_weights

    if key is None:
        from libp2p.crypto.ed25519 import create_new_key_pair

        key = create_new_key_pair()

    async def main():
        async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host:
            peers = list(config.weights.fetch_from)
            if FETCH_FROM_SWARM in peers:
                i = peers.index(FETCH_FROM_SWARM)
                peers[i:i + 1] = await _holders_from_swarm(host, config, name)
                peers = list(dict.fromkeys(p for p in peers if p != FETCH_FROM_SWARM))
            return await fetch_weights(host, peers, name=name, layers=config.model.layers, root=root,
                                       expect_model_id=config.weights.model_id)

    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


async def _holders_from_swarm(host, config: StageConfig, name: str) -> list[str]:
    """``--fetch-from swarm``: direct addresses of online stages on the DHT that hold the model
    (``--model-id`` if given, else the model name ``name``), those holding more of ``config.model.layers``
    first (without layers, a stage placing itself: those holding the most layers). Relayed stages
    are left out (weights never cross a relay); none found is an empty list (the caller falls back
    to the hub, or says no peer could supply the weights)."""
    from swarm.discovery.dht import open_dht

    lo, hi = (config.model.layers.start, config.model.layers.end) if config.model.layers is not None else (0, 2**31)
    async with open_dht(host, server=False, bootstrap=config.membership.bootstrap) as dht:
        records = await dht.find_records(config.weights.model_id)
    usable = [r for r in records if r.state == "online" and r.addrs
              and (r.model_id == config.weights.model_id if config.weights.model_id else r.model_name == name)]
    usable.sort(key=lambda r: -(min(hi, r.layers[1]) - max(lo, r.layers[0])))
    log.info("weights.swarm_holders model=%s found=%d usable=%d", name, len(records), len(usable))
    return [r.addrs[0] for r in usable]
