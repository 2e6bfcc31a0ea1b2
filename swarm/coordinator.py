"""The coordinator: tokenize, drive chunks around the ring, stream text, report.

Owns: connecting to every stage of a ring file, checking the ring (each stage reports the layer
range and model it claims; the ranges tile ``[0, L)``), opening a session, the greedy decode loop
(prefill, then one token per round trip), and the result record printed by ``--json``. Holds no
layers of the target model: only the tokenizer. Glue; nothing imports it but the CLI.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import trio

from swarm import wire
from swarm.config import CoordinatorConfig, RingSpec, SamplingParams, SpecConfig, cache_root
from swarm.errors import (ConfigError, HopTimeout, ModelError, ProtocolError, RemoteError, StageLost, StreamClosed,
                          SwarmError)
from swarm.ranges import check_tiling
from swarm.spec import NoDrafter, SpecLoop
from swarm.wire import PROTOCOL_ID

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageInfo:
    """What a stage reported about itself, next to what the ring file claimed."""

    index: int
    addr: str
    peer_id: str
    layers: tuple[int, int]
    model: str
    model_digest: str
    max_ctx: int
    dtype: str = "float32"


class RingClient:
    """Streams from the coordinator to every stage of a ring, and the frames they send back.

    Every stage may send on its stream (replies, errors); the tail also sends ``result`` frames.
    One reader task per stream funnels ``(stage_index, frame)`` into a single channel.
    """

    def __init__(self, host, ring: RingSpec, hop_timeout_s: float, connect_timeout_s: float):
        self.host = host
        self.ring = ring
        self.hop_timeout_s = hop_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.streams: list = []  # data: forward frames, session replies, the tail's results
        self.control: list = []  # one more stream per stage, for cancel frames
        self.infos: list[StageInfo] = []
        self._send_ch, self._recv_ch = trio.open_memory_channel(1024)

    async def connect(self, num_layers: int, model_digest: str, nursery) -> list[StageInfo]:
        """Dial every stage, ask for its info, and check the ring.

        Raises:
            StageLost / HopTimeout: a stage is unreachable (names its addr).
            ConfigError: a stage serves other layers or another model, or the ranges do not tile.
        """
        check_tiling([s.layers for s in self.ring.stages], num_layers)
        for i, spec in enumerate(self.ring.stages):
            try:
                stream = await self.host.open_stream(spec.addr, PROTOCOL_ID, timeout_s=self.connect_timeout_s)
            except ProtocolError as exc:
                raise StageLost(f"stage {i} {spec.layers} at {spec.addr} is not a swarm stage: {exc}") from exc
            except SwarmError as exc:
                raise StageLost(f"stage {i} {spec.layers} is unreachable: {exc}") from exc
            self.streams.append(stream)
            nursery.start_soon(self._pump, i, stream)
            control = await self.host.open_stream(spec.addr, PROTOCOL_ID, timeout_s=self.connect_timeout_s)
            self.control.append(control)
            nursery.start_soon(self._pump, i, control)
        for i, spec in enumerate(self.ring.stages):
            # one request in flight at a time: _expect skips frames that answer something else
            await self.streams[i].send(wire.frame("info"), timeout_s=self.hop_timeout_s)
            msg = await self._expect(i, "info_ok")
            got = tuple(msg["layers"])
            if got != (spec.layers.start, spec.layers.end):
                raise ConfigError(f"stage {i} at {spec.addr} serves layers [{got[0]}, {got[1]}) but the ring file "
                                  f"says {spec.layers}")
            if msg["num_layers"] != num_layers or msg["model_digest"] != model_digest:
                raise ConfigError(f"stage {i} at {spec.addr} serves model {msg['model']!r} "
                                  f"({msg['num_layers']} layers, digest {msg['model_digest'][:12]}) but the ring file "
                                  f"names {self.ring.model!r} ({num_layers} layers, digest {model_digest[:12]})")
            if msg["peer_id"] != spec.peer_id:
                raise ConfigError(f"stage {i} at {spec.addr} answered as PeerId {msg['peer_id']}")
            self.infos.append(StageInfo(i, spec.addr, msg["peer_id"], got, msg["model"], msg["model_digest"],
                                        msg["max_ctx"], msg["dtype"]))
        return self.infos

    async def _pump(self, index: int, stream) -> None:
        while True:
            try:
                msg = await stream.recv()
            except (StreamClosed, ProtocolError) as exc:
                await self._send_ch.send((index, {"type": "_lost", "reason": str(exc)}))
                return
            await self._send_ch.send((index, msg))

    async def _next(self, timeout_s: float) -> tuple[int, dict]:
        try:
            with trio.fail_after(timeout_s):
                return await self._recv_ch.receive()
        except trio.TooSlowError:
            raise HopTimeout(f"no answer from the ring within {timeout_s:.1f} s") from None

    def _raise_for(self, index: int, msg: dict, session: str | None = None) -> None:
        spec = self.ring.stages[index]
        if msg.get("type") == "_lost":
            raise StageLost(f"stage {index} {spec.layers} at {spec.addr} closed the connection: {msg['reason']}")
        if msg.get("type") == "error" and msg.get("session") not in (None, session):
            log.debug("error.ignored stage=%d session=%s (an earlier session)", index, msg.get("session"))
            return
        if msg.get("type") == "error":
            raise RemoteError(f"stage {index} {spec.layers} refused: {msg.get('reason')}")

    async def _expect(self, index: int, kind: str, session: str | None = None) -> dict:
        while True:
            i, msg = await self._next(self.hop_timeout_s)
            self._raise_for(i, msg, session)
            if i == index and msg.get("type") == kind and (session is None or msg.get("session") == session):
                return wire.validate(msg)
            log.debug("frame.ignored stage=%d type=%s", i, msg.get("type"))

    async def open_session(self, session: str, max_len: int, sampling: dict | None = None,
                           wire_dtype: str | None = None) -> None:
        """Open ``session`` at every stage, telling each its successor (the tail gets none and,
        when sampling, the sampling settings)."""
        n = len(self.ring.stages)
        for i in reversed(range(n)):  # tail first, so each successor exists before it is dialed
            nxt = self.ring.stages[i + 1].addr if i + 1 < n else None
            extra = {"sampling": sampling} if sampling and nxt is None else {}
            if wire_dtype and nxt is not None:
                extra["wire_dtype"] = wire_dtype
            await self.streams[i].send(wire.frame("open", session=session, next=nxt, max_len=max_len, **extra))
            await self._expect(i, "open_ok", session)

    async def close_session(self, session: str) -> None:
        for i, stream in enumerate(self.streams):
            try:
                await stream.send(wire.frame("close", session=session), timeout_s=5.0)
            except SwarmError:
                pass

    async def send_chunk(self, session: str, chunk) -> None:
        """Send one chunk (``swarm.spec.Chunk``) to the head stage; do not wait for its result."""
        await self.streams[0].send(wire.frame("forward", session=session, epoch=chunk.epoch, pos=chunk.pos,
                                              chunk=chunk.chunk_id, tokens=list(chunk.tokens)),
                                   timeout_s=self.hop_timeout_s)

    async def next_result(self, session: str) -> dict:
        """The next ``result`` frame of ``session`` from the tail (any epoch), validated.

        Raises:
            HopTimeout: nothing within the hop timeout. StageLost: a stage closed its stream.
            RemoteError: a stage answered with an error frame.
        """
        tail = len(self.streams) - 1
        while True:
            i, msg = await self._next(self.hop_timeout_s)
            self._raise_for(i, msg, session)
            if i == tail and msg.get("type") == "result" and msg.get("session") == session:
                return wire.validate(msg)

    async def cancel(self, session: str, epoch: int) -> None:
        """Tell every stage that frames of ``session`` older than ``epoch`` are stale (early
        cancellation: stages drop them before computing). Sent on the control streams so it
        overtakes the data frames queued behind the head's data stream."""
        for stream in self.control:
            try:
                await stream.send(wire.frame("cancel", session=session, epoch=epoch), timeout_s=self.hop_timeout_s)
            except SwarmError as exc:  # the data path will report a lost stage itself
                log.debug("cancel.failed reason=%s", exc)


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


