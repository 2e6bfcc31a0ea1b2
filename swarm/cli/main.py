"""The ``swarm`` command: parse arguments, build a config, call the daemon or tool. Thin.

Subcommands: ``stage``, ``coordinate``, ``demo``, ``serve``, ``bootstrap``, ``relay``, ``peers``, ``model import``,
``keygen``, ``id prove|verify``, ``receipts verify|watch``. Each returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from swarm.config import QUANTIZE_SCHEMES
from swarm.errors import ConfigError, SwarmError, collapse
from swarm.cli.output import TextOut, rate_text, receipt_line, spec_summary
from swarm.serve.config import PREFIX_HELP, WIRE_DTYPE_HELP, WIRE_DTYPES
from swarm.ranges import LayerRange

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def _stage_command(sub) -> None:
    from swarm.config import StageConfig

    p = sub.add_parser("stage", help="serve one block of a model's layers to the ring",
                       description="Load layers [start, end) of a model and serve them over libp2p. Prints "
                                   "SWARM_STAGE_READY {json} once listening, or SWARM_STAGE_FATAL {json} and exits "
                                   "1 (2 with --check, for a port in use, or a cache it cannot write).")
    p.error = lambda message: _stage_usage_error(p, message)  # a supervisor still gets one FATAL line
    p.add_argument("--check", action="store_true",
                   help="preflight only, no networking: model, tensors of the range, dtype, device, key file, "
                        "memory; prints SWARM_STAGE_OK {json} and exits 0, or SWARM_STAGE_FATAL and exits 2")
    groups = StageConfig.add_cli_args(p)  # every setting's flag, declared with the setting in swarm.config
    groups["membership"].add_argument("--max-memory", metavar="SIZE",
                                      help="--mem-budget-mb as a size: 12GB (10^9 bytes), 12GiB (2^30), 512MB "
                                           "(`swarm plan` shows what a layer costs)")


def _stage_usage_error(parser, message: str):
    """argparse's error for ``swarm stage``, plus the FATAL line the daemon contract promises."""
    sys.stdout.write(f"SWARM_STAGE_FATAL {json.dumps({'reason': message}, sort_keys=True)}\n")
    sys.stdout.flush()
    parser.print_usage(sys.stderr)
    print(f"swarm stage: error: {message}", file=sys.stderr)
    sys.exit(2 if "--check" in sys.argv else 1)


def _add_spec_flags(p) -> None:
    g = p.add_argument_group("speculative decoding (output stays token-identical to greedy)")
    g.add_argument("--draft", default="none", help="drafter: none, ngram (prompt lookup) or model:PATH "
                                                    "(a small model sharing the tokenizer); default none")
    g.add_argument("--k", type=int, help="draft tokens per verify chunk (default 4 with a drafter, 0 without)")
    g.add_argument("--depth", type=int, default=1, help="verify chunks in flight at once (default 1)")
    g.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt positions per prefill chunk (default 128: chunks pipeline across the stages, "
                        "and a 4,000-token prompt on a 3-stage ring had its first token soonest at 128 of 64, "
                        "128 and 256)")
    s = p.add_argument_group("sampling (default: greedy); replayable: the tail draws position n with noise "
                             "keyed by (seed, n)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--wire-dtype", choices=list(WIRE_DTYPES), help=WIRE_DTYPE_HELP)


SHADOW_HELP = ("open each session also at the warm spare of every stage that has one, as a shadow: the stage "
               "before it mirrors every frame to it, so a heal onto it refills (almost) nothing. Costs each spare "
               "the compute of its stage and each predecessor one more copy of every frame on its uplink; a slow "
               "or dead shadow is dropped, never slowing the ring (default: off)")


