"""``swarm serve``: an OpenAI-compatible HTTP API over a ring.

Owns: the Starlette app (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``), request validation into OpenAI-shaped errors, stop strings, server-sent events, and
one ring session per request. Runs in one trio event loop with Hypercorn (its trio worker), so the
libp2p host and every request share it. Glue over ``swarm.coordinator.generation`` and ``swarm.coordinator.ring``.

Each request in flight holds one ``RingClient`` from a pool (its own streams to every stage, over
the host's one connection per stage) and opens its own session with its own KV cache at every
stage, so concurrent requests are isolated: a request that ends closes its session everywhere. A
client that disconnects stops its generation after the next result (a token's, or a prefill
chunk's), which closes the session the normal way (cancelled after 10 s if it is stuck); a request
that fails closes its client's streams, so every stage drops the session.

The request lifecycle: the body's size and the prompt's characters are checked before any parsing
or tokenizing, which run in a worker thread; a stream's status is sent once the ring admitted its
session (a refusal is a 503 with Retry-After); a waiting stream sends SSE keep-alive comments; a
``Shutdown`` (SIGTERM, Ctrl-C) drains: new requests get 503, running ones may finish until a
deadline, the rest end with an error event and ``[DONE]`` (``drain``). Sessions open with ``batch: true``: stages pack the
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
from swarm.serve.health import ring_health

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_BODY_MB = 8.0  # --max-body-mb: a text prompt that fits any ring's context is far smaller
DEFAULT_KEEPALIVE_S = 15.0  # --keepalive-s: under the idle timeouts of common proxies (nginx 60 s, ALB 60 s)
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # --drain-timeout-s, as the stages'
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: every SSE parser skips it, every proxy sees bytes


class ApiError(Exception):
    """An error answered in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: int | None = None):
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate, shown escaped
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s  # the Retry-After header of a 429/503 (default 1 s)

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
    metrics: object = None  # swarm.serve.metrics.ServeMetrics, set by serve_api
    dashboard_receipts: object = None  # a receipt directory whose jobs the dashboard lists (verified), or None
    receipt_dir: object = None  # --receipt-dir: each request runs as a job with a signed receipt saved there
    key: object = None  # this server's node key (its PeerId; signs the job receipts)
    coverage: object = None  # swarm.serve.dashboard.SwarmCoverage: the DHT's records, read in the background
    # the request lifecycle (see serve_api): size limits, keep-alives, the drain
    max_body_bytes: int = DEFAULT_MAX_BODY_MB * 2**20  # a larger request body is refused (413) unread
    max_prompt_chars: int = 0  # a longer prompt cannot fit max_ctx (refused before tokenizing); 0: unchecked
    keepalive_s: float = DEFAULT_KEEPALIVE_S  # an idle stream sends an SSE comment this often; 0: never
    draining: bool = False  # set by a drain: new requests are refused (503)
    requests: dict = field(default_factory=dict)  # request id -> ends it now (a drain's deadline passed)
    cors_origins: tuple[str, ...] = ()  # --cors-origin: browser origins allowed to call the API ("*": any)
    created: int = field(default_factory=lambda: int(time.time()))  # unix time the model was loaded and served


# ---- request parsing ----------------------------------------------------------------------------

SEED_RANDOM = -1  # seed -1 asks for a random seed (llama.cpp, TGI, many UIs send it)
GREEDY_BELOW = 1e-4  # a temperature in (0, this) samples as greedy: logits / T would overflow


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if ok and not integer and isinstance(value, int):  # an int too large for a float is out of range anyway
        ok = -2**53 <= value <= 2**53
    if not ok or isinstance(value, bool) or (not integer and not math.isfinite(value)) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        span = f"[{int(lo)}, {int(hi)}]" if integer else f"[{lo:g}, {hi:g}]"
        raise ApiError(400, f"'{name}' must be {kind} in {span}, got {_shown(value)}", name)
    return value


