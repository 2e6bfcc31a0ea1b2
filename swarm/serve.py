"""``swarm serve``: an OpenAI-compatible HTTP API over a ring.

Owns: the Starlette app (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``), request validation into OpenAI-shaped errors, stop strings, server-sent events, and
one ring session per request. Runs in one trio event loop with Hypercorn (its trio worker), so the
libp2p host and every request share it. Glue over ``swarm.coordinator`` and ``swarm.ring``.

Each request in flight holds one ``RingClient`` from a pool (its own streams to every stage, over
the host's one connection per stage) and opens its own session with its own KV cache at every
stage, so concurrent requests are isolated: a request that ends closes its session everywhere. A
client that disconnects stops its generation at the next token, which closes the session the
normal way (cancelled after 10 s if it is stuck); a request that fails closes its client's
streams, so every stage drops the session. Sessions open with ``batch: true``: stages pack the
rows of requests that are ready together into one forward (see ``swarm.stage.scheduler``).

API reference: https://platform.openai.com/docs/api-reference (chat, completions, streaming).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import trio

from swarm import receipts
from swarm.config import RingSpec, SamplingParams, SpecConfig
from swarm.errors import (ConfigError, ContextOverflow, HopTimeout, ModelError, RemoteError, StageLost,
                          SwarmError, collapse)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


class ApiError(Exception):
    """An error answered in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A validated completion request."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool


@dataclass
class ServeState:
    """What every request shares: the ring, the host, the tokenizer."""

    ring: RingSpec
    host: object
    nursery: object
    tokenizer: object
    model_id: str
    model_dir: object
    num_layers: int
    model_digest: str
    stop_ids: set
    max_ctx: int
    vocab_size: int = 0
    hop_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    spec: SpecConfig = field(default_factory=SpecConfig)
    wire_dtype: str | None = None
    active: int = 0
    served: int = 0
    pool: object = None  # ClientPool, set by serve_api
    discovery: tuple | None = None  # (SwarmDHT, weights id) when the ring was routed from the swarm's DHT
    prefix_cache: bool = True  # offer prompts to the stages' prefix caches (--no-prefix-cache: off)
    cached_tokens: int = 0  # prompt positions all requests so far took from the prefix caches
    metrics: object = None  # swarm.metrics.ServeMetrics, set by serve_api
    dashboard_receipts: object = None  # a receipt directory whose jobs the dashboard lists (verified), or None
    receipt_dir: object = None  # --receipt-dir: each request runs as a job with a signed receipt saved there
    key: object = None  # this server's node key (its PeerId; signs the job receipts)
    coverage: object = None  # swarm.dashboard.SwarmCoverage: the DHT's records, read in the background


# ---- request parsing ----------------------------------------------------------------------------


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or (not integer and not math.isfinite(value)) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        span = f"[{int(lo)}, {int(hi)}]" if integer else f"[{lo:g}, {hi:g}]"
        raise ApiError(400, f"'{name}' must be {kind} in {span}, got {value!r}", name)
    return value


def parse_request(body, state: ServeState, chat: bool) -> Request:
    """Validate an OpenAI request body; raise ApiError(400/404) naming the first bad parameter."""
    from swarm.api_params import ParamRefused, check_fields

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = check_fields(body, chat)  # null = default; unknown or unsupported fields are refused by name
    except ParamRefused as exc:
        raise ApiError(400, str(exc), exc.param) from None
    model = body.get("model")
    if model is not None and model != state.model_id:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves {state.model_id!r}",
                       "model", "model_not_found")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise ApiError(400, "only n=1 is supported", "n")
    if chat:
        prompt_ids = _chat_ids(body.get("messages"), state.tokenizer)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (or a list of one string)", "prompt")
        prompt_ids = list(state.tokenizer(prompt)["input_ids"])
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty after tokenization", "prompt")
    if len(prompt_ids) >= state.max_ctx:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the ring's maximum context is {state.max_ctx}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, DEFAULT_MAX_TOKENS, 1, 2**31 - 1, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be > 0", "top_p")
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    if seed is None:
        seed = secrets.randbits(31)  # like OpenAI: unseeded requests differ
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    try:
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), seed=int(seed))
    except ConfigError as exc:
        raise ApiError(400, str(exc), "temperature") from None
    return Request(prompt_ids, max_tokens, sampling, stop, stream, bool(opts.get("include_usage")), chat)