def _coordinate_parser(sub) -> None:
    p = sub.add_parser("coordinate", help="generate text with a running ring or swarm",
                       description="Connect to the stages listed in a ring file (--ring), or route through the "
                                   "swarm (--model and --bootstrap: stages found on the DHT, chain chosen by "
                                   "measured latency), check them, and generate.")
    p.add_argument("--ring", type=Path, help="ring YAML file (model, stages, spares)")
    p.add_argument("--model", help="with --bootstrap: the model (local directory, .gguf, smollm2-135m); its "
                                   "weights' id selects the stages")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="route through the swarm joined at this bootstrap node (repeatable); no ring file needed")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming text")
    p.add_argument("--key", type=Path, help="coordinator identity key (default: $SWARM_CACHE/keys/coordinator.key)")
    p.add_argument("--hop-timeout-s", type=float, default=60.0,
                   help="longest wait for one result while every stage still answers heartbeats")
    p.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="after this much silence stages are probed; one that does not answer within twice it is "
                        "treated as lost and healed onto a spare from the ring file (default 1.0)")
    p.add_argument("--no-heal", dest="heal", action="store_false", help="fail instead of healing onto spares")
    p.add_argument("--shadow", action="store_true", help=SHADOW_HELP)
    p.add_argument("--session", type=Path, metavar="FILE",
                   help="continue the conversation kept in FILE (created if missing) and add this turn to it: "
                        "with --chat the history goes through the chat template, else the prompt is appended as "
                        "plain text; the stages' prefix caches make only the new part cost a prefill")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help=PREFIX_HELP)
    _add_receipt_flags(p)
    _add_spec_flags(p)


def _add_receipt_flags(p) -> None:
    g = p.add_argument_group("receipts (who computed what, signed by each node's key)")
    g.add_argument("--receipt-dir", type=Path, default=Path("receipts"),
                   help="write the signed job receipt to DIR/<job_id>.json (default: receipts/)")
    g.add_argument("--no-receipt", dest="receipt", action="store_false",
                   help="no receipt: stages keep no digests for this job")


def _bootstrap_parser(sub) -> None:
    for p in (sub.add_parser("bootstrap", help="run a node that only serves the swarm's DHT (where members join)",
                             description="Serve the swarm's Kademlia DHT (protocol /swarm/kad/1.0.0) and nothing "
                                         "else. Prints SWARM_BOOTSTRAP_READY {json} with its peer_id and addrs: give "
                                         "one of those addrs to stages and clients as --bootstrap. Stops on SIGTERM "
                                         "or Ctrl-C."),
              sub.add_parser("relay", help="run a relay for stages behind NAT (also a DHT bootstrap node)",
                             description="Relay circuits (libp2p circuit relay v2, no data or time caps: a circuit "
                                         "ends only when one of its ends closes it) for stages that cannot be dialed, "
                                         "and serve the swarm's DHT like `swarm bootstrap`. Prints SWARM_RELAY_READY "
                                         "{json} with its peer_id and addrs: give one of those addrs to stages behind "
                                         "NAT as --relay (and to anyone as --bootstrap). Run it where it can be "
                                         "dialed (a public address or a port forward). Stops on SIGTERM or Ctrl-C.")):
        _daemon_args(p, p.prog.rsplit(" ", 1)[-1])


def _daemon_args(p, role: str) -> None:
    p.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                   help="TCP multiaddr to listen on (repeatable; default /ip4/127.0.0.1/tcp/0; use "
                        "/ip4/0.0.0.0/tcp/4001 to be reachable from other machines)")
    p.add_argument("--key", type=Path, help=f"identity key (default: $SWARM_CACHE/keys/{role}.key): a stable "
                                            "PeerId keeps the address you handed out valid")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="another bootstrap node to join (repeatable)")
    p.add_argument("--announce-addr", action="append", default=[], metavar="MULTIADDR",
                   help="advertise this /ip4/H/tcp/P instead of the bound address (repeatable)")