def parse_request(body, state: ServeState, chat: bool) -> Request:
    """Validate an OpenAI request body (a parsed JSON document, see ``swarm.serve.params.load_body``).

    Everything a client sends is checked here, and nothing it sends can make this raise anything
    but ApiError: a value the checks did not foresee that makes the chat template or the tokenizer
    fail is the client's input too, and answered 400.

    Raises:
        ApiError: 400 naming the first bad parameter (``invalid_request_error``), 404 for another
            model; 500 (``server_error``) only where the server itself failed (e.g. it cannot read
            its tokenizer's files).
    """
    try:
        return _parse(body, state, chat)
    except ApiError:
        raise
    except (OSError, MemoryError) as exc:  # the server's own resources, not the request
        log.exception("request.parse_failed reason=%s", exc)
        raise ApiError(500, f"the server failed reading the request: {type(exc).__name__}: {exc}", None,
                       "internal_error", "server_error") from None
    except Exception as exc:  # e.g. a template's raise_exception, a tokenizer refusing a string
        log.warning("request.unparsable reason=%s: %s", type(exc).__name__, exc,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        raise ApiError(400, f"the request could not be processed: {type(exc).__name__}: {exc}",
                       "messages" if chat else "prompt") from None


def _parse(body, state: ServeState, chat: bool) -> Request:
    from swarm.serve.params import ParamRefused, check_fields

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = check_fields(body, chat)  # null = default; unknown or unsupported fields are refused by name
    except ParamRefused as exc:
        raise ApiError(400, str(exc), exc.param) from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {type(model).__name__}", "model")
    if model is not None and model != state.model_id:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves {state.model_id!r}",
                       "model", "model_not_found")
    n = body.get("n", 1)
    if n != 1 or not isinstance(n, int) or isinstance(n, bool):
        raise ApiError(400, f"only n=1 is supported (one choice per request), got {_shown(n)}", "n")
    if chat:
        prompt_ids = _chat_ids(body.get("messages"), state.tokenizer)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (or a list of one string)", "prompt")
        prompt_ids = _prompt_ids(state.tokenizer, prompt)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty after tokenization", "prompt")
    if len(prompt_ids) >= state.max_ctx:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the ring's maximum context is {state.max_ctx}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, DEFAULT_MAX_TOKENS, 1, 2**31 - 1, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0 or temperature < GREEDY_BELOW:  # both keep only the most likely token: greedy
        temperature, top_p = 0.0, 1.0
    seed = _number(body, "seed", None, -2**63, 2**64 - 1, integer=True)
    if seed is None or seed == SEED_RANDOM:
        seed = secrets.randbits(31)  # like OpenAI: unseeded requests differ
    seed %= 2**63  # any other 64-bit seed (signed or not) is a seed, as OpenAI takes it
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
    unknown = sorted(set(opts) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise ApiError(400, f"unrecognized field stream_options.{unknown[0]}", "stream_options")
    if not isinstance(opts.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false", "stream_options")
    try:
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), seed=int(seed))
    except ConfigError as exc:  # not reached with the checks above; its text names command-line flags
        raise ApiError(400, f"'temperature', 'top_p' or 'seed' is out of range ({exc})", "temperature") from None
    return Request(prompt_ids, max_tokens, sampling, stop, stream, bool(opts.get("include_usage")), chat)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a completion prompt: the tokenizer's own BOS, and the prompt as literal text, so
    a typed ``<s>`` or ``<|endoftext|>`` stays those characters (as message content does in
    ``swarm.coordinator.chat``) instead of forging a control token."""
    return list(tokenizer(prompt, split_special_tokens=True)["input_ids"])


def _chat_ids(messages, tokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of message objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                m["role"] not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or developer", "messages")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ApiError(400, f"messages[{i}].name must be a string", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind != "text" or not isinstance(p.get("text"), str):
                    what = f"of type {_shown(kind)}" if kind not in (None, "text") else "not a text part"
                    raise ApiError(400, f"messages[{i}].content[{j}] is {what}: only text parts "
                                        '({"type": "text", "text": "..."}) are supported', "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    from swarm.coordinator.chat import ChatTemplateError, encode_chat

    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        return encode_chat(tokenizer, clean)  # content is literal text: a typed <|im_end|> ends no turn
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None
    except Exception as exc:  # the template refused these messages (jinja's raise_exception, a bad role order)
        raise ApiError(400, f"the model's chat template refused the messages: {exc}", "messages") from None


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
        return ApiError(503, f"the ring cannot take this request now: {text}", None, "ring_busy", "server_error",
                        retry_after_s=1)
    if isinstance(exc, (StageLost, HopTimeout, NoSpare, HealError)):
        return ApiError(503, f"the ring is unavailable: {text}", None, "ring_unavailable", "server_error",
                        retry_after_s=5)
    if isinstance(exc, (ConfigError, ModelError)):
        return ApiError(400, text)
    return ApiError(502, f"a stage failed the request: {text}", None, "stage_error", "server_error")


async def generate_ids(state: ServeState, req: Request, on_text=None, stop: trio.Event | None = None,
                       on_open=None) -> tuple[list[int], dict, Detok]:
    """Run one request on its own ring client; ``on_text(piece)`` gets text as it becomes final,
    ``on_open()`` is called once every stage admitted the session. Once ``stop`` is set, a request
    still waiting for a ring client leaves the queue at once (nothing was opened: no output), and
    one on the ring ends after its next result (a prefill chunk's or a token's), closing its
    session normally.

    Raises:
        SwarmError: from the ring (see ``map_error``).
    """
    from swarm.coordinator.generation import DecodeOptions, decode
    from swarm.coordinator.drafters import make_drafter

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
    client = await _acquire_unless(state.pool, stop)
    if client is None:  # stopped while queued: nothing was sent to the ring
        if state.metrics is not None:
            state.metrics.request_done("abandoned")
        return [], {"stopped": True}, detok
    state.active += 1
    healthy = False
    try:
        options = DecodeOptions(req.max_tokens, state.stop_ids, state.spec, drafter, req.sampling, state.wire_dtype,
                                prefix_cache=state.prefix_cache, job=job)
        decoded = await decode(client, req.prompt_ids, options, on_ids=on_ids, on_open=on_open,
                               should_stop=lambda ids: detok.hit or (stop is not None and stop.is_set()))
        detok.ids, detok.record = decoded.output_ids, decoded.as_record()
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


async def _acquire_unless(pool, stop: trio.Event | None):
    """A ring client from ``pool``, or None if ``stop`` is set first (the request leaves the queue)."""
    if stop is None:
        return await pool.acquire()
    if stop.is_set():
        return None
    got: list = []
    async with trio.open_nursery() as nursery:
        async def take():
            got.append(await pool.acquire())
            nursery.cancel_scope.cancel()

        async def leave():
            await stop.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(take)
        nursery.start_soon(leave)
    return got[0] if got else None


async def _save_receipt(state: ServeState, job: dict, parts: dict, prompt_ids: list[int], out: list[int],
                        ring_entries: list[dict], record: dict) -> dict | None:
    """Sign, save and verify one request's job receipt (in a worker thread); counted in the
    metrics. A receipt that cannot be written is logged, and the answer still goes out."""
    from swarm.coordinator.generation import write_job_receipt

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
        from swarm.coordinator.ring import RingClient

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

    from swarm.serve.dashboard import page as dashboard_page
    from swarm.serve.dashboard import serve_state
    from swarm.metrics import CONTENT_TYPE

    def error_response(err: ApiError):
        retry = {"Retry-After": str(err.retry_after_s or 1)} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=retry)

    async def completion(request, chat: bool):
        if state.draining:
            return error_response(_shutting_down())
        try:
            # the size limits first, then parsing, templating and tokenizing in a worker thread: one
            # huge request never holds the event loop that streams every other request
            raw = await _read_body(request, state.max_body_bytes)
            req = await trio.to_thread.run_sync(_parse_body, raw, state, chat)
        except ApiError as err:
            if state.metrics is not None:
                state.metrics.request_done("invalid")
            return error_response(err)
        if state.draining:  # began while this one was parsed
            return error_response(_shutting_down())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            return await _stream(state, req, rid, created, request, error_response)
        ended = trio.Event()  # a drain's deadline passed: stop, answer 503
        state.requests[rid] = ended.set
        try:
            got = await _until_hang_up(request, lambda gone: generate_ids(state, req, stop=gone), ended=ended)
        except SwarmError as exc:
            log.warning("request.failed id=%s reason=%s", rid, exc)
            return error_response(map_error(exc))
        finally:
            state.requests.pop(rid, None)
        if ended.is_set():
            log.warning("request.ended id=%s reason=shutting down", rid)
            return error_response(_shutting_down())
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

    def model_object() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "swarm"}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def model(request):
        model_id = request.path_params["model_id"]
        if model_id != state.model_id:
            return error_response(ApiError(404, f"the model {model_id!r} does not exist here; this server serves "
                                                f"{state.model_id!r}", "model", "model_not_found"))
        return JSONResponse(model_object())

    async def health(request):
        stages = await ring_health(state)
        ok = all(s["ok"] for s in stages) and not state.draining  # a draining server: balancers look elsewhere
        status = "draining" if state.draining else "ok" if ok else "degraded"
        return JSONResponse({"status": status, "model": state.model_id, "stages": stages,
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
        allow = dict(getattr(exc, "headers", None) or {}).get("Allow", "")
        if request.method == "OPTIONS":  # a preflight that no --cors-origin allowed: what the route takes,
            return Response(status_code=204, headers={"Allow": allow + ", OPTIONS"})  # and no CORS headers
        if state.metrics is not None and request.url.path in ("/v1/chat/completions", "/v1/completions"):
            state.metrics.request_done("invalid")
        err = error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))
        if allow:
            err.headers["Allow"] = allow
        return err

    async def server_error(request, exc):
        # a fault of the server (a request's own mistakes are 400s before this): still OpenAI's shape
        log.error("request.server_error path=%s", request.url.path, exc_info=exc)
        if state.metrics is not None and request.url.path in ("/v1/chat/completions", "/v1/completions"):
            state.metrics.request_done("error")
        return error_response(ApiError(500, f"internal server error ({type(exc).__name__}); the server's log has "
                                            "the details", None, "internal_error", "server_error"))

    middleware = []
    if state.cors_origins:  # browsers on these origins may call the API (default: none, same origin only)
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(state.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                                     max_age=600))

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/", dashboard, methods=["GET"]),
        Route("/dashboard/state", dashboard_state, methods=["GET"]),
    ], exception_handlers={404: not_found, 405: not_allowed, Exception: server_error}, middleware=middleware)


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down (draining): send the request to another server or retry",
                    None, "server_shutting_down", "server_error", retry_after_s=5)


async def _read_body(request, limit_bytes: int) -> bytes:
    """The request body, at most ``limit_bytes`` of it.

    Raises:
        ApiError: 413 when the body is larger (by its Content-Length, or while reading); the rest is
            read and dropped, up to 16 times the limit, so the client reads the answer, not a reset.
    """
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit_bytes} bytes "
                              "(--max-body-mb)", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    parts, size = [], 0
    dropping = declared.isdigit() and int(declared) > limit_bytes
    async for part in request.stream():
        size += len(part)
        if size > limit_bytes:
            dropping = True
        if dropping:
            if size > 16 * limit_bytes:
                break
            continue
        parts.append(part)
    if dropping:
        raise too_large
    return b"".join(parts)


def _parse_body(raw: bytes, state: ServeState, chat: bool) -> Request:
    """JSON, the prompt's size, then ``parse_request`` (templating, tokenizing); run in a worker thread.

    Raises:
        ApiError: 400 for a body that is not JSON or a prompt that cannot fit the ring's context
            (``context_length_exceeded``, found by its characters before tokenizing), and every error
            of ``parse_request``.
    """
    from swarm.serve.params import InvalidBody, load_body

    try:
        body = load_body(raw)  # UTF-8, JSON, not too deep, no lone surrogates
    except InvalidBody as exc:
        raise ApiError(400, str(exc), exc.param) from None
    if isinstance(body, dict) and state.max_prompt_chars:
        chars = prompt_chars(body, chat)
        if chars > state.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters: more tokens than the ring's maximum context of "
                                f"{state.max_ctx} (at most {state.max_prompt_chars} characters fit with this "
                                "tokenizer)", "messages" if chat else "prompt", "context_length_exceeded")
    return parse_request(body, state, chat)


def prompt_chars(body: dict, chat: bool) -> int:
    """Characters of a request's prompt text (a chat's message contents), counting only values of
    the right type (``parse_request`` reports the others)."""
    def text(value) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):  # a completion's prompt list, a message's content parts
            return sum(text(v.get("text") if isinstance(v, dict) else v) for v in value)
        return 0

    if not chat:
        return text(body.get("prompt"))
    messages = body.get("messages")
    return sum(text(m.get("content")) for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0


def max_prompt_chars(tokenizer, max_ctx: int) -> int:
    """The most characters a prompt of fewer than ``max_ctx`` tokens can have: ``max_ctx`` times the
    longest token's characters (a token never decodes to more characters than its vocabulary
    string has; a chat template only adds tokens). A longer prompt is refused without tokenizing."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max_ctx * max((len(p) for p in pieces if p), default=1)