def _vocab_size(model_dir) -> int:
    import json
    from pathlib import Path

    data = json.loads((Path(model_dir) / "config.json").read_text())
    return int(data.get("vocab_size") or data.get("n_vocab"))


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``; with ``chat`` the tokenizer's chat template and a generation prompt."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--chat was given but this model's tokenizer has no chat template")
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)
    return list(tokenizer(prompt)["input_ids"])


class TextStream:
    """Incremental detokenizer: ``push(ids)`` returns the newly printable text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.printed = 0

    def push(self, ids: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            return ""
        new, self.printed = text[self.printed:], len(text)
        return new


async def generate(config: CoordinatorConfig, prompt: str, on_text=None) -> dict:
    """Run one greedy generation around the ring and return the result record.

    Args:
        config: the coordinator config (ring, limits, timeouts).
        prompt: user text; with ``config.chat`` wrapped in the chat template.
        on_text: called with each newly decoded piece of text as tokens are committed.
    Returns:
        dict with text, prompt_ids, output_ids, new_tokens, tokens_per_s (decode), ttft_s, total_s,
        ring (index, peer_id, addr, layers), model.
    Raises:
        ConfigError, StageLost, HopTimeout, RemoteError, ContextOverflow-like RemoteError.
    """
    from transformers import AutoTokenizer

    from swarm.drafters import make_drafter
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest, resolve_model
    from swarm.transport import load_or_create_key, open_host

    resolved = resolve_model(config.ring.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {resolved.path}: {str(exc).splitlines()[0]}") from exc
    num_layers = model_num_layers(resolved.path)
    digest = model_manifest_digest(resolved.path)
    prompt_ids = encode_prompt(tokenizer, prompt, config.chat)
    if not prompt_ids:
        raise ConfigError("the prompt is empty after tokenization")
    stop = eos_ids(resolved.path, tokenizer)
    drafter = make_drafter(config.spec.draft, target_vocab=_vocab_size(resolved.path), sampling=config.sampling)
    key = load_or_create_key(config.key_path or cache_root() / "keys" / "coordinator.key")

    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, config.ring, config.hop_timeout_s, config.connect_timeout_s)
        infos = await ring.connect(num_layers, digest, nursery)
        stream = TextStream(tokenizer)
        on_ids = (lambda ids: on_text(stream.push(ids))) if on_text else None
        out, timing = await decode(ring, prompt_ids, config.max_new_tokens, stop, on_ids, config.spec, drafter,
                                   config.sampling, config.wire_dtype)
        if on_text:
            on_text(stream.push(out, final=True))
        nursery.cancel_scope.cancel()
    return {
        "text": tokenizer.decode(out, skip_special_tokens=True),
        "prompt_ids": prompt_ids,
        "output_ids": out,
        "new_tokens": len(out),
        **timing,
        "ring": [{"index": i.index, "peer_id": i.peer_id, "addr": i.addr, "layers": list(i.layers)} for i in infos],
        "model": resolved.name,
    }


async def decode(ring: RingClient, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                 on_ids=None, spec: SpecConfig | None = None, drafter=None,
                 sampling: SamplingParams | None = None, wire_dtype: str | None = None) -> tuple[list[int], dict]:
    """Generate greedily over a connected ring, speculatively when a drafter and ``spec.k`` are given.

    Prefill goes round in chunks of ``spec.prefill_chunk`` positions, pipelined across stages;
    decode sends verify chunks ``[last committed] + K drafts`` with up to ``spec.depth`` in flight
    (``swarm.spec.SpecLoop``). Output is token-for-token plain greedy.

    Args:
        ring: a RingClient after ``connect``.
        prompt_ids: the prompt's token ids (non-empty).
        max_new_tokens: stop after this many new tokens; stop_ids: stop after emitting one of these.
        on_ids: called with the full list of new ids after each commit (for streaming).
        spec: K, depth, prefill chunk (default: plain decoding, K = 0, depth 1).
        drafter: a ``swarm.spec.Drafter`` (default: none).
        sampling: temperature / top-k / top-p / seed (default greedy). The tail draws the token of
            every position with noise keyed by (seed, position) (``swarm.model.sampling``), and
            drafts are verified by exact match against it: the output is the same for any drafter,
            K and depth, and is an exact sample of the model.
        wire_dtype: dtype of hidden states between stages (None: each stage's own dtype). Narrower
            dtypes (bfloat16, float16, float8_e4m3fn with a scale per position) are lossy: opt-in,
            and recorded as ``wire_lossy`` in the result.
    Returns:
        (new token ids, dict with tokens_per_s (decode), ttft_s, total_s, context_limited, spec stats).
    Raises:
        ConfigError: the prompt does not fit the ring's context. StageLost, HopTimeout, RemoteError.
    """
    spec = spec or SpecConfig()
    max_ctx = min(i.max_ctx for i in ring.infos)
    if len(prompt_ids) >= max_ctx:
        raise ConfigError(f"the prompt has {len(prompt_ids)} tokens; the ring's maximum context is {max_ctx}")
    budget = min(max_new_tokens, max_ctx - len(prompt_ids))
    if budget < max_new_tokens:
        log.warning("context.limit prompt_tokens=%d max_ctx=%d new_tokens_capped_at=%d", len(prompt_ids), max_ctx, budget)
    loop = SpecLoop(prompt_ids, budget, frozenset(stop_ids), drafter or NoDrafter(), k=spec.k, depth=spec.depth,
                    prefill_chunk=spec.prefill_chunk)
    session = uuid.uuid4().hex
    sampling = sampling or SamplingParams()
    await ring.open_session(session, len(prompt_ids) + budget, None if sampling.greedy else sampling.to_wire(),
                            wire_dtype)
    t_first = None
    try:
        t0 = time.perf_counter()
        while not loop.done:
            for chunk in loop.next_chunks():
                await ring.send_chunk(session, chunk)
            msg = await ring.next_result(session)
            epoch = loop.epoch
            new = loop.on_result(msg["chunk"], msg["epoch"], msg["token_ids"])
            if loop.epoch != epoch and not loop.done:
                await ring.cancel(session, loop.epoch)
            if new:
                t_first = t_first or time.perf_counter()
                if on_ids:
                    on_ids(loop.output)
        t_end = time.perf_counter()
    finally:
        with trio.CancelScope(shield=True):
            await ring.close_session(session)
    out = loop.output
    decode_s = t_end - t_first
    return out, {
        "tokens_per_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        "ttft_s": t_first - t0,
        "total_s": t_end - t0,
        "context_limited": budget < max_new_tokens,
        "sampling": sampling.to_wire(),
        "wire_dtype": wire_dtype or "stage",
        "wire_lossy": any(wire.is_lossy(wire_dtype, i.dtype) for i in ring.infos),
        "spec": {"draft": getattr(drafter, "name", "none"), "k": spec.k, "depth": spec.depth,
                 "prefill_chunk": spec.prefill_chunk, **loop.stats.as_dict()},
    }
