"""The coordinator: tokenize, drive chunks around the ring, heal, stream text, report.

Owns: the generation loop over a connected ``swarm.coordinator.ring.RingClient`` (a ``SpecLoop``: prefill
chunks, then verify chunks), turning a lost or frozen stage into ``swarm.heal.run_recovery`` over
``RingOps`` (swap in a warm spare, reset the session, replay, check the driver token, continue),
and the result record printed by ``--json``. Holds no layers of the target model: only the
tokenizer (and a draft model, if asked). Glue; nothing imports it but the CLI, tests and benches.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, fields

import trio

from swarm import receipts, wire
from swarm.config import CoordinatorConfig, SamplingParams, SpecConfig, cache_root
from swarm.errors import ConfigError, ContextOverflow, HopTimeout, ModelError, StageLost
from swarm.heal import NO_WARM_SPARE, HealEvent, Kept, StageReport, plan_replay, run_recovery
from swarm.coordinator.ring import RingClient
from swarm.coordinator.spec import NoDrafter, SpecLoop
from swarm.coordinator.text import Detokenizer

log = logging.getLogger(__name__)


def eos_ids(model_dir, tokenizer) -> set[int]:
    """The end-of-sequence ids transformers' generate would stop at (generation_config first)."""
    import json
    from pathlib import Path

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.is_file():
            val = json.loads(p.read_text()).get("eos_token_id")
            if val is not None:
                ids.update(val if isinstance(val, list) else [val])
                break
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def vocab_size(model_dir) -> int:
    """The target model's vocabulary size V, from ``model_dir``'s config.json (``vocab_size`` or ``n_vocab``)."""
    import json
    from pathlib import Path

    data = json.loads((Path(model_dir) / "config.json").read_text())
    return int(data.get("vocab_size") or data.get("n_vocab"))


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``, always literal text (control tokens typed into it, such as ``<s>``,
    stay text; the tokenizer adds its own BOS); with ``chat`` the tokenizer's chat template and a
    generation prompt (see ``swarm.coordinator.chat``)."""
    if chat:
        from swarm.coordinator.chat import encode_chat_flag

        return encode_chat_flag(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt, split_special_tokens=True)["input_ids"])  # a typed "<s>" stays text


async def generate(config: CoordinatorConfig, prompt: str, on_text=None, on_ids=None) -> dict:
    """Run one greedy generation around the ring and return the result record.

    Args:
        config: the coordinator config (ring, limits, timeouts).
        prompt: user text; with ``config.chat`` wrapped in the chat template.
        on_text: called with each newly decoded piece of text as tokens are committed.
        on_ids: called with all new ids after each commit (e.g. the demo's stage killer).
    Returns:
        dict with text, prompt_ids, output_ids, new_tokens, tokens_per_s (decode), ttft_s, total_s,
        ring (index, peer_id, addr, layers), model.
    Raises:
        ConfigError, StageLost, HopTimeout, RemoteError, ContextOverflow-like RemoteError.
    """
    from transformers import AutoTokenizer

    from swarm.coordinator.drafters import make_drafter
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest, resolve_model
    from swarm.transport import open_host
    from swarm.transport.identity import claim_key

    if config.bootstrap:  # before converting or downloading the model: does the swarm serve it at all?
        await swarm_may_serve(config.ring.model, config.bootstrap)
    resolved = resolve_model(config.ring.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {resolved.path}: {str(exc).splitlines()[0]}") from exc
    num_layers = model_num_layers(resolved.path)
    digest = model_manifest_digest(resolved.path)
    prompt_ids, conversation = _prompt_ids(config, resolved.name, digest, tokenizer, prompt)
    stop = eos_ids(resolved.path, tokenizer)
    drafter = make_drafter(config.spec.draft, target_vocab=vocab_size(resolved.path), sampling=config.sampling)
    # the default key is anyone's: a second coordinator (or `swarm serve`) running beside takes the next slot
    key, _ = claim_key(config.key_path or cache_root() / "keys" / "coordinator.key", fallback=config.key_path is None)
    job = None
    if config.receipt_dir is not None:  # checked before any work, so a finished job always gets its receipt
        check_receipt_dir(config.receipt_dir)
        job = {"id": uuid.uuid4().hex, "nonce": receipts.new_nonce()}

    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring, route_s = await _ring_client(config, host, nursery, resolved.path, num_layers, len(prompt_ids), digest)
        # a completion continues the prompt's text: decoded after it (a SentencePiece word keeps its space)
        stream = Detokenizer(tokenizer, context=() if config.chat else prompt_ids)
        hooks = [h for h in (on_ids, (lambda ids: on_text(stream.update(ids))) if on_text else None) if h]
        on_ids = (lambda ids: [h(ids) for h in hooks]) if hooks else None
        options = DecodeOptions(config.max_new_tokens, stop, config.spec, drafter, config.sampling, config.wire_dtype,
                                heal=config.heal, job=job, shadow=config.shadow, prefix_cache=config.prefix_cache)
        decoded = await decode(ring, prompt_ids, options, on_ids=on_ids)
        if ring.discovery is not None:  # routed by the swarm: the next route prefers what this session measured
            from swarm.coordinator.measured import note_session

            note_session(ring.discovery[1], [(i.peer_id, tuple(i.layers)) for i in ring.infos], ring.discovery[3],
                         decoded)
        out, timing = decoded.output_ids, decoded.as_record()
        tail = stream.update(out, final=True)
        if on_text:
            on_text(tail)
        infos = ring.infos  # after any heal: the ring that finished the job
        ring_entries = [i.entry() for i in infos]
        parts = timing.pop("receipt_parts", None)
        receipt = None
        if job is not None:  # signed, then offered to auditor-role stages while the host is still up
            receipt = write_job_receipt(config.receipt_dir, key, job, parts, model=resolved.name,
                                        model_digest=digest, num_layers=num_layers, prompt_ids=prompt_ids,
                                        output_ids=out, ring=ring_entries, record=timing)
            await offer_for_audit(host, receipt, ring.discovery, config.ring.spares)
        nursery.cancel_scope.cancel()
    result = {
        "text": stream.text,
        "prompt_ids": prompt_ids,
        "output_ids": out,
        "new_tokens": len(out),
        **timing,
        "ring": ring_entries,
        "model": resolved.name,
    }
    if route_s is not None:
        result["route_s"] = round(route_s, 3)
    if conversation is not None:
        conversation.record(prompt, prompt_ids, out, result["text"])
        result["session_file"] = str(conversation.path)
    if receipt is not None:
        result["receipt"] = receipt
    return result


async def offer_for_audit(host, receipt: dict, discovery, spares=()) -> dict:
    """Offer a verified job receipt (``write_job_receipt``'s result) to the auditor-role stages this
    coordinator knows: the DHT records it routed with (``discovery``: (dht, model id, records, RTTs) or None) and
    the ring file's ``spares`` (``swarm.auditor.offers``; bounded in time, never raises).

    Returns:
        ``{addr: outcome}`` (empty when there is nobody to offer it to, or the receipt did not verify).
    """
    import json
    from pathlib import Path

    from swarm.auditor.offers import auditor_targets, offer_job

    if not receipt.get("verified"):
        return {}
    try:
        doc = json.loads(Path(receipt["path"]).read_text())
    except (OSError, ValueError) as exc:
        log.warning("audit.offer_skipped path=%s error=%s", receipt["path"], exc)
        return {}
    records = [r for r in discovery[2] if r.model_id == discovery[1]] if discovery else []
    targets = auditor_targets(doc, records, spares)
    return await offer_job(host, doc, targets) if targets else {}


def _prompt_ids(config: CoordinatorConfig, model_name: str, digest: str, tokenizer,
                prompt: str) -> tuple[list[int], object]:
    """The prompt's token ids for ``generate``, and the conversation it continues (``--session``) or None.

    Raises:
        ConfigError: the prompt is empty after tokenization (or see ``encode_prompt``, ``Conversation.open``).
    """
    conversation = None
    if config.session_file is not None:
        from swarm.coordinator.conversation import Conversation

        conversation = Conversation.open(config.session_file, model=model_name, model_digest=digest,
                                         chat=config.chat)
        prompt_ids = conversation.prompt_ids(tokenizer, prompt)
    else:
        prompt_ids = encode_prompt(tokenizer, prompt, config.chat)
    if not prompt_ids:
        raise ConfigError("the prompt is empty after tokenization")
    return prompt_ids, conversation


# routes tried when a routed stage cannot be dialed (it died or froze since its record was read)
ROUTE_ATTEMPTS = 3


async def _ring_client(config: CoordinatorConfig, host, nursery, model_path, num_layers: int,
                       prompt_len: int, digest: str) -> tuple[RingClient, float | None]:
    """A connected RingClient over the ring file, or with ``--bootstrap`` over a route read from the
    swarm's records (the DHT client runs in ``nursery``; heals may look there too).

    A routed stage that cannot be dialed (it died, or froze, between the RTT probe that chose it and
    the connect: seen under churn in bench/chaos.py) is excluded and the route chosen again, up to
    ``ROUTE_ATTEMPTS`` routes; a ring file's stage is not (the file names it).

    Returns:
        (the client, seconds the routing took or None without ``--bootstrap``).
    Raises:
        StageLost / HopTimeout: a stage could not be reached (after the last route); ConfigError: no route.
    """
    if not config.bootstrap:
        ring = RingClient(host, config.ring, config.hop_timeout_s, config.connect_timeout_s, config.heartbeat_s)
        await ring.connect(num_layers, digest, nursery)
        return ring, None
    from swarm.addrs import peer_id_from_addr
    from swarm.config import cache_root as _cache_root
    from swarm.discovery.client import discover_ring
    from swarm.weights.identify import model_id as weights_model_id

    from swarm.auditor.exclusions import Exclusions
    from swarm.auditor.judge import Blocks

    model_id = await trio.to_thread.run_sync(weights_model_id, model_path, _cache_root() / "manifests")
    dht = await nursery.start(run_dht, host, config.bootstrap)
    shut_out = Exclusions(Blocks(model_path))  # a fraud proof is re-run on the local weights before it counts
    from swarm.coordinator.measured import load_measured

    measured = load_measured(model_id)  # stage timings of this client's earlier sessions: believed over claims
    unreachable: set[str] = set()
    route_s, attempt = 0.0, 1
    while True:
        found = await discover_ring(dht, config.ring.model, model_id, num_layers, exclude=frozenset(unreachable),
                                    context_tokens=prompt_len + config.max_new_tokens, shut_out=shut_out,
                                    measured_layer_ms=measured)
        route_s += found.seconds
        ring = RingClient(host, found.ring, config.hop_timeout_s, config.connect_timeout_s, config.heartbeat_s,
                          model_id=model_id)
        # heals try these stages (at the RTTs measured now) before reading the DHT
        ring.discovery = (dht, model_id, found.records, found.client_rtt_ms)
        ring.shut_out = shut_out
        try:
            await ring.connect(num_layers, digest, nursery)
            return ring, route_s
        except (StageLost, HopTimeout) as exc:
            failed = found.ring.stages[len(ring.links)]  # connect dials in ring order and stops at the first
            await ring.aclose()
            if attempt == ROUTE_ATTEMPTS:
                raise
            unreachable.add(peer_id_from_addr(failed.addr))
            log.warning("route.retry attempt=%d unreachable=%s reason=%s: routing again without it", attempt,
                        failed.addr, exc)
            attempt += 1


async def swarm_may_serve(model: str, bootstrap: tuple[str, ...]) -> None:
    """Refuse at once a model whose resolving is costly (a conversion, a download) when no stage of the
    swarm announces a model of that name: the exact check (by weights id) needs the converted model,
    and a swarm of other models should not cost the user a minute of converting first.

    Raises:
        StageLost: the swarm has no stage of a model named so (the message lists what it has).
    """
    from libp2p.crypto.ed25519 import create_new_key_pair

    from swarm.discovery.dht import open_dht
    from swarm.model.resolve import costly_name
    from swarm.transport import open_host

    name = await trio.to_thread.run_sync(costly_name, model)
    if name is None:
        return
    # a read-only DHT client whose identity nobody sees: a key of its own, in memory only
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_dht(host, server=False, bootstrap=bootstrap) as dht:
        records = await dht.find_records(None, timeout_s=5.0)
    if any(r.model_name.lower() == name.lower() for r in records):
        return
    has = sorted({f"{r.model_name} ({r.model_id[:12]})" for r in records})
    raise StageLost(f"the swarm (joined through {bootstrap[0]}) has no stage of model {name!r}"
                    + (f"; its stages serve: {', '.join(has)}" if has else "; it has no stages at all")
                    + f". Nothing was converted or downloaded; if the stages announce the same weights under "
                    f"another name, run `swarm model import {model}` once, then this command checks "
                    "by the weights themselves")


async def run_dht(host, bootstrap, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Join the swarm's DHT in client mode and hand the SwarmDHT to ``task_status`` until cancelled."""
    from swarm.discovery.dht import open_dht, peer_cache_path

    # the peer cache lets a client that ran before join while no bootstrap node answers (issue 31)
    async with open_dht(host, server=False, bootstrap=bootstrap, peer_cache=peer_cache_path()) as dht:
        task_status.started(dht)
        await trio.sleep_forever()


def check_receipt_dir(directory) -> None:
    """Make sure receipts can be written to ``directory`` (created if missing), before any work.

    Raises:
        ConfigError: it is not a directory, cannot be created, or is not writable.
    """
    import os
    from pathlib import Path

    if Path(directory).exists() and not Path(directory).is_dir():
        raise ConfigError(f"--receipt-dir {directory} is not a directory")
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the receipt directory {directory}: {exc.strerror}") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"the receipt directory {directory} is not writable (choose another with --receipt-dir)")


def write_job_receipt(receipt_dir, key, job: dict, parts: dict, *, model: str, model_digest: str, num_layers: int,
                      prompt_ids: list[int], output_ids: list[int], ring: list[dict], record: dict) -> dict:
    """Build, sign (coordinator key), save and verify the job receipt.

    Returns:
        ``{"path", "job_id", "verified", "summary" | "reason" and "check"}``; the verification is the same as
        ``swarm receipts verify``.
    Raises:
        ConfigError: the receipt directory cannot be written.
    """
    import os

    from swarm.errors import ReceiptInvalid
    from swarm.transport.identity import peer_id_of, sign

    body = receipts.job_body(job_id=job["id"], nonce=job["nonce"], coordinator=peer_id_of(key), model=model,
                             model_digest=model_digest, num_layers=num_layers, prompt_ids=prompt_ids,
                             output_ids=output_ids, ring=ring, stage_receipts=parts["stage_receipts"],
                             sent=parts["sent"], received=parts["received"], record=record,
                             segments=parts.get("segments"))
    if parts["problems"]:
        body["receipt_problems"] = parts["problems"]
    doc = receipts.sign_receipt(body, lambda data: sign(key, data))
    try:
        path = receipts.save(doc, receipt_dir)
    except OSError as exc:
        raise ConfigError(f"cannot write the receipt to {receipt_dir}: {exc}") from exc
    out = {"path": os.path.abspath(path), "job_id": job["id"]}
    try:
        out.update(verified=True, summary=receipts.verify_job(doc).summary())
    except ReceiptInvalid as exc:
        out.update(verified=False, reason=str(exc), check=getattr(exc, "check", "schema"))
        log.warning("receipt.invalid path=%s reason=%s", path, exc)
    return out


class RingOps:
    """``swarm.heal.SwarmOps`` over a RingClient and the generation's SpecLoop."""

    def __init__(self, ring: RingClient, loop: SpecLoop, state: dict):
        self.ring, self.loop, self.state = ring, loop, state
        self._spares: dict = {}
        self._replaced = ""  # PeerId the last swap replaced
        self._shadow = ""  # name of the picked spare when it is this session's shadow of the lost stage
        self._shadow_note = ""  # why a shadow of the lost stage was not healed onto
        self._refusing: set[str] = set()  # PeerIds a probe found draining without the session: never a spare
        self._windows: dict[str, tuple[int, int]] = {}  # picked re-routed window -> (lost position, positions)
        self._window = 1  # ring positions the last swap replaced

    def now(self) -> float:
        return time.monotonic()

    def range_of(self, index: int) -> tuple[int, int]:
        return self.ring.links[index].info.layers

    @property
    def no_spare(self) -> str:
        """The end of the "is lost" message when ``pick_spare`` found nothing (``heal.run_recovery``)."""
        if self.ring.discovery is not None:
            return "no warm spare or stage announcing on the swarm can take over that range now"
        return NO_WARM_SPARE

    async def probe(self) -> tuple[list[StageReport], int, int]:
        session = self.state["session"]
        reports = await self.ring.net.probe(session, 2 * self.ring.heartbeat_s)
        self._refusing |= {self.peer_of(r.index) for r in reports if r.refusing}
        return reports, self.loop.sent_chunk, self.ring.returned.get(session, -1)

    async def settle(self) -> None:
        await trio.sleep(self.ring.heartbeat_s)

    async def pick_spare(self, layers: tuple[int, int]):
        index = next(i for i, info in enumerate(self.ring.infos) if info.layers == tuple(layers))
        ring, session = self.ring, self.state["session"]
        shadow = ring.repair.shadowed.get(session, {}).pop(tuple(layers), None)
        if shadow is not None:  # the spare that shadowed this stage, if it still answers
            ring.repair.shadows.pop(tuple(layers), None)
            state = await ring.repair.shadow_state(session, shadow, 2 * ring.heartbeat_s)
            if state != "lost":
                name = shadow.info.peer_id
                self._shadow = name if state == "shadow" else ""
                if state == "spare":
                    self._shadow_note = f"the shadow {name} no longer held the session"
                self._spares[name] = [shadow]
                return name
            log.warning("heal.shadow_unusable layers=[%d, %d) peer=%s: looking for another spare", *layers,
                        shadow.info.peer_id)
            self._shadow_note = f"the shadow {shadow.info.peer_id} did not answer"
            await ring.net.drop([shadow])
        link = await self.ring.repair.prepare_spare(index, layers)
        chain = [link] if link is not None else None
        if chain is None and self.ring.discovery is not None:
            chain = await self._spare_from_swarm(index, tuple(layers))
        if not chain:
            return None
        name = "+".join(link.info.peer_id for link in chain)
        self._spares[name] = chain
        return name

    async def pick_wider(self, index: int):
        """``heal.SwarmOps.pick_wider``: the smallest window of ring positions around the lost stage at
        ``index`` whose layers stages from the DHT can take over, the window's surviving stages allowed
        (the lost layers' only other holder may sit in the ring next to it, holding more than its
        position uses: it takes both positions over). Windows are tried from two positions up to the
        whole ring, those starting earlier first. Only for a ring routed over the DHT.

        Returns:
            ``(first, count, name)``: ``name`` (``swap``'s spare) takes over positions ``[first, first +
            count)``; None when no window can be re-routed.
        """
        if self.ring.discovery is None:
            return None
        infos = self.ring.infos
        n = len(infos)
        for count in range(2, n + 1):
            for first in range(max(0, index - count + 1), min(index, n - count) + 1):
                last = first + count - 1
                layers = (infos[first].layers[0], infos[last].layers[1])
                chain = await self._spare_from_swarm(first, layers, last=last, lost=index)
                if chain:
                    name = "+".join(link.info.peer_id for link in chain)
                    self._spares[name] = chain
                    self._windows[name] = (index, count)
                    log.warning("heal.rerouted lost=%d window=[%d, %d) layers=[%d, %d) hops=%s: no stage outside the "
                                "ring holds the lost layers", index, first, first + count, *layers,
                                [(link.info.peer_id[-8:], link.info.layers) for link in chain])
                    return first, count, name
        return None

    async def _spare_from_swarm(self, index: int, layers: tuple[int, int], *, last: int | None = None,
                                lost: int | None = None):
        """Links to the stages from the DHT that take over ``layers`` (of ring positions ``[index, last]``,
        ``last`` = ``index`` by default): usually one holder whose block contains them, else a chain of
        holders tiling them (``swarm.routing.plan_replacement``). Every stage of the ring outside those
        positions and every shadow is excluded, so none runs two positions of one session; a chain
        with a stage that cannot be dialed is dropped whole. None when nothing covers ``layers``. The lost
        stage's own PeerId (the one at ``lost``, = ``index`` by default) is allowed only while nothing is
        committed (a heal at the open or during the prefill, which replays on a fresh session): a volunteer
        who restarted a crashed stage under the same key, on a new address, then serves again; its fresh
        record names that address. The other stages of a window (``pick_wider``) are allowed. A stage a
        probe found draining (it refused the session) is never taken: its record read at routing time may
        still say online."""
        from swarm.config import StageSpec
        from swarm.coordinator.measured import load_measured
        from swarm.discovery.client import find_replacement
        from swarm.ranges import LayerRange
        from swarm.routing import NoRoute

        dht, model_id, *known = self.ring.discovery  # (records, client RTTs) read when routing, if any
        infos = self.ring.infos
        last = index if last is None else last
        lost = index if lost is None else lost
        fresh_session = self.loop.committed_len - 1 < self.loop.prompt_len  # the replay opens a new session
        try:
            hops = await find_replacement(
                dht, model_id, layers, prev_peer=infos[index - 1].peer_id if index > 0 else None,
                next_peer=infos[last + 1].peer_id if last + 1 < len(infos) else None,
                exclude=frozenset(i.peer_id for j, i in enumerate(infos)
                                  if not index <= j <= last or (j == lost and not fresh_session))
                | {s.info.peer_id for s in self.ring.repair.shadows.values()} | self._refusing,
                context_tokens=self.state["max_len"],
                known=known[0] if known else None, known_rtt_ms=known[1] if len(known) > 1 else None,
                shut_out=self.ring.shut_out, measured_layer_ms=load_measured(model_id))
        except NoRoute as exc:
            log.warning("heal.no_replacement layers=[%d, %d) reason=%s", *layers, exc)
            return None
        chain = []
        for hop in hops:
            link = await self.ring.repair.prepare_spare(index + len(chain), hop.layers,
                                                 spec=StageSpec(addr=hop.addr, layers=LayerRange(*hop.layers)))
            if link is None:
                await self.ring.net.drop(chain)
                return None
            chain.append(link)
        if len(chain) > 1:
            log.info("heal.chain layers=[%d, %d) hops=%s", *layers,
                     [(link.info.peer_id[-8:], link.info.layers) for link in chain])
        return chain

    async def swap(self, index: int, spare) -> list[str]:
        lost, self._window = self._windows.pop(spare, (index, 1))
        self._replaced = self.peer_of(lost)
        self._shadow = spare if spare == self._shadow else ""
        old = self.ring.links[index:index + self._window]
        ids = self.ring.repair.swap(index, self._spares.pop(spare), self._window)
        # a re-routed window's surviving stages leave the ring: closing their streams ends this
        # session there (a stage drops the sessions of a stream that closes)
        await self.ring.net.drop([link for link in old if link.info.peer_id != self._replaced])
        return ids

    async def prepare_shadows(self) -> int:
        """Find a warm spare for every ring position that has none shadowing it yet (the ring file's
        spares, then the DHT's holders when the ring was routed there: one stage holding the whole
        range), dial and check it; they are kept in ``ring.repair.shadows`` for the sessions to come.
        Returns how many positions have a shadow."""
        ring = self.ring
        for index, info in enumerate(ring.infos):
            layers = tuple(info.layers)
            if layers in ring.repair.shadows and ring.repair.shadows[layers].generation not in ring.net.lost_gens:
                continue
            before = list(ring.repair.spares)
            link = await ring.repair.prepare_spare(index, layers)
            if link is None:  # a spare that cannot be reached now is tried again at a heal
                ring.repair.spares = before
            if link is None and ring.discovery is not None:
                chain = await self._spare_from_swarm(index, layers)
                if chain and len(chain) > 1:  # a chain cannot shadow one stage: it stays unused
                    await ring.net.drop(chain)
                link = chain[0] if chain and len(chain) == 1 else None
            if link is not None:
                ring.repair.shadows[layers] = link
                log.info("shadow.ready layers=[%d, %d) peer=%s", *layers, link.info.peer_id)
        return sum(tuple(i.layers) in ring.repair.shadows for i in ring.infos)

    def peer_of(self, index: int) -> str:
        return self.ring.links[index].info.peer_id

    async def repair(self, index: int, count: int, replay) -> str | None:
        """Keep the session at the survivors (``RingRepair.repair_session``): the replacement at
        ``[index, index + count)`` rebuilds positions ``[0, len(prefix) - 1)`` alone, the last one
        goes round the ring in :meth:`resume`. Returns None, or why not (logged; a full replay follows)."""
        loop, session = self.loop, self.state["session"]
        if list(replay.prefix) != loop.seq[: len(replay.prefix)] or len(replay.prefix) != loop.committed_len - 1:
            raise ConfigError("internal: the replay plan and the generation state disagree")
        if self._window > 1:
            why = (f"the replacement took over {self._window} ring positions (no stage outside the ring held the lost "
                   "layers): the survivors' caches do not match the new ring")
            log.warning("heal.fallback stage=%d reason=%s: replaying in full on a fresh session", index, why)
            return why
        keep = loop.resume()
        why = await self.ring.repair.repair_session(
            session, index, count, epoch=loop.epoch, keep=keep, tokens=loop.seq[:keep],
            replaced=self._replaced, max_len=self.state["max_len"],
            sampling=self.state["sampling"], wire_dtype=self.state["wire_dtype"], job=self.state["job"],
            shadow=bool(self._shadow))
        if why is not None:
            log.warning("heal.fallback stage=%d reason=%s: replaying in full on a fresh session", index, why)
            return why
        done = self.ring.repair.last_repair
        log.info("heal.kept stage=%d kept_positions=%d mode=%s refilled=%d: survivors keep their KV caches", index,
                 keep, done["mode"], done["refill_tokens"])
        return Kept(done["mode"], done["refill_tokens"], done["shadow_fallback"] or self._shadow_note)

    async def resume(self) -> int | None:
        loop, session = self.loop, self.state["session"]
        while loop.replay_token is None:
            for chunk in loop.next_chunks():
                await self.ring.send_chunk(session, chunk)
            msg = await self.ring.next_result(session)
            loop.on_result(msg["chunk"], msg["epoch"], msg["token_ids"])
        return loop.replay_token

    async def reset(self) -> None:
        with trio.move_on_after(2.0):  # survivors drop the broken session; the lost stage cannot
            await self.ring.close_session(self.state["session"], timeout_s=1.0)
        self.state["session"] = uuid.uuid4().hex
        await self.ring.open_session(self.state["session"], self.state["max_len"], self.state["sampling"],
                                     self.state["wire_dtype"], job=self.state["job"],
                                     prefix_ids=[] if self.state.get("prefix_cache") else None,
                                     prefix_salt=self.state.get("prefix_salt") or "")

    async def replay(self, prefix) -> int | None:
        loop = self.loop
        loop.restart()
        if len(prefix) != loop.prefill_end or list(prefix) != loop.seq[: len(prefix)]:
            raise ConfigError("internal: the replay plan and the generation state disagree")
        if loop.committed_len - 1 < loop.prompt_len:
            return None  # nothing committed yet: the prefill simply runs again
        return await self.resume()


# A lost stream or missed heartbeats is healed; a hop timeout while every stage still answers
# heartbeats means a stage is computing something long (e.g. a huge prefill chunk): fail with
# that message rather than replacing a healthy, busy stage.
HEALABLE = (StageLost,)
OPEN_ATTEMPTS = 2  # opens of a session tried when a stage paused during one (no stage lost)


@dataclass(frozen=True)
class DecodeOptions:
    """How ``decode`` generates: its limits, speculation, sampling, wire dtype, heals, receipts and
    prefix reuse. Validated on construction.

    Attributes:
        max_new_tokens: stop after this many new tokens (>= 0; capped by the ring's context, which
            the result reports as ``context_limited``).
        stop_ids: stop after emitting one of these token ids.
        spec: K, depth, prefill chunk (None: plain decoding, K = 0, depth 1).
        drafter: a ``swarm.coordinator.spec.Drafter`` (None: none).
        sampling: temperature / top-k / top-p / seed (None: greedy). The tail draws the token of
            every position with noise keyed by (seed, position) (``swarm.model.sampling``), and
            drafts are verified by exact match against it: the output is the same for any drafter,
            K and depth, and is an exact sample of the model.
        wire_dtype: dtype of hidden states between stages (None: each stage's own dtype). Narrower
            dtypes (bfloat16, float16, float8_e4m3fn with a scale per position) are lossy: opt-in,
            and recorded as ``wire_lossy`` in the result.
        heal: recover onto spares (default); False fails on the first lost stage.
        job: ``{"id", "nonce"}``: every stage keeps receipt digests for the session, and at the end
            the signed stage receipts are collected (``swarm.receipts``). None: no digests.
        shadow: (with ``heal``) open the session also at a warm spare for each stage that has one,
            as a shadow its predecessor mirrors every forward frame to (the coordinator the head's
            token ids): a heal onto it then refills (almost) nothing (``replay: "shadow"``). Costs
            each spare the compute of its stage and each predecessor one more copy of every frame
            on its uplink; a slow or dead shadow is dropped, never slowing the ring. Default off.
        prefix_cache: offer the prompt to the stages' prefix caches: the prefill starts after the
            leading positions every stage still holds from an earlier session of this coordinator
            (``cached_tokens``), and at the end each stage keeps the KV of prompt + output for the
            next one (a chat's next turn). Same output bits as without (resumed == fresh).
        prefix_salt: with ``prefix_cache``, the scope of this generation's prefix blocks: it is mixed
            into the namespace every stage roots its block keys in, so blocks are reused only by a
            later generation of this coordinator with the same salt ("" is a scope too: the unsalted
            one). ``swarm serve`` puts a request's ``cache_salt`` (or ``user``) here, so neither
            ``cached_tokens`` nor the prefill time tells one client another's prompt.
    Raises:
        ConfigError: ``max_new_tokens`` is negative.
    """

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    spec: SpecConfig | None = None
    drafter: object | None = None
    sampling: SamplingParams | None = None
    wire_dtype: str | None = None
    heal: bool = True
    job: dict | None = None
    shadow: bool = False
    prefix_cache: bool = False
    prefix_salt: str = ""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not isinstance(self.prefix_salt, str):
            raise ConfigError(f"prefix_salt must be a string, got {type(self.prefix_salt).__name__}")
        object.__setattr__(self, "stop_ids", frozenset(self.stop_ids))
        if self.spec is None:
            object.__setattr__(self, "spec", SpecConfig())
        if self.sampling is None:
            object.__setattr__(self, "sampling", SamplingParams())


@dataclass(frozen=True)
class DecodeResult:
    """What ``decode`` produced and how it went.

    Attributes:
        output_ids: the new token ids (committed output; the prompt not included).
        tokens_per_s: decode rate after the first token (None with fewer than two tokens).
        ttft_s: seconds from the start to the first new token (None: stopped before it).
        cached_tokens: leading prompt positions every stage took from its prefix cache.
        total_s: seconds from the start to the last result.
        context_limited: ``max_new_tokens`` was capped by the ring's maximum context.
        stopped: ``should_stop`` ended the generation.
        sampling: the sampling settings as sent on the wire (``SamplingParams.to_wire``).
        wire_dtype: the wire dtype, ``"stage"`` for each stage's own.
        wire_lossy: a stage's hidden states crossed the wire in a narrower dtype than its own.
        kernels_proven: every stage's start-up check proved row-invariant kernels.
        heal_events: ``HealEvent.as_dict()`` of each heal, in order.
        spec: drafter name, k, depth, prefill_chunk and the speculation statistics.
        receipt_parts: with a job: stage_receipts (ring order, None where missing), problems, sent
            and received digests, segments, collect_s; else None.
    """

    output_ids: list[int]
    tokens_per_s: float | None
    ttft_s: float | None
    cached_tokens: int
    total_s: float
    context_limited: bool
    stopped: bool
    sampling: dict
    wire_dtype: str
    wire_lossy: bool
    kernels_proven: bool
    heal_events: list[dict]
    spec: dict
    receipt_parts: dict | None = None

    def as_record(self) -> dict:
        """The result record as a dict, without ``output_ids`` (what ``generate``'s JSON and a job
        receipt's ``record`` carry), ``receipt_parts`` only with a job."""
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("output_ids", "receipt_parts")}
        if self.receipt_parts is not None:
            record["receipt_parts"] = self.receipt_parts
        return record


async def decode(ring: RingClient, prompt_ids: list[int], options: DecodeOptions, *, on_ids=None,
                 should_stop=None, on_open=None, answer_len=None) -> DecodeResult:
    """Generate over a connected ring, speculatively when ``options`` gives a drafter and ``spec.k``.

    Prefill goes round in chunks of ``spec.prefill_chunk`` positions, pipelined across stages;
    decode sends verify chunks ``[last committed] + K drafts`` with up to ``spec.depth`` in flight
    (``swarm.coordinator.spec.SpecLoop``). Output is token-for-token plain greedy (or plain keyed sampling).
    When a stage is lost (its stream ends) or frozen (it stops answering heartbeats), and the ring
    file lists a warm spare for its layers, the ring heals (``swarm.heal.run_recovery``): the spare
    is swapped in, the session reopened, prompt + committed output replayed in prefill chunks, the
    driver token checked, and generation continues; the output equals an uninterrupted run. A stage
    found lost while the session opens (one that died since an earlier session of this client, as in
    ``swarm serve``'s kept clients) is healed the same way, before anything is committed: the session
    is opened afresh on the healed ring and the prefill runs from the start (``cached_tokens`` 0).

    Args:
        ring: a RingClient after ``connect``.
        prompt_ids: the prompt's token ids (non-empty).
        options: limits, speculation, sampling, wire dtype, heals, job, shadows, prefix reuse.
        on_ids: called with the full list of new ids after each commit (for streaming).
        should_stop: called with the new ids after the session opened and after every result (also
            a prefill chunk's, so a long prefill stops within one chunk); True ends the generation
            there (e.g. a stop string appeared, or the client left). ``stopped`` in the result says so.
        on_open: called once the session is open at every stage (the ring admitted it), before
            the prefill (``swarm serve`` sends a streaming response's status only then).
        answer_len: called with the new ids once generation ended: how many leading ids the answer
            holds (e.g. up to the one that completed a stop string). Under speculation the last
            verify chunk may commit ids past it; they are left out of ``output_ids``, the job
            receipt and what the prefix caches keep, as plain decoding would never have made them.
    Returns:
        a DecodeResult (``as_record()`` gives the dict ``--json`` prints).
    Raises:
        ContextOverflow: the prompt does not fit the ring's context (checked before anything is sent;
            a generation that would outgrow it is capped instead, ``context_limited``). StageLost,
            HopTimeout, RemoteError;
        swarm.heal.NoSpare / ReplayMismatch / HealError when a heal is impossible.
    """
    spec, sampling, job = options.spec, options.sampling, options.job
    budget = _context_budget(ring, prompt_ids, options.max_new_tokens)
    loop = SpecLoop(prompt_ids, budget, options.stop_ids, options.drafter or NoDrafter(), k=spec.k, depth=spec.depth,
                    prefill_chunk=spec.prefill_chunk, rotary_switch=ring.rotary_switch)
    state = {"session": uuid.uuid4().hex, "max_len": len(prompt_ids) + budget,
             "sampling": None if sampling.greedy else sampling.to_wire(), "wire_dtype": options.wire_dtype,
             "job": job, "prefix_cache": options.prefix_cache, "prefix_salt": options.prefix_salt}
    ops = RingOps(ring, loop, state)
    shadowed = options.heal and options.shadow and await ops.prepare_shadows() > 0
    heal_events: list[HealEvent] = []

    async def recover(exc: StageLost) -> bool:
        return await _recover(ops, plan_replay(prompt_ids, loop.output), exc, heal_events)

    t0 = time.perf_counter()
    keep = None
    try:  # from the open on: a session opened at only some stages is closed there in the end too
        cached = await _open_session(ring, loop, state, prompt_ids, options, shadowed, recover)
        if on_open is not None:
            on_open()
        t_first, stopped = await _drive(ring, loop, state, options.heal, recover, on_ids, should_stop)
        t_end = time.perf_counter()
        out = loop.output
        if answer_len is not None:
            out = out[:max(0, min(len(out), answer_len(out)))]
        parts = await _receipt_parts(ring, state["session"]) if job is not None else None
        if options.prefix_cache and not loop.rotary_long:  # LongRoPE's long rows fit no shorter prompt
            keep = list(prompt_ids) + list(out)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await ring.close_session(state["session"], keep=keep)
    decode_s = t_end - t_first if t_first is not None else 0.0  # None: stopped before the first token
    return DecodeResult(
        output_ids=out,
        tokens_per_s=(len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        ttft_s=t_first - t0 if t_first is not None else None,
        cached_tokens=cached,
        total_s=t_end - t0,
        context_limited=budget < options.max_new_tokens,
        stopped=stopped,
        sampling=sampling.to_wire(),
        wire_dtype=options.wire_dtype or "stage",
        wire_lossy=any(wire.is_lossy(options.wire_dtype, i.dtype) for i in ring.infos),
        kernels_proven=all(i.rows_proven for i in ring.infos),
        heal_events=[e.as_dict() for e in heal_events],
        spec={"draft": getattr(options.drafter, "name", "none"), "k": spec.k, "depth": spec.depth,
              "prefill_chunk": spec.prefill_chunk, **loop.stats.as_dict()},
        receipt_parts=parts,
    )


def _context_budget(ring: RingClient, prompt_ids: list[int], max_new_tokens: int) -> int:
    """How many new tokens fit the ring's context after the prompt (at most ``max_new_tokens``);
    warns about stages whose kernels are unproven.

    Raises:
        ContextOverflow: the prompt alone does not fit (nothing was sent).
    """
    max_ctx = min(i.max_ctx for i in ring.infos)
    if len(prompt_ids) >= max_ctx:
        raise ContextOverflow(f"the prompt has {len(prompt_ids)} tokens; the ring's maximum context is {max_ctx} "
                              "(nothing was sent)")
    budget = min(max_new_tokens, max_ctx - len(prompt_ids))
    if budget < max_new_tokens:
        # said once: the caller reports context_limited (swarm coordinate prints a note)
        log.info("context.limit prompt_tokens=%d max_ctx=%d new_tokens_capped_at=%d", len(prompt_ids), max_ctx, budget)
    unproven = [i.index for i in ring.infos if not i.rows_proven]
    if unproven:
        log.warning("kernels.unproven stages=%s: their start-up check failed, so speculative or healed output may "
                    "differ from plain greedy in the last bits (see those stages' logs)", unproven)
    return budget


async def _recover(ops: RingOps, replay, exc: StageLost, heal_events: list[HealEvent]) -> bool:
    """Heal after ``exc`` (``run_recovery``) and append the event to ``heal_events``; False when the
    re-check found every stage answering (nothing was replaced)."""
    detected = time.monotonic()
    log.warning("heal.start cause=%s", exc)
    event = await run_recovery(ops, replay, detected, str(exc))
    if event is None:
        return False
    log.warning("heal.done stage=%d layers=[%d, %d) spare=%s replay=%s detect_s=%.2f swap_s=%.2f "
                "replay_tokens=%d survivor_tokens=%d replay_s=%.2f total_s=%.2f%s", event.stage,
                *event.layers, event.spare, event.replay, event.detect_s, event.swap_s,
                event.replay_tokens, event.survivor_tokens, event.replay_s, event.total_s,
                f" fallback={event.fallback}" if event.fallback else "")
    heal_events.append(event)
    return True


async def _open_session(ring: RingClient, loop: SpecLoop, state: dict, prompt_ids: list[int],
                        options: DecodeOptions, shadowed: bool, recover) -> int:
    """Open the generation's session at every stage (healing a stage found lost meanwhile).

    Returns:
        the leading prompt positions taken from the stages' prefix caches (``cached_tokens``).
    """
    for attempt in range(1, OPEN_ATTEMPTS + 1):
        try:
            reused = await ring.open_session(state["session"], state["max_len"], state["sampling"],
                                             options.wire_dtype, job=options.job, shadow=shadowed,
                                             prefix_ids=list(prompt_ids) if options.prefix_cache else None,
                                             prefix_salt=options.prefix_salt)
            cached = min(reused, len(prompt_ids) - 1)
            return loop.skip_prefix(cached)  # 0 for a prompt past LongRoPE's switch
        except HEALABLE as exc:
            # e.g. a stage that died since the last session of a kept client (swarm serve). The open went
            # tail first, so some stages may hold the session: the heal's reset closes it there, opens a
            # fresh one on the healed ring (a replacement holds no prefix: nothing is reused), and the
            # prefill runs from position 0 (nothing committed)
            if not options.heal:
                raise
            if await recover(exc):
                return 0
            if attempt == OPEN_ATTEMPTS:
                log.warning("heal.skipped cause=%s: every stage answers and nothing is stuck, so no stage is "
                            "replaced; the session could not be opened", exc)
                raise
            # a stage paused during the open and answers again (issue 31's chaos soak: a 503): the
            # session is closed where it was opened and opened again under a fresh id
            log.warning("heal.skipped cause=%s: every stage answers again and nothing is stuck; opening the "
                        "session again", exc)
            with trio.move_on_after(2.0):
                await ring.close_session(state["session"], timeout_s=1.0)
            state["session"] = uuid.uuid4().hex
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _drive(ring: RingClient, loop: SpecLoop, state: dict, heal: bool, recover, on_ids,
                 should_stop) -> tuple[float | None, bool]:
    """Send the loop's chunks and commit the tail's results until the loop is done or ``should_stop``
    says so, healing lost stages (with ``heal``).

    Returns:
        (``time.perf_counter()`` of the first new token or None, whether ``should_stop`` ended it).
    """
    t_first = None
    while not loop.done:
        if should_stop is not None and should_stop(loop.output):
            return t_first, True
        try:
            for chunk in loop.next_chunks():
                await ring.send_chunk(state["session"], chunk)
            msg = await ring.next_result(state["session"])
        except HEALABLE as exc:
            if not heal:
                raise
            if not await recover(exc):  # re-checked: every stage answers and moves again (a pause)
                log.warning("heal.skipped cause=%s: every stage answers again and nothing is stuck; no stage "
                            "replaced, generation goes on", exc)
            continue
        epoch = loop.epoch
        new = loop.on_result(msg["chunk"], msg["epoch"], msg["token_ids"])
        if loop.epoch != epoch and not loop.done:
            await ring.cancel(state["session"], loop.epoch)
        if new:
            t_first = t_first or time.perf_counter()
            if on_ids:
                on_ids(loop.output)
    return t_first, False


async def _receipt_parts(ring: RingClient, session: str) -> dict:
    """The stages' signed receipts of ``session`` (the one that finished the job: after a heal, the
    replayed one) and this client's digests of what it sent and received (``write_job_receipt``)."""
    t_collect = time.perf_counter()
    stage_receipts, problems = await ring.collect_receipts(session)
    sent, received = ring.ledgers[session]
    parts = {"stage_receipts": stage_receipts, "problems": problems, "sent": sent.as_dict(),
             "received": received.as_dict(), "segments": list(ring.segments.get(session, [])),
             "collect_s": time.perf_counter() - t_collect}
    for p in problems:
        log.warning("receipt.missing %s", p)
    return parts
