"""``swarm audit``: audit the stages of signed jobs, and re-check fraud proofs.

Owns: ``swarm audit run RECEIPT... --model DIR`` (the picked stages audited over the network, one line each,
proofs written to ``--proofs`` and published with ``--bootstrap``, counts added to ``--tally``) and ``swarm audit
verify PROOF... --model DIR`` (one pass each). Flags and exit codes: docs/audits.md.
"""

from __future__ import annotations

import json
import sys
from contextlib import AsyncExitStack
from pathlib import Path

from swarm.errors import ConfigError, ProofRefused, ReceiptInvalid


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="audit stages' work on signed jobs, or re-check fraud proofs",
                       description="Re-run a stage's layers on the inputs it opened and compare the bits, within "
                                   "a comparable reproducibility class.")
    asub = p.add_subparsers(dest="audit_cmd", required=True)
    r = asub.add_parser("run", help="audit the stages of job receipts (exit 1 when a stage failed, 2 when no stage "
                                    "could be audited)")
    r.add_argument("receipts", nargs="+", type=Path, help="job receipt files (receipts/<job>.json)")
    r.add_argument("--model", required=True, help="the model whose layers to re-run: a local directory, a .gguf "
                                                  "file or a built-in name, as `swarm stage --model` takes")
    r.add_argument("--rate", type=float, default=0.05, help="share of an identity's sessions audited (default 0.05)")
    r.add_argument("--first-sessions", type=int, default=20,
                   help="an identity's first sessions seen are all audited (default 20; counted within one run "
                        "of this command)")
    r.add_argument("--all-windows", action="store_true", help="open every window (default: the picked one and "
                                                                "those before it, which its KV cache needs)")
    r.add_argument("--proofs", type=Path, default=Path("proofs"), help="directory for fraud proofs (default proofs/)")
    r.add_argument("--key", type=Path, help="the auditor's node key (default: the cache's keys/auditor.key)")
    r.add_argument("--bootstrap", action="append", default=[], help="publish proofs on the DHT via this node")
    r.add_argument("--timeout-s", type=float, default=30.0, help="per audit request (default 30 s)")
    r.add_argument("--tally", type=Path, help="add this run's audited / passed / failed per stage to this JSON file "
                                              "(read by `swarm peers --audits`)")
    v = asub.add_parser("verify", help="re-check fraud proofs with local weights (exit 0 if all hold)")
    v.add_argument("proofs", nargs="+", type=Path, help="proof files (*.proof)")
    v.add_argument("--model", required=True, help="local model directory holding the accused's layers")


def cmd_audit(args) -> int:
    if args.audit_cmd == "verify":
        return _verify(args)
    return _run(args)


def _verify(args) -> int:
    from swarm import proofs
    from swarm.auditor.judge import Blocks, verify_proof

    blocks = Blocks(args.model)
    bad = 0
    for path in args.proofs:
        if not path.is_file():
            raise ConfigError(f"{path} is not a file")
        try:
            print(f"{verify_proof(proofs.decode(path.read_bytes()), blocks).line()} ({path})")
        except ProofRefused as exc:
            bad += 1
            against = f"; evidence against auditor {exc.against}" if exc.against else ""
            print(f"REFUSED ({exc.reason}) {path}: {exc}{against}")
    return 1 if bad else 0


def _run(args) -> int:
    import trio

    from swarm.config import cache_root

    if not 0.0 <= args.rate <= 1.0:
        raise ConfigError(f"--rate must be in [0, 1], got {args.rate}")
    jobs = []
    for path in args.receipts:
        try:
            jobs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the job receipt {path}: {exc}") from None
    key_path = args.key or cache_root() / "keys" / "auditor.key"
    from swarm.model.resolve import resolve_model

    args.model = resolve_model(args.model, progress=False).path  # a missing model fails here, in one line
    return trio.run(_audit_jobs, args, jobs, key_path)


async def _audit_jobs(args, jobs: list[dict], key_path: Path) -> int:
    from swarm import proofs
    from swarm.auditor.judge import Blocks
    from swarm.auditor.run import Auditor
    from swarm.transport import load_or_create_key, open_host

    from swarm.discovery.dht import open_dht

    key = load_or_create_key(key_path)
    failed = unavailable = audited = not_audited = 0
    async with open_host(key, ["/ip4/0.0.0.0/tcp/0"]) as host, AsyncExitStack() as stack:
        publish = None
        if args.bootstrap:
            dht = await stack.enter_async_context(open_dht(host, server=False, bootstrap=args.bootstrap))

            async def publish(proof: dict) -> None:
                stored = await dht.proofs.publish(proofs.encode(proof), proof["accused"])
                print(f"proof published on the DHT against {proof['accused']} ({stored} node(s) stored it)")

        async def keep(proof: dict) -> None:
            args.proofs.mkdir(parents=True, exist_ok=True)
            path = args.proofs / f"{proof['accused'][-12:]}-{proof['receipt']['job_id'][:16]}.proof"
            path.write_bytes(proofs.encode(proof))
            print(f"proof written: {path}")
            if publish is not None:
                await publish(proof)

        auditor = Auditor(host, key, Blocks(args.model), rate=args.rate, first_sessions=args.first_sessions,
                          all_windows=args.all_windows, timeout_s=args.timeout_s, publish=keep)
        for job in jobs:
            try:
                verdicts = await auditor.audit_job(job)
            except ReceiptInvalid as exc:
                print(f"SKIPPED job {str(job.get('job_id'))[:16]}: the job receipt does not verify: {exc}")
                continue
            for v in verdicts:
                print(v.line())
                failed += v.outcome in ("failed", "refused")
                unavailable += v.outcome == "unavailable"
                audited += v.outcome in ("passed", "failed", "refused")
                not_audited += v.outcome in ("not comparable", "unauditable")
        if args.tally:
            from swarm.auditor.tally import add_tally

            add_tally(args.tally, auditor.counts())
    print(f"{failed} stage(s) failed" + (f", {unavailable} unavailable (restarted since the job; not failed)"
                                         if unavailable else ""), file=sys.stderr)
    if not audited and not_audited:  # e.g. --model holds other weights than the job's: nothing was checked
        print(f"no stage was audited: {not_audited} not comparable with this auditor (see the lines above)",
              file=sys.stderr)
        return 2
    return 1 if failed else 0