async def _stream(state: ServeState, req: Request, rid: str, created: int, request, error_response):
    """A streaming request: its generation starts in the server's nursery, and the response status
    waits for the ring's decision. Admitted (the session is open at every stage): 200 and server-sent
    events. Refused before that (the ring is busy or unavailable): the error's status (503 with
    Retry-After), not a 200 with an error inside. Still waiting after ``state.keepalive_s`` (queued
    for a ring client behind ``--max-concurrency`` requests): 200 then, with keep-alive comments
    until it runs; a refusal after that can only be an error event.

    While a stream waits (queue, prefill, a heal) it sends an SSE comment every ``keepalive_s``, so
    proxies that cut idle connections keep it. A client that leaves stops the generation after its
    next result (a prefill chunk's): the session closes at every stage the normal way (cancelled
    if that takes more than 10 s); one still queued leaves the queue at once.
    """
    from starlette.responses import Response, StreamingResponse

    send, recv = trio.open_memory_channel(math.inf)
    scope = trio.CancelScope()
    gone = trio.Event()  # the client left (or the stream ended): stop at the next result
    opened = trio.Event()  # every stage admitted the session
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
        try:
            with scope:
                try:
                    got = await generate_ids(state, req, lambda t: send.send_nowait(("text", t)), gone, opened.set)
                    send.send_nowait(("done", got))
                except SwarmError as exc:
                    log.warning("request.failed id=%s reason=%s", rid, exc)
                    send.send_nowait(("error", map_error(exc)))
        finally:
            state.requests.pop(rid, None)

    state.requests[rid] = lambda: send.send_nowait(("error", _shutting_down()))
    state.nursery.start_soon(work)
    what, first = await _admission(request, opened, recv, state.keepalive_s)
    if what == "gone":  # left before an answer: a queued request leaves the queue, an open session closes
        gone.set()
        state.nursery.start_soon(_cancel_after, scope, 10.0)
        log.info("request.abandoned id=%s", rid)
        return Response(status_code=499)
    if first is not None and first[0] == "error":  # refused, failed or shut down before anything was sent
        gone.set()
        state.nursery.start_soon(_cancel_after, scope, 10.0)
        return error_response(first[1])

    async def events():
        pending = first
        try:
            if req.chat:
                yield chunk(role=True)
            while True:
                if pending is None:
                    with trio.move_on_after(state.keepalive_s or math.inf):
                        pending = await recv.receive()
                    if pending is None:  # idle (queued, a long prefill, a heal): bytes for the proxies
                        yield KEEPALIVE
                        continue
                (kind, value), pending = pending, None
                if kind == "text":
                    yield chunk(value)
                elif kind == "error":
                    yield "data: " + json.dumps(value.body()) + "\n\n"
                    break
                else:
                    out, record, detok = value
                    yield chunk(reason=finish_reason(out, req, state, detok, record))
                    if req.include_usage:
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                     "model": state.model_id, "choices": [],
                                                     "usage": usage(req, out, record)}) + "\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            # a client that left: generation stops at its next result and closes the session at every
            # stage, keeping the ring client's streams (closing streams under load is what py-libp2p
            # 0.8.1 handles worst: it can drop the connection other requests share); cancel only if
            # that takes too long
            gone.set()
            state.nursery.start_soon(_cancel_after, scope, 10.0)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _admission(request, opened: trio.Event, recv, wait_s: float) -> tuple[str, tuple | None]:
    """Wait for the first of: the session opened (``"opened"``), a message from the generation
    (``"message"``: an error, or text of a fast one), ``wait_s`` (> 0) passed (``"waited"``), the
    client hung up (``"gone"``). Returns (which, the message received meanwhile or None)."""
    box: dict = {}

    async with trio.open_nursery() as nursery:
        def decided(what: str) -> None:
            box.setdefault("what", what)
            nursery.cancel_scope.cancel()

        async def on_open():
            await opened.wait()
            decided("opened")

        async def on_message():
            box["message"] = await recv.receive()  # a cancelled receive takes nothing from the channel
            decided("message")

        async def on_wait():
            await trio.sleep(wait_s)
            decided("waited")

        async def on_hang_up():
            while (await request.receive()).get("type") != "http.disconnect":
                pass
            decided("gone")

        for task in (on_open, on_message, on_hang_up) + ((on_wait,) if wait_s > 0 else ()):
            nursery.start_soon(task)
    return box["what"], box.get("message")