def _chat_ids(messages, tokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or developer", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    from swarm.chat import ChatTemplateError, encode_chat

    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        return encode_chat(tokenizer, clean)  # content is literal text: a typed <|im_end|> ends no turn
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None


# ---- one generation -----------------------------------------------------------------------------


class Detok:
    """Text of the committed ids, with stop strings: ``update(ids)`` returns the text that is safe
    to emit now (held back where a stop string might still be forming)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.emitted = 0
        self.text = ""
        self.hit = False
        self.ids: list[int] = []
        self.record: dict = {}

    def update(self, ids: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.hit, final = text[:cut], True, True
        self.text = text
        safe = len(text)
        if not final:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            hold = max((len(s) - 1 for s in self.stop), default=0)
            safe = max(self.emitted, safe - hold)
        new, self.emitted = text[self.emitted:safe], max(self.emitted, safe)
        return new


def map_error(exc: BaseException) -> ApiError:
    """A SwarmError from the ring, as the HTTP error a client should see."""
    from swarm.heal import HealError, NoSpare

    text = str(exc)
    if isinstance(exc, ContextOverflow):
        return ApiError(400, text, None, "context_length_exceeded")
    if isinstance(exc, RemoteError) and ("busy" in text or "draining" in text):
        return ApiError(503, f"the ring cannot take this request now: {text}", None, "ring_busy", "server_error")
    if isinstance(exc, (StageLost, HopTimeout, NoSpare, HealError)):
        return ApiError(503, f"the ring is unavailable: {text}", None, "ring_unavailable", "server_error")
    if isinstance(exc, (ConfigError, ModelError)):
        return ApiError(400, text)
    return ApiError(502, f"a stage failed the request: {text}", None, "stage_error", "server_error")


async def generate_ids(state: ServeState, req: Request, on_text=None,
                       stop: trio.Event | None = None) -> tuple[list[int], dict, Detok]:
    """Run one request on its own ring client; ``on_text(piece)`` gets text as it becomes final.
    Once ``stop`` is set, generation ends at the next token and the session closes normally.

    Raises:
        SwarmError: from the ring (see ``map_error``).
    """
    from swarm.coordinator import decode
    from swarm.drafters import make_drafter

    detok = Detok(state.tokenizer, req.stop)
    gaps: list[float] = []  # seconds between consecutive tokens as they arrived (inter-token latency)
    arrived = {"n": 0, "t": None}

    def on_ids(ids):
        now, new = time.perf_counter(), len(ids) - arrived["n"]
        if new > 0:
            fresh = [] if arrived["t"] is None else [now - arrived["t"]] + [0.0] * (new - 1)  # accepted together:
            gaps.extend(fresh)  # they arrive together
            if state.metrics is not None:
                state.metrics.tokens_arrived(new, fresh)
            arrived.update(n=len(ids), t=now)
        piece = detok.update(ids)
        if piece and on_text:
            on_text(piece)

    drafter = make_drafter(state.spec.draft, target_vocab=state.vocab_size, sampling=req.sampling) \
        if state.spec.draft != "none" else None
    job = {"id": uuid.uuid4().hex, "nonce": receipts.new_nonce()} if state.receipt_dir is not None else None
    client = await state.pool.acquire()
    state.active += 1
    healthy = False
    try:
        detok.ids, detok.record = await decode(client, req.prompt_ids, req.max_tokens, state.stop_ids, on_ids,
                                               state.spec, drafter, req.sampling, state.wire_dtype,
                                               prefix_cache=state.prefix_cache, job=job,
                                               should_stop=lambda ids: detok.hit or (stop is not None and
                                                                                     stop.is_set()))
        healthy = True
        if detok.record.get("heal_events"):
            state.ring = client.healed_ring()  # new ring clients start from the healed ring
        ring_entries = [i.entry() for i in client.infos]  # after any heal: the ring that finished the job
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    finally:
        await state.pool.release(client, healthy)
        state.active -= 1
        state.served += 1
        if state.metrics is not None and not healthy:
            state.metrics.request_done("error")
    out, record = detok.ids, detok.record
    parts = record.pop("receipt_parts", None)
    state.cached_tokens += int(record.get("cached_tokens") or 0)
    if state.metrics is not None:
        state.metrics.request_done("abandoned" if stop is not None and stop.is_set() else "ok", record, len(out),
                                   gaps=gaps)
    if job is not None and parts is not None:
        record["receipt"] = await _save_receipt(state, job, parts, req.prompt_ids, out, ring_entries, record)
    tail = detok.update(out, final=True)
    if tail and on_text:
        on_text(tail)
    return out, record, detok


async def _save_receipt(state: ServeState, job: dict, parts: dict, prompt_ids: list[int], out: list[int],
                        ring_entries: list[dict], record: dict) -> dict | None:
    """Sign, save and verify one request's job receipt (in a worker thread); counted in the
    metrics. A receipt that cannot be written is logged, and the answer still goes out."""
    from swarm.coordinator import write_job_receipt

    try:
        res = await trio.to_thread.run_sync(lambda: write_job_receipt(
            state.receipt_dir, state.key, job, parts, model=state.model_id, model_digest=state.model_digest,
            num_layers=state.num_layers, prompt_ids=prompt_ids, output_ids=out, ring=ring_entries, record=record))
    except ConfigError as exc:
        log.warning("receipt.unwritten job=%s reason=%s", job["id"], exc)
        return None
    if state.metrics is not None:
        state.metrics.receipt_written(Path(res["path"]).name, None if res["verified"] else res.get("check", "?"))
    log.info("request.receipt job=%s verified=%s path=%s", job["id"], res["verified"], res["path"])
    return res


class ClientPool:
    """Ring clients with open streams to every stage, one per request in flight (at most ``size``).

    Streams are opened once and reused: py-libp2p 0.8.1 loses a shared connection when many streams
    are opened and closed on it while others are busy, so requests must not churn streams. A client
    whose request failed or was cancelled (its streams may hold half a frame) is closed, not reused.
    """

    def __init__(self, state: ServeState, size: int):
        self.state, self.size = state, size
        self.free: list = []
        self.slots = trio.Semaphore(size)
        self.opened = 0

    async def acquire(self):
        await self.slots.acquire()
        try:
            if self.free:
                return self.free.pop()
            try:
                client = await self._connect()
            except StageLost as exc:
                if self.state.discovery is None:
                    raise
                # routed from the DHT: a stage of the route is gone (and no request healed past it, e.g.
                # its heal found nothing yet): route again over the records as they are now
                log.warning("serve.reroute reason=%s", exc)
                await self._reroute(exc)
                client = await self._connect()
            self.opened += 1
            return client
        except BaseException:
            self.slots.release()
            raise

    async def _connect(self):
        from swarm.ring import RingClient

        st = self.state
        client = RingClient(st.host, st.ring, st.hop_timeout_s, st.connect_timeout_s, st.heartbeat_s, batch=True,
                            model_id=st.discovery[1] if st.discovery else None)
        client.discovery = st.discovery  # heals may take a replacement from the DHT
        try:
            await client.connect(st.num_layers, st.model_digest, st.nursery, use_spares=True)
        except BaseException:
            await client.aclose()
            raise
        return client

    async def _reroute(self, cause: StageLost) -> None:
        """A new route from the DHT for the clients opened from now on (``swarm.discovery.client``).

        Raises:
            StageLost: the swarm has no route now (names why), so the request is a 503.
        """
        from swarm.discovery.client import discover_ring

        st = self.state
        dht, weights_id = st.discovery[0], st.discovery[1]
        try:
            found = await discover_ring(dht, st.ring.model, weights_id, st.num_layers)
        except ConfigError as exc:
            raise StageLost(f"{cause}; and no new route: {exc}") from None
        st.ring, st.discovery = found.ring, (dht, weights_id, found.records)

    async def release(self, client, healthy: bool) -> None:
        if healthy:
            self.free.append(client)
        else:
            await client.aclose()
        self.slots.release()

    async def aclose(self) -> None:
        while self.free:
            await self.free.pop().aclose()


def finish_reason(out: list[int], req: Request, state: ServeState, detok: Detok, record: dict) -> str:
    if detok.hit or (out and out[-1] in state.stop_ids):
        return "stop"
    return "length"


def usage(req: Request, out: list[int], record: dict | None = None) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt's leading
    positions every stage took from its prefix cache (not prefilled again)."""
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(out),
            "total_tokens": len(req.prompt_ids) + len(out),
            "prompt_tokens_details": {"cached_tokens": int((record or {}).get("cached_tokens") or 0)}}


