"""``swarm serve``: an OpenAI-compatible HTTP API over a ring.

Owns: the Starlette app (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``,
``/dashboard``) and ``serve_api``, which loads the model, checks the ring, listens and drains, in one trio event
loop with Hypercorn's trio worker. A request's life: docs/commands.md and docs/architecture.md, "Serving".
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from swarm.config import RingSpec
from swarm.errors import ConfigError, SwarmError
from swarm.serve.completion import finish_reason, generate_ids, map_error, usage
from swarm.serve.config import ServeConfig
from swarm.serve.health import ring_health
from swarm.serve.lifecycle import Shutdown, drain, shutting_down, until_hang_up
from swarm.serve.pool import ClientPool
from swarm.serve.requests import ApiError, error_response, max_prompt_chars, parse_body, read_body
from swarm.serve.state import ServeState
from swarm.serve.stream import stream

if TYPE_CHECKING:
    import socket

    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import Response
    from starlette.routing import Route
    from transformers import PreTrainedTokenizerBase

    from swarm.coordinator.links import StageInfo
    from swarm.discovery.dht import SwarmDHT
    from swarm.model.resolve import ResolvedModel
    from swarm.transport.host import SwarmHost

log = logging.getLogger(__name__)

API_PATHS = ("/v1/chat/completions", "/v1/completions")  # where a refused request counts in the metrics


# ---- the app ------------------------------------------------------------------------------------


def build_app(state: ServeState) -> Starlette:
    """The Starlette app over ``state``: the routes, OpenAI-shaped errors for every fault (404, 405,
    500), and CORS for ``state.config.listen.cors_origins``."""
    from starlette.applications import Starlette

    return Starlette(routes=_routes(state), exception_handlers=_error_handlers(state),
                     middleware=_middleware(state.config.listen.cors_origins))


async def completion(state: ServeState, request: HttpRequest, chat: bool) -> Response:
    """``POST /v1/chat/completions`` (``chat``) or ``/v1/completions``: parse, run, answer (JSON,
    or server-sent events for a stream: ``swarm.serve.stream``)."""
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response

    if state.draining:
        return error_response(shutting_down())
    try:
        # the size limits first, then parsing, templating and tokenizing in a worker thread: one
        # huge request never holds the event loop that streams every other request
        raw = await read_body(request, state.config.lifecycle.max_body_bytes)
        req = await trio.to_thread.run_sync(parse_body, raw, state, chat)
    except ClientDisconnect:  # the client hung up before its body was in: its doing, not the server's fault
        log.info("request.abandoned path=%s during=upload", request.url.path)
        if state.metrics is not None:
            state.metrics.request_done("abandoned")
        return Response(status_code=499)
    except ApiError as err:
        if state.metrics is not None:
            state.metrics.request_done("invalid")
        return error_response(err)
    if state.draining:  # began while this one was parsed
        return error_response(shutting_down())
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if req.stream:
        return await stream(state, req, rid, created, request)
    ended = trio.Event()  # a drain's deadline passed: stop, answer 503
    state.requests[rid] = ended.set
    try:
        got = await until_hang_up(request, lambda gone: generate_ids(state, req, stop=gone), ended=ended)
    except SwarmError as exc:
        log.warning("request.failed id=%s reason=%s", rid, exc)
        return error_response(map_error(exc))
    finally:
        state.requests.pop(rid, None)
    if ended.is_set():
        log.warning("request.ended id=%s reason=shutting down", rid)
        return error_response(shutting_down())
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


def _routes(state: ServeState) -> list[Route]:
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from swarm.metrics import CONTENT_TYPE
    from swarm.serve.dashboard import page as dashboard_page
    from swarm.serve.dashboard import serve_state

    async def chat_completions(request):
        return await completion(state, request, chat=True)

    async def completions(request):
        return await completion(state, request, chat=False)

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
                             "prefix_cache": state.config.ring.prefix_cache, "cached_tokens": state.cached_tokens},
                            status_code=200 if ok else 503)

    async def metrics(request):
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    async def dashboard(request):
        return Response(dashboard_page(), media_type="text/html; charset=utf-8")

    async def dashboard_state(request):
        return JSONResponse(await serve_state(state))

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/", dashboard, methods=["GET"]),
        Route("/dashboard/state", dashboard_state, methods=["GET"]),
    ]


def _error_handlers(state: ServeState) -> dict:
    """Starlette's exception handlers: 404, 405 and a server fault, answered in OpenAI's error shape."""
    from starlette.responses import Response

    async def not_found(request, exc):
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def not_allowed(request, exc):
        allow = dict(getattr(exc, "headers", None) or {}).get("Allow", "")
        if request.method == "OPTIONS":  # a preflight that no --cors-origin allowed: what the route takes,
            return Response(status_code=204, headers={"Allow": allow + ", OPTIONS"})  # and no CORS headers
        if state.metrics is not None and request.url.path in API_PATHS:
            state.metrics.request_done("invalid")
        err = error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))
        if allow:
            err.headers["Allow"] = allow
        return err

    async def server_error(request, exc):
        # a fault of the server (a request's own mistakes are 400s before this): still OpenAI's shape
        log.error("request.server_error path=%s", request.url.path, exc_info=exc)
        if state.metrics is not None and request.url.path in API_PATHS:
            state.metrics.request_done("error")
        return error_response(ApiError(500, f"internal server error ({type(exc).__name__}); the server's log has "
                                            "the details", None, "internal_error", "server_error"))

    return {404: not_found, 405: not_allowed, Exception: server_error}


def _middleware(cors_origins: tuple[str, ...]) -> list:
    """CORS for ``cors_origins``: browsers on these origins may call the API (default: none, same origin only)."""
    if not cors_origins:
        return []
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    return [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], max_age=600)]


# ---- serving ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Model:
    """The served model, loaded before the ring is touched."""

    resolved: ResolvedModel
    tokenizer: PreTrainedTokenizerBase
    num_layers: int
    digest: str


async def serve_api(ring: RingSpec, config: ServeConfig | None = None, *, listen_socket: socket.socket | None = None,
                    shutdown: Shutdown | None = None, task_status=trio.TASK_STATUS_IGNORED) -> dict | None:
    """Bind ``config.listen.host:config.listen.port`` first (or take ``listen_socket``, already bound), then serve
    the API over ``ring`` until cancelled, or until ``shutdown`` is requested: then drain (``drain``,
    ``shutdown.timeout_s``), stop listening and return the drain's result.

    A taken port thus fails at once, in one line, before the model, the tokenizer or the ring are
    touched. With ``config.ring.bootstrap`` (and a RingSpec naming only the model) the ring is routed from
    the swarm's DHT (``swarm.discovery.client.discover_ring``) and heals may take replacements from it;
    neither routing, rerouting nor heals take a stage against which a fraud proof on the DHT held when
    re-run on the local weights (``swarm.auditor.exclusions``; a forged proof is refused and logged).

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

    Args:
        ring: the stages to serve over, or (with ``config.ring.bootstrap``) only the model to route.
        config: the settings (default ``ServeConfig()``).
    Raises:
        ListenError: ``host:port`` cannot be bound ("cannot listen on 127.0.0.1:8000: address already
            in use (...)").
        ConfigError / ModelError / StageLost: the model or the ring is not usable (checked first).
    """
    from swarm.listen import bind_tcp

    config = config if config is not None else ServeConfig()
    sock = listen_socket if listen_socket is not None else bind_tcp(config.listen.host, config.listen.port)
    try:
        return await _serve_api(ring, config, sock, shutdown, task_status)
    finally:
        if sock.fileno() != -1:  # a failure before listening (serve_http closes it otherwise)
            sock.close()


async def _serve_api(ring: RingSpec, config: ServeConfig, sock: socket.socket, shutdown: Shutdown | None,
                     task_status) -> dict | None:
    """``serve_api`` on ``sock``: the model, the node key, the host, the ring checked, then listen."""
    from swarm.config import cache_root
    from swarm.coordinator.generation import eos_ids, vocab_size
    from swarm.transport import open_host
    from swarm.transport.identity import claim_key

    model = await _load_model(ring, config)
    key, _ = claim_key(config.listen.key_path or cache_root() / "keys" / "coordinator.key",
                       fallback=config.listen.key_path is None)
    shut_out = _exclusions(model.resolved.path) if config.ring.bootstrap else None
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as p2p, trio.open_nursery() as nursery:
        ring, discovery, infos = await _check_ring(p2p, nursery, ring, model, config, shut_out)
        resolved, max_ctx = model.resolved, min(i.max_ctx for i in infos)
        state = ServeState(config=config, ring=ring, host=p2p, nursery=nursery, tokenizer=model.tokenizer,
                           model_id=resolved.name, model_dir=resolved.path, num_layers=model.num_layers,
                           model_digest=model.digest, stop_ids=eos_ids(resolved.path, model.tokenizer),
                           max_ctx=max_ctx, vocab_size=vocab_size(resolved.path), key=key, discovery=discovery,
                           max_prompt_chars=max_prompt_chars(model.tokenizer, max_ctx), shut_out=shut_out)
        if discovery is not None:  # the dashboard's layer coverage (and the proofs it shows) come from the DHT
            from swarm.serve.dashboard import SwarmCoverage

            state.coverage = SwarmCoverage(discovery.dht, judge=_proof_judge(state))
            await nursery.start(state.coverage.run)
        state.pool = ClientPool(state, config.ring.max_concurrency)
        from swarm.serve.metrics import ServeMetrics

        state.metrics = ServeMetrics(state)
        return await _listen(state, sock, [i.entry() for i in infos], shutdown, task_status)


def _exclusions(model_dir: Path):
    """The server's ``swarm.auditor.exclusions.Exclusions`` (one per process): a fraud proof read from
    the DHT shuts a stage out of routing, rerouting and heals only once re-run on ``model_dir``."""
    from swarm.auditor.exclusions import Exclusions
    from swarm.auditor.judge import Blocks

    return Exclusions(Blocks(model_dir))


def _proof_judge(state: ServeState):
    """The coverage reader's hook: the proof against every stage of the served model (if any) judged
    by the server's ``shut_out`` each time the records are read, so the dashboard shows proofs
    published after routing too."""
    dht, weights_id = state.discovery.dht, state.discovery.model_id

    async def judge(records) -> None:
        await state.shut_out.excluded(dht, [r.peer_id for r in records if r.model_id == weights_id])

    return judge


async def _load_model(ring: RingSpec, config: ServeConfig) -> _Model:
    """The model's tokenizer, layer count and manifest digest (converted or downloaded if need be),
    after asking the swarm whether it serves the model at all (with ``bootstrap``); and the receipt
    directories checked, before listening: every answered request gets its receipt.

    Raises:
        ConfigError / ModelError: the model, or a receipt directory, is not usable.
    """
    from transformers import AutoTokenizer

    from swarm.coordinator.jobs import check_receipt_dir
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest, resolve_model

    if config.ring.bootstrap:  # before converting or downloading the model: does the swarm serve it at all?
        from swarm.coordinator.routing import swarm_may_serve

        await swarm_may_serve(ring.model, config.ring.bootstrap)
    resolved = resolve_model(ring.model)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    num_layers = model_num_layers(resolved.path)
    digest = model_manifest_digest(resolved.path)
    if config.receipts.receipt_dir is not None:  # checked before listening: every answered request gets its receipt
        check_receipt_dir(config.receipts.receipt_dir)
    if config.receipts.dashboard_receipts is not None and not Path(config.receipts.dashboard_receipts).is_dir():
        raise ConfigError(f"--dashboard-receipts {config.receipts.dashboard_receipts}: not a directory")
    if config.receipts.audit_tally is not None:  # a tally that cannot be read fails now, not on the dashboard
        from swarm.auditor.tally import read_tally

        try:
            read_tally(config.receipts.audit_tally)
        except ConfigError as exc:
            raise ConfigError(f"--audits: {exc}") from None
    return _Model(resolved, tokenizer, num_layers, digest)


async def _check_ring(p2p: SwarmHost, nursery: trio.Nursery, ring: RingSpec, model: _Model, config: ServeConfig,
                      shut_out=None) -> tuple[RingSpec, tuple[SwarmDHT, str, tuple] | None, list[StageInfo]]:
    """The ring, whole, before we listen: routed from the swarm's DHT (with ``bootstrap``; the DHT
    runs in ``nursery`` from now on; the stages ``shut_out`` verified a fraud proof against left out),
    then every stage connected once (spares in for the lost ones).

    Returns:
        (the ring as healed, (dht, weights id, records) when routed else None, each stage's info).
    Raises:
        ConfigError / StageLost: no route, or a stage cannot be reached and no spare replaces it.
    """
    from swarm.config import cache_root
    from swarm.coordinator.ring import RingClient

    discovery = None
    if config.ring.bootstrap:
        from swarm.coordinator.routing import RouteContext, run_dht
        from swarm.discovery.client import discover_ring
        from swarm.weights.identify import model_id as weights_model_id

        from swarm.coordinator.measured import load_measured

        weights_id = await trio.to_thread.run_sync(weights_model_id, model.resolved.path, cache_root() / "manifests")
        dht = await nursery.start(run_dht, p2p, config.ring.bootstrap)
        found = await discover_ring(dht, ring.model, weights_id, model.num_layers, shut_out=shut_out,
                                    measured_layer_ms=load_measured(weights_id))
        ring, discovery = found.ring, RouteContext.of(dht, weights_id, found)
    probe = RingClient(p2p, ring, config.ring.hop_timeout_s, config.ring.connect_timeout_s, config.ring.heartbeat_s,
                       model_id=discovery.model_id if discovery else None)
    probe.shut_out = shut_out
    async with trio.open_nursery() as probe_nursery:
        try:
            infos = await probe.connect(model.num_layers, model.digest, probe_nursery, use_spares=True)
            ring = probe.healed_ring()
        finally:
            await probe.aclose()
            probe_nursery.cancel_scope.cancel()
    return ring, discovery, infos


async def _listen(state: ServeState, sock: socket.socket, ring_entries: list[dict], shutdown: Shutdown | None,
                  task_status) -> dict | None:
    """Serve ``build_app(state)`` with Hypercorn on ``sock`` until cancelled, or until ``shutdown``
    is requested: then drain, stop listening and return the drain's result."""
    from hypercorn.config import Config as HyperConfig

    from swarm.listen import quiet_accept_errors
    from swarm.serve.guard import default_max_connections, serve_http

    config = HyperConfig()
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 5.0  # after a drain: the last events of the streams still go out
    # hypercorn's idle timer runs from a connection's accept (or its last answer) to the next request's
    # headers: the header deadline and the keep-alive timeout in one; the body's is guard_app's
    life = state.config.lifecycle
    config.keep_alive_timeout = life.header_timeout_s
    max_connections = life.max_connections or default_max_connections()
    quiet_accept_errors()  # the ring's accept loops (libp2p) too: one line per condition, not a traceback a try
    log.info("serve.http max_connections=%d header_timeout_s=%g body_timeout_s=%g send_timeout_s=%g", max_connections,
             life.header_timeout_s, life.body_timeout_s, life.send_timeout_s)
    stop_listening, stopped = trio.Event(), trio.Event()

    async def http(task_status=trio.TASK_STATUS_IGNORED):
        await serve_http(build_app(state), config, sock, max_connections=max_connections,
                         body_timeout_s=life.body_timeout_s, send_timeout_s=life.send_timeout_s,
                         shutdown_trigger=stop_listening.wait,
                         task_status=task_status)
        stopped.set()

    binds = await state.nursery.start(http)
    url = binds[0] if binds else f"http://{state.config.listen.host}:{state.config.listen.port}"
    if shutdown is not None:
        shutdown.serving = True
    task_status.started({"url": url, "model": state.model_id, "ring": ring_entries})
    if shutdown is None:
        await trio.sleep_forever()
    await shutdown.requested.wait()
    done = await drain(state, shutdown.timeout_s)
    stop_listening.set()
    with trio.move_on_after(config.graceful_timeout + 1.0):
        await stopped.wait()
    state.nursery.cancel_scope.cancel()
    return done