async def _until_hang_up(request, work, grace_s: float = 10.0, ended: trio.Event | None = None):
    """Run ``work(gone)`` (a request's generation) while watching the client's connection: when the
    client hangs up (or ``ended`` is set: a drain's deadline passed), ``gone`` is set, so the
    generation stops after its next result and closes its sessions the normal way; it is
    cancelled if it has not ended ``grace_s`` later.

    Returns:
        what ``work`` returned, or None if the client hung up.
    Raises:
        what ``work`` raised (not wrapped in an exception group).
    """
    gone = trio.Event()
    box: dict = {}

    async def stop_then_cancel(scope):
        gone.set()
        await trio.sleep(grace_s)
        scope.cancel()

    async def watch(scope):
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                box["hung_up"] = True
                await stop_then_cancel(scope)
                return

    async def end(scope):
        await ended.wait()
        await stop_then_cancel(scope)

    async def run(scope):
        try:
            box["result"] = await work(gone)
        except Exception as exc:  # handed to the caller below, outside the nursery
            box["error"] = exc
        finally:
            scope.cancel()  # stop watching

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        if ended is not None:
            nursery.start_soon(end, nursery.cancel_scope)
        nursery.start_soon(run, nursery.cancel_scope)
    if box.get("hung_up"):
        return None
    if "error" in box:
        raise box["error"]
    return box.get("result")