def _peers_parser(sub) -> None:
    p = sub.add_parser("peers", help="show the swarm: layer coverage per model and every stage's record",
                       description="Join the DHT as a client, read every stage's signed record (of one model with "
                                   "--model), measure the round trip to each, and print a coverage map and a table.")
    p.add_argument("--bootstrap", action="append", default=[], required=True, metavar="MULTIADDR",
                   help="bootstrap node to join through (repeatable)")
    p.add_argument("--model", help="only this model (local directory, .gguf, smollm2-135m)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--key", type=Path, help="identity key (default: $SWARM_CACHE/keys/client.key)")
    p.add_argument("--timeout-s", type=float, default=5.0, help="deadline for reading records (default 5)")
    p.add_argument("--audits", type=Path, metavar="FILE",
                   help="an auditor's tally (`swarm audit run --tally FILE`): audited / passed / failed per stage")


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="start a local ring on loopback and generate",
                       description="Start N stage processes on 127.0.0.1 with an even split of layers, run the "
                                   "coordinator, print text, tokens/s and the ring, then stop every process.")
    p.add_argument("--model", default="smollm2-135m",
                   help="the model: a local Hugging Face directory, a .gguf file, a hub id or smollm2-135m "
                        "(default %(default)s)")
    p.add_argument("--stages", type=int, default=3,
                   help="stage processes, the model's layers split evenly among them (default %(default)s)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: \"%(default)s\")")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end instead of streaming text (default: text)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="every stage's dtype, as `swarm stage --dtype` (default %(default)s)")
    p.add_argument("--quantize", choices=list(QUANTIZE_SCHEMES),
                   help="every stage holds its Linear weights quantized (`swarm stage --quantize`; CPU)")
    p.add_argument("--ring-out", type=Path, help="where to write the ring file (default: a temp dir)")
    p.add_argument("--startup-timeout-s", type=float, default=180.0,
                   help="seconds to wait for every stage to load and print READY (default %(default)s)")
    p.add_argument("--serve", action="store_true",
                   help="instead of one generation, serve the OpenAI-compatible API over the local ring until Ctrl-C")
    p.add_argument("--port", type=int, default=8000, help="with --serve: the port (default 8000; 0 picks one)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="the demo's stages also join this swarm (repeatable) and announce themselves there; "
                        "`swarm peers --bootstrap ADDR` then shows them")
    h = p.add_argument_group("healing")
    h.add_argument("--spares", action="store_true", help="also start one warm spare per stage (same layers)")
    h.add_argument("--kill-stage", type=int, help="SIGKILL this stage (0-based) mid-answer, to watch the ring heal "
                                                  "(needs --spares to heal)")
    h.add_argument("--kill-after", type=int, default=16, help="new tokens before --kill-stage fires (default 16)")
    h.add_argument("--shadow", action="store_true", help=SHADOW_HELP + " (with --spares)")
    _add_receipt_flags(p)
    _add_spec_flags(p)


def _serve_command(sub) -> None:
    from swarm.serve.config import ServeConfig

    p = sub.add_parser("serve", help="serve an OpenAI-compatible API over a running ring or swarm",
                       description="Check the ring (a ring file, or a route through the swarm with --model and "
                                   "--bootstrap), then serve POST /v1/chat/completions and /v1/completions "
                                   "(stream or not), GET /v1/models, GET /health, GET /metrics (Prometheus) and GET /dashboard "
                                   "(a live page) on HOST:PORT. Each request "
                                   "gets its own session at every stage.")
    p.add_argument("--ring", type=Path, help="ring YAML file (model, stages, spares)")
    p.add_argument("--model", help="with --bootstrap: the model; its weights' id selects the stages")
    ServeConfig.add_cli_args(p)  # every setting's flag, declared with the setting in swarm.serve.config
    g = p.add_argument_group("speculative decoding (output stays token-identical)")
    g.add_argument("--draft", default="none", choices=["none", "ngram"], help="drafter (default none)")
    g.add_argument("--k", type=int, help="draft tokens per verify chunk (default 4 with a drafter)")
    g.add_argument("--depth", type=int, default=1, help="verify chunks in flight (default 1)")
    g.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt positions per prefill chunk; chunks pipeline across the stages (default 128)")


def _dashboard_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="serve the live dashboard alone: receipts and the swarm's layer coverage",
                       description="Serve the dashboard page (the one `swarm serve` has at /dashboard) without a "
                                   "server: over a directory of job receipts (each is verified as `swarm receipts "
                                   "verify` does and shown verified, or failed with the check that failed), and/or "
                                   "the swarm's layer coverage per model, read from its DHT every 5 s through a "
                                   "bootstrap node. It binds where you tell it (default loopback); keep it private.")
    p.add_argument("--receipts", type=Path, metavar="DIR", help="directory of job receipts")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="join the swarm's DHT through this node (repeatable) and show which stages hold which "
                        "layers of every model")
    p.add_argument("--key", type=Path, help="identity key (default: $SWARM_CACHE/keys/client.key)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")


def _model_parser(sub) -> None:
    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    imp = msub.add_parser("import", help="convert a model (e.g. a .gguf file) into a cached safetensors directory "
                                         "and print its path")
    imp.add_argument("src", help="a .gguf file, a local directory, smollm2-135m, or a hub id")