# ---- the app ------------------------------------------------------------------------------------


def build_app(state: ServeState):
    """The Starlette app over ``state``."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from swarm.dashboard import page as dashboard_page
    from swarm.dashboard import serve_state
    from swarm.metrics import CONTENT_TYPE

    def error_response(err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    async def completion(request, chat: bool):
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError):
                raise ApiError(400, "the request body is not valid JSON") from None
            req = parse_request(body, state, chat)
        except ApiError as err:
            if state.metrics is not None:
                state.metrics.request_done("invalid")
            return error_response(err)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_events(state, req, rid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            got = await _until_hang_up(request, lambda gone: generate_ids(state, req, stop=gone))
        except SwarmError as exc:
            log.warning("request.failed id=%s reason=%s", rid, exc)
            return error_response(map_error(exc))
        if got is None:  # the client hung up: generation stopped at the next token, sessions closed
            log.info("request.abandoned id=%s", rid)
            return Response(status_code=499)
        out, record, detok = got
        reason = finish_reason(out, req, state, detok, record)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": detok.text}, "finish_reason": reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": detok.text, "finish_reason": reason, "logprobs": None}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": state.model_id, "choices": [choice],
                             "usage": usage(req, out, record), "system_fingerprint": None})

    async def chat_completions(request):
        return await completion(request, chat=True)

    async def completions(request):
        return await completion(request, chat=False)

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_id, "object": "model", "created": 0, "owned_by": "swarm"}]})

    async def health(request):
        stages = await ring_health(state)
        ok = all(s["ok"] for s in stages)
        return JSONResponse({"status": "ok" if ok else "degraded", "model": state.model_id, "stages": stages,
                             "active_requests": state.active, "served_requests": state.served,
                             "prefix_cache": state.prefix_cache, "cached_tokens": state.cached_tokens},
                            status_code=200 if ok else 503)

    async def metrics(request):
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    async def dashboard(request):
        return Response(dashboard_page(), media_type="text/html; charset=utf-8")

    async def dashboard_state(request):
        return JSONResponse(await serve_state(state))

    async def not_found(request, exc):
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def not_allowed(request, exc):
        if state.metrics is not None and request.url.path in ("/v1/chat/completions", "/v1/completions"):
            state.metrics.request_done("invalid")
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/", dashboard, methods=["GET"]),
        Route("/dashboard/state", dashboard_state, methods=["GET"]),
    ], exception_handlers={404: not_found, 405: not_allowed})


async def _events(state: ServeState, req: Request, rid: str, created: int):
    """Server-sent events of one streaming request. The generation runs in the server's nursery
    under its own cancel scope; if the client goes away, this generator is closed and the scope
    cancelled, and the request's streams close so every stage drops the session."""
    send, recv = trio.open_memory_channel(math.inf)
    scope = trio.CancelScope()
    gone = trio.Event()  # the client left
    obj = "chat.completion.chunk" if req.chat else "text_completion"

    def chunk(text: str | None = None, reason: str | None = None, role: bool = False) -> str:
        if req.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_id,
                                      "choices": [choice]}) + "\n\n"

    async def work():
        with scope:
            try:
                out, record, detok = await generate_ids(state, req, lambda t: send.send_nowait(("text", t)), gone)
                send.send_nowait(("done", (out, record, detok)))
            except SwarmError as exc:
                log.warning("request.failed id=%s reason=%s", rid, exc)
                send.send_nowait(("error", map_error(exc)))

    state.nursery.start_soon(work)
    try:
        if req.chat:
            yield chunk(role=True)
        async for kind, value in recv:
            if kind == "text":
                yield chunk(value)
            elif kind == "error":
                yield "data: " + json.dumps(value.body()) + "\n\n"
                break
            else:
                out, record, detok = value
                yield chunk(reason=finish_reason(out, req, state, detok, record))
                if req.include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_id,
                                                 "choices": [], "usage": usage(req, out, record)}) + "\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        # a client that left: generation stops at its next token and closes the session at every
        # stage, keeping the ring client's streams (closing streams under load is what py-libp2p
        # 0.8.1 handles worst: it can drop the connection other requests share); cancel only if
        # that takes too long
        gone.set()
        state.nursery.start_soon(_cancel_after, scope, 10.0)