async def _cancel_after(scope: trio.CancelScope, seconds: float) -> None:
    await trio.sleep(seconds)
    scope.cancel()


@dataclass
class Shutdown:
    """Asks a running ``serve_api`` to drain and return: ``request(timeout_s)`` (SIGTERM: the drain
    timeout; Ctrl-C: 0, end the open streams now). ``serving`` is set once the API listens."""

    requested: trio.Event = field(default_factory=trio.Event)
    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    serving: bool = False

    def request(self, timeout_s: float) -> None:
        if not self.requested.is_set():
            self.timeout_s = timeout_s
            self.requested.set()


async def drain_on_signals(shutdown: Shutdown, drain_timeout_s: float,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The process's signals (main thread only), as ``swarm stage`` treats SIGTERM: SIGTERM drains
    with ``drain_timeout_s`` (again: logged and ignored, the drain has its deadline); Ctrl-C (SIGINT)
    drains with 0 s (open streams end now, with an error event and ``[DONE]``); a second Ctrl-C,
    or one before the API listens, raises KeyboardInterrupt (stop at once)."""
    import signal

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGINT and (shutdown.requested.is_set() or not shutdown.serving):
                raise KeyboardInterrupt
            if shutdown.requested.is_set():
                log.warning("drain.sigterm_again: already draining (--drain-timeout-s bounds it)")
                continue
            log.warning("drain.%s", "sigterm" if signum == signal.SIGTERM else "sigint")
            shutdown.request(drain_timeout_s if signum == signal.SIGTERM else 0.0)


async def drain(state: ServeState, timeout_s: float) -> dict:
    """Refuse new requests (503, Retry-After), let the ones in flight finish for up to ``timeout_s``,
    then end the rest: a stream gets an error event (``server_shutting_down``) and ``[DONE]``, a
    non-streaming request a 503; their sessions close at every stage. Returns what happened:
    ``requests_finished``, ``requests_ended``, ``waited_s``."""
    state.draining = True
    t0 = trio.current_time()
    before = len(state.requests)
    log.warning("serve.draining requests=%d timeout_s=%g", before, timeout_s)

    async def until_idle():
        while state.requests:
            await trio.sleep(0.05)

    with trio.move_on_after(timeout_s):
        await until_idle()
    ended = list(state.requests.items())
    for rid, end in ended:
        log.warning("request.ending id=%s reason=the drain deadline passed", rid)
        end()
    with trio.move_on_after(15.0):  # each stops after its next result, or is cancelled 10 s later
        await until_idle()
    done = {"requests_finished": before - len(ended), "requests_ended": len(ended),
            "waited_s": round(trio.current_time() - t0, 3)}
    log.warning("serve.drained finished=%d ended=%d waited_s=%.2f", done["requests_finished"],
                done["requests_ended"], done["waited_s"])
    return done


def check_origins(origins) -> tuple[str, ...]:
    """``--cors-origin`` values, checked: each ``*`` or an origin ``scheme://host[:port]``.

    Raises:
        ConfigError: a value that is not an origin (a path, a trailing slash, no scheme), which a
            browser would never send, so it would silently allow nothing.
    """
    import re

    out = []
    for o in origins:
        if o != "*" and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#\s]+", o):
            raise ConfigError(f"--cors-origin {o!r} is not an origin: give scheme://host[:port] (no path, "
                              "no trailing slash), e.g. https://app.example.com, or * for any")
        out.append(o)
    return tuple(out)


async def serve_api(ring: RingSpec, host: str = "127.0.0.1", port: int = 8000, *, listen_socket=None,
                    task_status=trio.TASK_STATUS_IGNORED, **options) -> dict | None:
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
        return await _serve_api(ring, host, port, sock=sock, task_status=task_status, **options)
    finally:
        if sock.fileno() != -1:  # not handed to hypercorn (a failure before listening)
            sock.close()


async def _serve_api(ring: RingSpec, host: str = "127.0.0.1", port: int = 8000, *, sock, key_path=None,
                     spec: SpecConfig | None = None, wire_dtype: str | None = None, hop_timeout_s: float = 60.0,
                     heartbeat_s: float = 1.0, max_concurrency: int = 16, bootstrap: tuple[str, ...] = (),
                     prefix_cache: bool = True, dashboard_receipts=None, receipt_dir=None,
                     keepalive_s: float = DEFAULT_KEEPALIVE_S, max_body_mb: float = DEFAULT_MAX_BODY_MB,
                     cors_origins: tuple[str, ...] = (), shutdown: Shutdown | None = None,
                     task_status=trio.TASK_STATUS_IGNORED) -> dict | None:
    """Check the ring, then serve the API on ``sock`` (bound to ``host:port``) until cancelled, or
    until ``shutdown`` is requested: then drain (``drain``, ``shutdown.timeout_s``), stop listening
    and return the drain's result.

    With ``bootstrap`` (and a RingSpec naming only the model) the ring is routed from the swarm's
    DHT (``swarm.discovery.client.discover_ring``) and heals may take replacements from it.

    ``task_status.started`` gets ``{"url", "model", "ring"}`` once listening. At most
    ``max_concurrency`` requests run on the ring at once; more wait for a free slot. With
    ``prefix_cache`` (default) each request offers its prompt to the stages' prefix caches: a chat's
    next turn, or a system prompt shared by many requests, is prefilled only past what they hold.
    With ``receipt_dir`` every request runs as a job: the stages keep receipt digests, and its
    signed, verified job receipt is saved there (one more round per request to collect the stages'
    receipts); the dashboard lists that directory unless ``dashboard_receipts`` names another.
    ``cors_origins`` (``--cors-origin``): browser origins (``https://host[:port]``, or ``*`` for any)
    whose pages may call the API: CORS headers and preflight answers for them; none by default, so
    only pages served from this server's own origin can (the browser's same-origin rule).

    A request body over ``max_body_mb`` MiB is refused (413) unparsed, a prompt with more characters
    than could fit the ring's context (400) untokenized; parsing, templating and tokenizing run in a
    worker thread. A stream that waits (queued, a long prefill) sends an SSE comment every
    ``keepalive_s`` seconds (0: never); its status (200, or 503 when the ring refuses it) is sent once
    the ring admitted the session, or once it waited ``keepalive_s`` in the queue.

    Raises:
        ConfigError / ModelError / StageLost: the model or the ring is not usable (checked first).
    """
    from hypercorn.config import Config as HyperConfig
    from hypercorn.trio import serve as hyper_serve
    from transformers import AutoTokenizer

    from swarm.config import cache_root
    from swarm.coordinator.generation import check_receipt_dir, eos_ids, vocab_size
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest, resolve_model
    from swarm.coordinator.ring import RingClient
    from swarm.transport import open_host
    from swarm.transport.identity import claim_key

    cors_origins = check_origins(cors_origins)
    if bootstrap:  # before converting or downloading the model: does the swarm serve it at all?
        from swarm.coordinator.generation import swarm_may_serve

        await swarm_may_serve(ring.model, bootstrap)
    resolved = resolve_model(ring.model)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    num_layers = model_num_layers(resolved.path)
    digest = model_manifest_digest(resolved.path)
    if receipt_dir is not None:  # checked before listening: every answered request gets its receipt
        check_receipt_dir(receipt_dir)
    if dashboard_receipts is not None and not Path(dashboard_receipts).is_dir():
        raise ConfigError(f"--dashboard-receipts {dashboard_receipts}: not a directory")
    key, _ = claim_key(key_path or cache_root() / "keys" / "coordinator.key", fallback=key_path is None)
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as p2p, trio.open_nursery() as nursery:
        discovery = None
        if bootstrap:
            from swarm.coordinator.generation import run_dht
            from swarm.discovery.client import discover_ring
            from swarm.weights.identify import model_id as weights_model_id

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
                           receipt_dir=receipt_dir, key=key, max_body_bytes=int(max_body_mb * 2**20),
                           keepalive_s=keepalive_s, cors_origins=cors_origins)
        state.max_prompt_chars = max_prompt_chars(tokenizer, state.max_ctx)
        if discovery is not None:  # the dashboard's layer coverage comes from the DHT
            from swarm.serve.dashboard import SwarmCoverage

            state.coverage = SwarmCoverage(discovery[0])
            await nursery.start(state.coverage.run)
        state.pool = ClientPool(state, max_concurrency)
        from swarm.serve.metrics import ServeMetrics

        state.metrics = ServeMetrics(state)
        from swarm.listen import hypercorn_bind

        config = HyperConfig()
        config.bind = [hypercorn_bind(sock)]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 5.0  # after a drain: the last events of the streams still go out
        stop_listening, stopped = trio.Event(), trio.Event()

        async def http(task_status=trio.TASK_STATUS_IGNORED):
            await hyper_serve(build_app(state), config, shutdown_trigger=stop_listening.wait, task_status=task_status)
            stopped.set()

        binds = await nursery.start(http)
        url = binds[0] if binds else f"http://{host}:{port}"
        if shutdown is not None:
            shutdown.serving = True
        task_status.started({"url": url, "model": resolved.name, "ring": [i.entry() for i in infos]})
        if shutdown is None:
            await trio.sleep_forever()
        await shutdown.requested.wait()
        done = await drain(state, shutdown.timeout_s)
        stop_listening.set()
        with trio.move_on_after(config.graceful_timeout + 1.0):
            await stopped.wait()
        nursery.cancel_scope.cancel()
        return done