def _identity_parsers(sub) -> None:
    k = sub.add_parser("keygen", help="create a node identity key and print its PeerId",
                       description="Create an ed25519 identity key (file mode 0600) and print its libp2p PeerId on "
                                   "stdout. The same key is the node's libp2p identity and signs its receipts.")
    k.add_argument("--out", type=Path, help="key file to create (default: $SWARM_CACHE/keys/node.key)")
    k.add_argument("--force", action="store_true", help="replace an existing key (its PeerId is gone for good)")
    p = sub.add_parser("id", help="prove or check control of a PeerId")
    isub = p.add_subparsers(dest="id_cmd", required=True)
    pr = isub.add_parser("prove", help="sign a challenge nonce with a node key; prints the signature (hex)",
                         description="Print the hex ed25519 signature of 'swarm-id-proof/1\\n' + NONCE by the key, "
                                     "proving control of its PeerId (the PeerId is printed on stderr).")
    pr.add_argument("--key", type=Path, required=True, help="the node's key file (must exist, mode 0600)")
    pr.add_argument("--nonce", required=True, help="the verifier's challenge (any string)")
    ve = isub.add_parser("verify", help="check an id proof; exit 0 if valid, 1 if not",
                         description="Verify SIG against the ed25519 public key inlined in PEER_ID (no network).")
    ve.add_argument("peer_id", help="the PeerId that claims to have signed (12D3KooW...)")
    ve.add_argument("nonce", help="the challenge given to `swarm id prove --nonce`")
    ve.add_argument("sig", help="hex signature printed by `swarm id prove`")