async def _until_hang_up(request, work, grace_s: float = 10.0):
    """Run ``work(gone)`` (a request's generation) while watching the client's connection: when the
    client hangs up, ``gone`` is set, so the generation stops at its next token and closes its
    sessions the normal way; it is cancelled if it has not ended ``grace_s`` later.

    Returns:
        what ``work`` returned, or None if the client hung up.
    Raises:
        what ``work`` raised (not wrapped in an exception group).
    """
    gone = trio.Event()
    box: dict = {}

    async def watch(scope):
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                gone.set()
                await trio.sleep(grace_s)
                scope.cancel()
                return

    async def run(scope):
        try:
            box["result"] = await work(gone)
        except Exception as exc:  # handed to the caller below, outside the nursery
            box["error"] = exc
        finally:
            scope.cancel()  # stop watching

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        nursery.start_soon(run, nursery.cancel_scope)
    if gone.is_set():
        return None
    if "error" in box:
        raise box["error"]
    return box.get("result")


async def _cancel_after(scope: trio.CancelScope, seconds: float) -> None:
    await trio.sleep(seconds)
    scope.cancel()


async def ring_health(state: ServeState) -> list[dict]:
    """Ask every stage of the current ring for its info (in parallel, with a short deadline)."""
    from swarm import wire
    from swarm.wire import PROTOCOL_ID

    results: list[dict] = [{} for _ in state.ring.stages]

    async def one(i, spec):
        entry = {"index": i, "layers": [spec.layers.start, spec.layers.end], "addr": spec.addr,
                 "peer_id": spec.peer_id, "ok": False}
        t0 = time.perf_counter()
        try:
            with trio.fail_after(min(5.0, state.connect_timeout_s)):
                s = await state.host.open_stream(spec.addr, PROTOCOL_ID, timeout_s=state.connect_timeout_s)
                try:
                    await s.send(wire.frame("info"))
                    msg = await s.recv()
                finally:
                    await s.aclose()
            entry.update(ok=msg.get("type") == "info_ok" and msg.get("peer_id") == spec.peer_id
                         and not msg.get("draining"), latency_ms=round((time.perf_counter() - t0) * 1000, 1),
                         **{k: msg.get(k) for k in ("max_ctx", "sessions", "kv_bytes", "kv_reserved_bytes",
                                                    "draining", "batching", "prefix_cache")})
        except (SwarmError, trio.TooSlowError) as exc:
            entry["error"] = str(exc) or "no answer within 5 s"
        results[i] = entry

    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(state.ring.stages):
            nursery.start_soon(one, i, spec)
    return results


