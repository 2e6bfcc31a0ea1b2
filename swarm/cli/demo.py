"""``swarm demo``: a local ring on loopback, one generation, a clean shutdown.

Glue over ``swarm.cli.launch.LocalRing`` and ``swarm.coordinator.generation.generate``, printing through ``swarm.cli.output``;
nothing imports it but the CLI.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import trio
import yaml

from swarm.addrs import without_peer_id
from swarm.config import CoordinatorConfig, RingSpec, SamplingParams, SpecConfig, cache_root
from swarm.errors import ConfigError
from swarm.cli.launch import LocalRing
from swarm.cli.output import TextOut, rate_text, receipt_line, spec_summary
from swarm.ranges import even_split


def run_demo(args) -> int:
    """Start ``args.stages`` stages, generate once, print text, tokens/s and the ring. Returns 0."""
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    # checked before any process starts
    spec_config, sampling = SpecConfig.from_args(args), SamplingParams.from_args(args)
    if args.kill_stage is not None and not 0 <= args.kill_stage < args.stages:
        raise ConfigError(f"--kill-stage must name a stage 0..{args.stages - 1}, got {args.kill_stage}")
    if args.kill_after < 1:
        raise ConfigError(f"--kill-after must be >= 1 new token, got {args.kill_after}")
    if getattr(args, "serve", None):  # bound before any stage starts: a taken port fails at once
        from swarm.listen import bind_tcp

        with bind_tcp("127.0.0.1", args.port) as sock:
            return _run_demo(args, say, spec_config, sampling, sock)
    return _run_demo(args, say, spec_config, sampling, None)


def _run_demo(args, say, spec_config, sampling, sock) -> int:
    from swarm.coordinator.generation import generate
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import resolve_model

    if getattr(args, "shadow", False) and not args.spares:
        raise ConfigError("--shadow needs --spares: the shadows are the demo's warm spares")
    if getattr(args, "shadow", False) and getattr(args, "serve", None):
        raise ConfigError("--shadow is not used by --serve yet (swarm serve opens no shadows)")
    resolved = resolve_model(args.model)  # converts once (progress bar) before any stage starts
    num_layers = model_num_layers(resolved.path)
    ranges = even_split(num_layers, args.stages)
    say(f"swarm demo: {resolved.name} ({num_layers} layers) on {args.stages} stages: "
        + ", ".join(str(r) for r in ranges))
    extra = ["--dtype", args.dtype] + (["--quantize", args.quantize] if args.quantize else [])
    for addr in args.bootstrap:  # the demo's stages also join that swarm and announce themselves
        extra += ["--bootstrap", addr]
    procs = len(ranges) * (2 if args.spares else 1)
    threads = max(1, (os.cpu_count() or 1) // procs)
    # SIGTERM (a supervisor, `kill`) stops the demo as Ctrl-C does: the stages are reaped, the ring
    # file's directory removed (while --serve serves, its trio signal receiver takes SIGTERM instead)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    with tempfile.TemporaryDirectory(prefix="swarm-demo-") as tmp, \
            LocalRing(args.model, ranges, _free_key_dir(cache_root() / "keys" / "demo"), threads=threads,
                      extra_args=extra, startup_timeout_s=args.startup_timeout_s) as ring, \
            LocalRing(args.model, ranges if args.spares else [], _free_key_dir(cache_root() / "keys" / "demo-spares"),
                      threads=threads, extra_args=extra, startup_timeout_s=args.startup_timeout_s) as spares:
        spec = RingSpec(model=args.model, stages=ring.ring_spec().stages, spares=spares.ring_spec().stages)
        ring_path = args.ring_out or Path(tmp) / "ring.yaml"
        ring_path.write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
        say(f"ring file: {ring_path}" + ("" if args.ring_out else " (removed on exit; keep one with --ring-out)"))
        for sp in ring.stages:
            say(f"  stage {sp.layers}  {sp.ready['peer_id']}  {without_peer_id(sp.addr)}")
        for sp in spares.stages:
            say(f"  spare {sp.layers}  {sp.ready['peer_id']}  {without_peer_id(sp.addr)}")
        if args.serve:
            return _serve(spec, args, spec_config, sock)
        config = CoordinatorConfig(ring=spec, max_new_tokens=args.max_new_tokens, chat=args.chat,
                                   key_path=None, spec=spec_config,
                                   sampling=sampling, wire_dtype=args.wire_dtype, shadow=args.shadow,
                                   receipt_dir=args.receipt_dir if args.receipt else None)
        if not args.json:
            print(f"\nprompt: {args.prompt}\n")
        on_text = None if args.json else TextOut.write
        on_ids = _killer(ring, args) if args.kill_stage is not None else None
        result = trio.run(generate, config, args.prompt, on_text, on_ids)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n\n{result['new_tokens']} tokens, {rate_text(result)} decode, "
              f"time to first token {result['ttft_s']:.2f} s{spec_summary(result)}")
        for e in result.get("heal_events", []):
            print(f"healed: stage {e['stage']} [{e['layers'][0]}, {e['layers'][1]}) lost ({e['reason']}); "
                  f"spare {e['spare'][:16]}... swapped in {e['swap_s']:.2f} s, {e['replay_tokens']} tokens "
                  f"replayed in {e['replay_s']:.2f} s ({_replay_mode(e)}), {e['total_s']:.2f} s from detection to "
                  "resume")
        if result.get("receipt"):
            print(receipt_line(result["receipt"]))
            print(f"  check it yourself: swarm receipts verify {result['receipt']['path']}")
    return 0 if not result.get("receipt") or result["receipt"]["verified"] else 1


def _free_key_dir(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ...: the first whose stage keys no running process holds, so a
    second demo beside the first gets stages of its own PeerIds (the demo's identities matter to nobody)."""
    from swarm.transport.identity import key_holder

    for i in range(1, 65):
        d = base if i == 1 else base.with_name(f"{base.name}-{i}")
        if not any(key_holder(k) for k in d.glob("*.key")):
            return d
    return d