def _receipts_parser(sub) -> None:
    p = sub.add_parser("receipts", help="verify or watch job receipts")
    rsub = p.add_subparsers(dest="receipts_cmd", required=True)
    v = rsub.add_parser("verify", help="verify job receipts; exit 0 if all pass, 1 naming the first failed check",
                        description="Check every signature, that the ring's ranges tile [0, L), that each stage's "
                                    "input digest equals its predecessor's output digest (from the coordinator's "
                                    "prompt frames to the tail's results), nonces, PeerIds and the output-id "
                                    "digest. Prints one line per file.")
    v.add_argument("files", nargs="+", type=Path, help="receipt files, or directories of them (*.json)")
    v.add_argument("--model", help="also check the model manifest digest and every stage's weight digest "
                                   "against this local copy of the model")
    w = rsub.add_parser("watch", help="live table of jobs as their receipts arrive in a directory")
    w.add_argument("dir", type=Path, nargs="?", default=Path("receipts"), help="receipt directory (default receipts/)")
    w.add_argument("--interval-s", type=float, default=1.0, help="rescan period (default 1 s)")
    w.add_argument("--once", action="store_true", help="print the table once and exit (1 if any receipt fails)")
    w.add_argument("--limit", type=int, default=50, help="newest jobs shown (default 50)")


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser (and its own subcommands'): an argument it does not take is its error, with its
    usage (``swarm keygen: error: unrecognized arguments: x``); argparse hands those up to ``swarm``'s."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="Peer-to-peer pipeline-parallel LLM inference.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Subcommand)
    _stage_command(sub)
    _coordinate_parser(sub)
    _demo_parser(sub)
    _model_parser(sub)
    _serve_command(sub)
    _dashboard_parser(sub)
    _bootstrap_parser(sub)
    _peers_parser(sub)
    _identity_parsers(sub)
    _receipts_parser(sub)
    from swarm.cli.audit import add_parser as _audit_parser

    _audit_parser(sub)
    from swarm.cli.plan import add_parser as _plan_parser

    _plan_parser(sub)
    _verbose_after_subcommands(parser)
    return parser


def _verbose_after_subcommands(parser: argparse.ArgumentParser) -> None:
    """Accept ``-v/--verbose`` after every (sub)subcommand too (``swarm peers ... -v``); counted
    into ``args.verbose`` by ``main``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                sub.add_argument("-v", "--verbose", dest="verbose_sub", action="count", default=argparse.SUPPRESS,
                                 help="log more (-v info, -vv debug)")
                _verbose_after_subcommands(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.verbose += getattr(args, "verbose_sub", 0)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(TextOut.break_line)
    # libp2p logs expected failures (a refused dial, a failed handshake) at ERROR with
    # multi-line detail; swarm reports them itself in one line. Show them with -v.
    logging.getLogger("libp2p").setLevel(level if args.verbose else logging.CRITICAL)
    if args.cmd in ("stage", "coordinate", "serve", "bootstrap", "relay", "peers", "demo", "dashboard", "audit"):
        import swarm.transport.host as transport_host  # importing libp2p resets its level: re-applied per host

        transport_host.LIBP2P_LOG_LEVEL = level if args.verbose else logging.CRITICAL
    if not args.verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:  # imported already (a zygote's fork): apply what its import would have read
        verbosity = sys.modules["transformers"].utils.logging
        verbosity.set_verbosity(verbosity.log_levels.get(os.environ.get("TRANSFORMERS_VERBOSITY", ""), logging.WARNING))
    try:
        try:
            code = {"stage": cmd_stage, "coordinate": cmd_coordinate, "demo": cmd_demo, "model": cmd_model,
                    "keygen": cmd_keygen, "id": cmd_id, "receipts": cmd_receipts, "serve": cmd_serve,
                    "audit": _cmd_audit, "plan": _cmd_plan,
                    "dashboard": cmd_dashboard,
                    "bootstrap": cmd_bootstrap, "relay": cmd_bootstrap, "peers": cmd_peers}[args.cmd](args)
            sys.stdout.flush()  # here, so a reader that closed the pipe early is met below, not at exit
            return code
        except BaseExceptionGroup as group:
            found = collapse(group)
            if not isinstance(found, (SwarmError, KeyboardInterrupt)):
                from swarm.config import cache_fault

                found = cache_fault(group) or group
            raise found from None
    except BrokenPipeError:  # stdout closed early (`swarm ... --json | head`): the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except (SwarmError, OSError) as exc:
        if not isinstance(exc, SwarmError):  # a refused write under the cache is one line; other OSErrors are bugs
            from swarm.config import cache_fault

            exc = cache_fault(exc) or exc
            if not isinstance(exc, SwarmError):
                raise
        if args.cmd == "stage":
            from swarm.stage.daemon import emit

            emit("FATAL", {"reason": str(exc)})
            return 2 if getattr(args, "check", False) else exc.exit_code
        else:
            print(f"swarm {args.cmd}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"swarm {args.cmd}: interrupted", file=sys.stderr)
        return 130
    finally:
        if "swarm.transport.identity" in sys.modules:  # the keys this command held (its exit frees them too)
            sys.modules["swarm.transport.identity"].release_keys()


def cmd_stage(args) -> int:
    from swarm.config import StageConfig, cache_root

    mem_budget_mb = args.mem_budget_mb
    if args.max_memory is not None:
        from swarm.model.plan import parse_size

        if mem_budget_mb is not None:
            raise ConfigError("give --max-memory or --mem-budget-mb, not both (they are the same budget)")
        if args.layers is not None:
            raise ConfigError("--max-memory sizes a stage that picks its layers: drop it or drop --layers")
        mem_budget_mb = parse_size(args.max_memory) / 2**20
    if args.layers is None and args.check:
        raise ConfigError("--check needs --layers (the block to check)")
    config = StageConfig.from_args(args, mem_budget_mb=mem_budget_mb,
                                   key_fallback=args.key_path is None and args.layers is None)
    if args.key_path is None:
        layers = config.model.layers
        key = cache_root() / "keys" / (f"stage-{layers.start}-{layers.end}.key" if layers else "stage-auto.key")
        config = replace(config, network=replace(config.network, key_path=key))
    from swarm.stage.daemon import run_check, run_stage

    return run_check(config) if args.check else run_stage(config)


def text_arg(value: str, flag: str) -> str:
    """A command-line argument that must be text, checked to be UTF-8.

    Python hands argv bytes that are not UTF-8 over as lone surrogates (``surrogateescape``), which
    no tokenizer takes. Raises ConfigError naming the flag, the first bad byte and its offset."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError as exc:
        at = exc.start
    try:
        raw = value.encode("utf-8", "surrogateescape")  # the bytes as they were given
        raw.decode("utf-8")
    except UnicodeError as exc:
        where = f"byte 0x{raw[exc.start]:02x} at offset {exc.start}" if isinstance(exc, UnicodeDecodeError) else \
            f"character {at}"
        raise ConfigError(f"{flag} is not UTF-8 text ({where}); convert it first, e.g. with iconv -t UTF-8") from None
    raise ConfigError(f"{flag} is not UTF-8 text (character {at})")


def cmd_coordinate(args) -> int:
    import trio

    from swarm.config import CoordinatorConfig, SamplingParams, SpecConfig
    from swarm.coordinator.generation import generate

    prompt = text_arg(args.prompt, "--prompt")  # before anything is dialed
    config = CoordinatorConfig(ring=_ring_or_swarm(args), max_new_tokens=args.max_new_tokens, chat=args.chat,
                               key_path=args.key,  # None: the default, or the next free slot beside it
                               hop_timeout_s=args.hop_timeout_s, spec=SpecConfig.from_args(args),
                               sampling=SamplingParams.from_args(args), wire_dtype=args.wire_dtype,
                               heartbeat_s=args.heartbeat_s, heal=args.heal, shadow=args.shadow,
                               receipt_dir=args.receipt_dir if args.receipt else None,
                               bootstrap=tuple(args.bootstrap), prefix_cache=args.prefix_cache,
                               session_file=args.session)
    on_text = None if args.json else TextOut.write
    result = trio.run(generate, config, prompt, on_text)
    if result.get("context_limited"):
        print(f"swarm coordinate: note: the model's context limit capped the answer at {result['new_tokens']} "
              "new tokens", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(f"[{result['new_tokens']} tokens, {rate_text(result)} decode, ttft {result['ttft_s']:.2f} s"
              f"{spec_summary(result)}]", file=sys.stderr)
        if result.get("receipt"):
            print(receipt_line(result["receipt"]), file=sys.stderr)
    return 0


def _ring_or_swarm(args):
    """The ring file's RingSpec, or (``--model`` with ``--bootstrap``) an empty one the DHT fills."""
    from swarm.config import RingSpec

    if args.ring is not None:
        if args.bootstrap:
            raise ConfigError("give either --ring FILE or --bootstrap ADDR (with --model), not both")
        return RingSpec.load(args.ring)
    if not args.bootstrap or not args.model:
        raise ConfigError("name the stages with --ring FILE, or route through a swarm with --model M --bootstrap ADDR")
    return RingSpec(model=args.model, stages=())


def cmd_bootstrap(args) -> int:
    from swarm.discovery.bootstrap import run_bootstrap
    from swarm.config import cache_root

    return run_bootstrap(args.key or cache_root() / "keys" / f"{args.cmd}.key", args.listen or ["/ip4/127.0.0.1/tcp/0"],
                         bootstrap=args.bootstrap, announce=args.announce_addr, relay=args.cmd == "relay")


def cmd_peers(args) -> int:
    import trio

    from swarm.auditor.tally import audit_column
    from swarm.config import cache_root
    from swarm.discovery.client import probe_rtts
    from swarm.discovery.dht import open_dht
    from swarm.discovery.peers import render, summarize
    from swarm.transport import open_host
    from swarm.transport.identity import claim_key

    model_id = None
    if args.model:
        from swarm.model.resolve import resolve_model
        from swarm.weights.identify import model_id as weights_model_id

        model_id = weights_model_id(resolve_model(args.model).path, cache_root() / "manifests")
    key, _ = claim_key(args.key or cache_root() / "keys" / "client.key", fallback=args.key is None)

    async def main():
        async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host:
            async with open_dht(host, server=False, bootstrap=args.bootstrap) as dht:
                # a census: every provider waited for (within --timeout-s), not a route's 90%
                records, report = await dht.read_records(model_id, timeout_s=args.timeout_s, quorum=1.0)
                proofs = await _proofs_of(dht, records, args.model)
                return records, report, await probe_rtts(dht, records), dht.clock(), proofs

    records, report, rtts, now, proofs = trio.run(main)
    audits = audit_column(args.audits, proofs)
    summary = summarize(records, rtts, now=now, probed=True, not_listed=report.describe() if report.dropped else "",
                        audits=audits)
    if args.json:
        print(json.dumps(summary))
    elif not records:
        what = f"model {args.model}" if args.model else "any model"
        why = f"; {report.describe()}" if report.providers else ""
        print(f"swarm peers: the swarm has no {'live ' if report.providers else ''}stage of {what} "
              f"(joined through {', '.join(args.bootstrap)}){why}")
    else:
        print(render(summary))
    return 0


async def _proofs_of(dht, records, model) -> dict[str, str]:
    """PeerId -> the state of the fraud proof against it on the DHT: ``verified`` (re-run on the local
    ``--model``), ``refused: ...``, or ``on the DHT`` (checked without weights only)."""
    from swarm.auditor.exclusions import Exclusions
    from swarm.auditor.judge import Blocks

    blocks = None
    if model:
        from swarm.model.resolve import resolve_model

        blocks = Blocks(resolve_model(model).path)
    shut_out = Exclusions(blocks)
    peers = [r.peer_id for r in records]
    await shut_out.excluded(dht, peers)
    out = {p: "verified" for p in shut_out.verified}
    out.update({p: "refused: " + why for p, why in shut_out.refused.items()})
    if blocks is None:  # nothing re-run: say which stages have a proof that checks without weights
        for p in peers:
            if await dht.proofs.read_one(p) is not None:
                out[p] = "on the DHT"
    return out


def cmd_demo(args) -> int:
    from swarm.cli.demo import run_demo

    args.prompt = text_arg(args.prompt, "--prompt")  # checked before any stage starts
    return run_demo(args)


def cmd_serve(args) -> int:
    import trio

    from swarm.config import SpecConfig
    from swarm.serve.app import serve_api
    from swarm.serve.config import ServeConfig
    from swarm.serve.lifecycle import Shutdown, drain_on_signals

    ring = _ring_or_swarm(args)
    config = ServeConfig.from_args(args, spec=SpecConfig.from_args(args))
    from swarm.listen import bind_tcp

    sock = bind_tcp(config.listen.host, config.listen.port)  # before anything loads: a taken port fails at once
    shutdown = Shutdown(timeout_s=config.lifecycle.drain_timeout_s)
    drained: dict = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(drain_on_signals, shutdown, config.lifecycle.drain_timeout_s)

            async def run(task_status):
                drained.update(await serve_api(ring, config, listen_socket=sock, shutdown=shutdown,
                                               task_status=task_status) or {})
                nursery.cancel_scope.cancel()  # drained: stop watching signals

            info = await nursery.start(run)
            n = len(info["ring"])
            print(f"swarm serve: {info['url']}/v1 (model {info['model']}, {n} stage{'' if n == 1 else 's'}; "
                  f"dashboard {info['url']}/dashboard, metrics {info['url']}/metrics); Ctrl-C stops", flush=True)

    try:
        trio.run(main)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:  # a second Ctrl-C stops at once
        if not isinstance(collapse(exc), KeyboardInterrupt):
            raise
        print("swarm serve: stopped", file=sys.stderr)
        return 0
    finally:
        sock.close()  # a no-op once hypercorn took it
    print(f"swarm serve: drained ({drained.get('requests_finished', 0)} requests finished, "
          f"{drained.get('requests_ended', 0)} ended at the deadline)", file=sys.stderr)
    return 0


def cmd_dashboard(args) -> int:
    import trio
    from hypercorn.config import Config as HyperConfig

    from swarm.config import cache_root
    from swarm.serve.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_SEND_TIMEOUT_S
    from swarm.serve.dashboard import SwarmCoverage, receipts_app
    from swarm.serve.guard import default_max_connections, serve_http

    if args.receipts is None and not args.bootstrap:
        raise ConfigError("swarm dashboard needs --receipts DIR, --bootstrap MULTIADDR, or both")
    if args.receipts is not None and not args.receipts.is_dir():
        raise ConfigError(f"--receipts {args.receipts}: not a directory")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    from swarm.listen import bind_tcp

    sock = bind_tcp(args.host, args.port)  # before joining the DHT: a taken port fails at once
    config = HyperConfig()
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # as serve: its start line once, via logging
    config.keep_alive_timeout = DEFAULT_HEADER_TIMEOUT_S  # slow clients bounded as swarm serve's defaults

    async def serve(coverage=None):
        async with trio.open_nursery() as nursery:
            if coverage is not None:
                await nursery.start(coverage.run)
            binds = await nursery.start(partial(  # serve_http owns the socket from here
                serve_http, receipts_app(args.receipts, coverage), config, sock,
                max_connections=default_max_connections(), body_timeout_s=DEFAULT_BODY_TIMEOUT_S,
                send_timeout_s=DEFAULT_SEND_TIMEOUT_S, shutdown_trigger=trio.sleep_forever))
            what = [f"receipts {args.receipts}"] if args.receipts else []
            what += [f"swarm via {args.bootstrap[0]}"] if args.bootstrap else []
            print(f"swarm dashboard: {binds[0]}/dashboard ({', '.join(what)}); Ctrl-C stops", flush=True)

    async def main():
        if not args.bootstrap:
            return await serve()
        from swarm.discovery.dht import open_dht
        from swarm.transport import open_host
        from swarm.transport.identity import claim_key

        key, _ = claim_key(args.key or cache_root() / "keys" / "client.key", fallback=args.key is None)
        async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, \
                open_dht(host, server=False, bootstrap=args.bootstrap) as dht:
            await serve(SwarmCoverage(dht))

    try:
        trio.run(main)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not isinstance(collapse(exc), KeyboardInterrupt):
            raise
        print("swarm dashboard: stopped", file=sys.stderr)
    finally:
        sock.close()  # a no-op once hypercorn took it
    return 0


def cmd_keygen(args) -> int:
    from swarm.config import cache_root
    from swarm.transport.identity import key_holder, load_or_create_key, peer_id_of

    path = args.out or cache_root() / "keys" / "node.key"
    if path.is_dir():
        raise ConfigError(f"--out {str(path)!r} is a directory; name the key file to create")
    if path.exists() or path.is_symlink():
        holder = key_holder(path)
        if holder is not None:  # replacing it would leave that node on a key nobody can load again
            raise ConfigError(f"{path} is in use by pid {holder}; stop that process first")
        if not args.force:
            try:
                existing = f" (PeerId {peer_id_of(load_or_create_key(path, create=False))})"
            except SwarmError:
                existing = ""
            raise ConfigError(f"{path} already exists{existing}; pass --force to replace it")
        path.unlink()
    key = load_or_create_key(path)
    print(peer_id_of(key))
    print(f"swarm keygen: wrote {path} (mode 0600)", file=sys.stderr)
    return 0


def _cmd_audit(args) -> int:
    from swarm.cli.audit import cmd_audit

    return cmd_audit(args)


def _cmd_plan(args) -> int:
    from swarm.cli.plan import cmd_plan

    return cmd_plan(args)


def cmd_id(args) -> int:
    from swarm.receipts import id_proof_message
    from swarm.transport.identity import load_or_create_key, peer_id_of, sign, verify_peer_signature

    if args.id_cmd == "prove":
        key = load_or_create_key(args.key, create=False)
        print(sign(key, id_proof_message(args.nonce)).hex())
        print(f"swarm id prove: signed by {peer_id_of(key)}", file=sys.stderr)
        return 0
    from swarm.transport.identity import public_key_of_peer

    try:
        public_key_of_peer(args.peer_id)
    except SwarmError:
        print(f"invalid: {args.peer_id!r} is not an ed25519 PeerId (12D3KooW...)")
        return 1
    try:
        sig = bytes.fromhex(args.sig)
    except ValueError:
        print(f"invalid: the signature is not hex ({len(args.sig)} characters)")
        return 1
    if verify_peer_signature(args.peer_id, id_proof_message(args.nonce), sig):
        print(f"valid: {args.peer_id} signed the nonce")
        return 0
    print(f"invalid: not a signature of this nonce by {args.peer_id}")
    return 1


def cmd_receipts(args) -> int:
    if args.receipts_cmd == "watch":
        from swarm.cli.watch import watch

        return watch(args.dir, args.interval_s, args.once, args.limit)
    from swarm.receipts import verify_files

    paths: list[Path] = []
    for f in args.files:
        if f.is_dir():
            paths += sorted(f.glob("*.json"))
        elif f.exists():
            paths.append(f)
        else:
            raise ConfigError(f"{f} does not exist")
    if not paths:
        raise ConfigError(f"no receipt files in {', '.join(map(str, args.files))}")
    expect = _local_expectations(args.model, paths) if args.model else {}
    failed = 0
    for path, res in verify_files(paths, **expect):
        if isinstance(res, SwarmError):
            failed += 1
            print(f"FAIL {path}: {res}")
        else:
            checked = ", weights match the local model" if args.model else ""
            print(f"{res.summary()}{checked} ({path})")
    if len(paths) > 1:
        print(f"{len(paths) - failed} of {len(paths)} receipts verified", file=sys.stderr)
    return 1 if failed else 0


def _local_expectations(model: str, paths: list[Path]) -> dict:
    """Digests a local copy of ``model`` gives: the manifest, and the weights of every range the
    receipts' rings name."""
    from swarm.model.block import block_tensor_names
    from swarm.model.resolve import model_manifest_digest, resolve_model, weights_digest

    resolved = resolve_model(model)
    ranges: set[tuple[int, int]] = set()
    for p in paths:
        try:
            ring = json.loads(p.read_bytes()).get("ring") or []
            ranges |= {(int(s["layers"][0]), int(s["layers"][1])) for s in ring}
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            continue  # verification reports the file
    digests = {}
    for a, b in sorted(ranges):
        try:
            r = LayerRange(a, b)
            digests[(a, b)] = weights_digest(resolved.path, block_tensor_names(resolved.path, r))
        except SwarmError:
            continue  # a range the model does not have: the ring check or the digest check fails
    return {"expect_model_digest": model_manifest_digest(resolved.path), "expect_range_digests": digests}


def cmd_model(args) -> int:
    from swarm.model.resolve import resolve_model

    resolved = resolve_model(args.src, progress=None)
    print(resolved.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