async def serve_api(ring: RingSpec, host: str = "127.0.0.1", port: int = 8000, *, listen_socket=None,
                    task_status=trio.TASK_STATUS_IGNORED, **options) -> None:
    """Bind ``host:port`` first (or take ``listen_socket``, already bound), then ``_serve_api`` on it.

    A taken port thus fails at once, in one line, before the model, the tokenizer or the ring are
    touched. ``options``: as ``_serve_api``.

    Raises:
        ListenError: ``host:port`` cannot be bound ("cannot listen on 127.0.0.1:8000: address already
            in use (...)"). Else as ``_serve_api``.
    """
    from swarm.listen import bind_tcp

    sock = listen_socket if listen_socket is not None else bind_tcp(host, port)
    try:
        await _serve_api(ring, host, port, sock=sock, task_status=task_status, **options)
    finally:
        if sock.fileno() != -1:  # not handed to hypercorn (a failure before listening)
            sock.close()


async def _serve_api(ring: RingSpec, host: str = "127.0.0.1", port: int = 8000, *, sock, key_path=None,
                     spec: SpecConfig | None = None, wire_dtype: str | None = None, hop_timeout_s: float = 60.0,
                     heartbeat_s: float = 1.0, max_concurrency: int = 16, bootstrap: tuple[str, ...] = (),
                     prefix_cache: bool = True, dashboard_receipts=None, receipt_dir=None,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Check the ring, then serve the API on ``sock`` (bound to ``host:port``) until cancelled.

    With ``bootstrap`` (and a RingSpec naming only the model) the ring is routed from the swarm's
    DHT (``swarm.discovery.client.discover_ring``) and heals may take replacements from it.

    ``task_status.started`` gets ``{"url", "model", "ring"}`` once listening. At most
    ``max_concurrency`` requests run on the ring at once; more wait for a free slot. With
    ``prefix_cache`` (default) each request offers its prompt to the stages' prefix caches: a chat's
    next turn, or a system prompt shared by many requests, is prefilled only past what they hold.
    With ``receipt_dir`` every request runs as a job: the stages keep receipt digests, and its
    signed, verified job receipt is saved there (one more round per request to collect the stages'
    receipts); the dashboard lists that directory unless ``dashboard_receipts`` names another.

    Raises:
        ConfigError / ModelError / StageLost: the model or the ring is not usable (checked first).
    """
    from hypercorn.config import Config as HyperConfig
    from hypercorn.trio import serve as hyper_serve
    from transformers import AutoTokenizer

    from swarm.config import cache_root
    from swarm.coordinator import _check_writable, eos_ids, vocab_size
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest, resolve_model
    from swarm.ring import RingClient
    from swarm.transport import open_host
    from swarm.transport.identity import claim_key

    if bootstrap:  # before converting or downloading the model: does the swarm serve it at all?
        from swarm.coordinator import swarm_may_serve

        await swarm_may_serve(ring.model, bootstrap)
    resolved = resolve_model(ring.model)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    num_layers = model_num_layers(resolved.path)
    digest = model_manifest_digest(resolved.path)
    if receipt_dir is not None:  # checked before listening: every answered request gets its receipt
        _check_writable(receipt_dir)
    if dashboard_receipts is not None and not Path(dashboard_receipts).is_dir():
        raise ConfigError(f"--dashboard-receipts {dashboard_receipts}: not a directory")
    key, _ = claim_key(key_path or cache_root() / "keys" / "coordinator.key", fallback=key_path is None)
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as p2p, trio.open_nursery() as nursery:
        discovery = None
        if bootstrap:
            from swarm.coordinator import run_dht
            from swarm.discovery.client import discover_ring
            from swarm.weights.manifest import model_id as weights_model_id

            weights_id = await trio.to_thread.run_sync(weights_model_id, resolved.path, cache_root() / "manifests")
            dht = await nursery.start(run_dht, p2p, bootstrap)
            found = await discover_ring(dht, ring.model, weights_id, num_layers)
            ring, discovery = found.ring, (dht, weights_id, found.records)
        probe = RingClient(p2p, ring, hop_timeout_s, 10.0, heartbeat_s, model_id=discovery[1] if discovery else None)
        async with trio.open_nursery() as probe_nursery:  # the ring must be whole before we listen
            try:
                infos = await probe.connect(num_layers, digest, probe_nursery, use_spares=True)
                ring = probe.healed_ring()
            finally:
                await probe.aclose()
                probe_nursery.cancel_scope.cancel()
        state = ServeState(ring=ring, host=p2p, nursery=nursery, tokenizer=tokenizer, model_id=resolved.name,
                           model_dir=resolved.path, num_layers=num_layers, model_digest=digest,
                           stop_ids=eos_ids(resolved.path, tokenizer), max_ctx=min(i.max_ctx for i in infos),
                           hop_timeout_s=hop_timeout_s, heartbeat_s=heartbeat_s, spec=spec or SpecConfig(),
                           wire_dtype=wire_dtype, vocab_size=vocab_size(resolved.path), discovery=discovery,
                           prefix_cache=prefix_cache, dashboard_receipts=dashboard_receipts or receipt_dir,
                           receipt_dir=receipt_dir, key=key)
        if discovery is not None:  # the dashboard's layer coverage comes from the DHT
            from swarm.dashboard import SwarmCoverage

            state.coverage = SwarmCoverage(discovery[0])
            await nursery.start(state.coverage.run)
        state.pool = ClientPool(state, max_concurrency)
        from swarm.metrics import ServeMetrics

        state.metrics = ServeMetrics(state)
        from swarm.listen import hypercorn_bind

        config = HyperConfig()
        config.bind = [hypercorn_bind(sock)]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        binds = await nursery.start(hyper_serve, build_app(state), config)
        url = binds[0] if binds else f"http://{host}:{port}"
        task_status.started({"url": url, "model": resolved.name, "ring": [i.entry() for i in infos]})
        await trio.sleep_forever()