def _serve(spec: RingSpec, args, spec_config, sock) -> int:
    """``swarm demo --serve``: the OpenAI-compatible API over the local ring until Ctrl-C."""
    from swarm.serve.app import serve_api
    from swarm.serve.config import ServeConfig

    config = ServeConfig.of(host="127.0.0.1", port=args.port, key_path=None, spec=spec_config,
                            wire_dtype=args.wire_dtype)
    stopped = []

    async def on_sigterm(cancel_scope):  # as Ctrl-C: the stages are reaped, the ring file removed
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                stopped.append(True)
                cancel_scope.cancel()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_sigterm, nursery.cancel_scope)
            info = await nursery.start(lambda task_status: serve_api(spec, config, listen_socket=sock,
                                                                     task_status=task_status))
            url = info["url"]
            print(f"\nswarm demo: serving the OpenAI API at {url}/v1 (model {info['model']}); Ctrl-C stops.\n"
                  f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
                  f"'{{\"model\": \"{info['model']}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                  f"\"Hello!\"}}], \"max_tokens\": 32}}'\n  curl {url}/health", flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        stopped.append(True)
    if stopped:
        print("swarm demo: stopped", file=sys.stderr)
    return 0


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def _killer(ring: LocalRing, args):
    """An on_ids hook that SIGKILLs stage ``args.kill_stage`` after ``args.kill_after`` new tokens."""
    fired = []

    def on_ids(ids: list[int]) -> None:
        if len(ids) >= args.kill_after and not fired:
            fired.append(True)
            sp = ring.stages[args.kill_stage]
            TextOut.break_line()
            print(f"[swarm demo: killing stage {sp.layers} (pid {sp.proc.pid}) after {len(ids)} tokens]",
                  file=sys.stderr, flush=True)
            os.kill(sp.proc.pid, signal.SIGKILL)

    return on_ids


def _replay_mode(event: dict) -> str:
    """How a heal rebuilt the KV caches, in words."""
    if event.get("replay") == "shadow":
        return (f"the spare had shadowed the stage live: {event.get('refill_tokens', 0)} of them refilled, the other "
                "stages kept their KV caches")
    if event.get("replay") == "survivors_kept":
        return "by the spare alone: the other stages kept their KV caches"
    why = event.get("fallback")
    return "through every stage" + (f": {why}" if why else "")
