"""``swarm peers``: the swarm as a table: per model a layer-coverage map, per stage its record.

Owns: records grouped by model, the coverage per layer (``coverage``) and the text table or JSON document
(``render``). Reading the records is ``SwarmDHT.read_records``; RTTs are ``probe_rtts``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swarm.discovery.records import StageRecord


def coverage(records: Sequence[StageRecord], num_layers: int, states: tuple[str, ...] = ("online",)) -> list[int]:
    """How many stages in ``states`` hold each layer ``0 .. L-1``."""
    counts = [0] * num_layers
    for r in records:
        if r.state in states:
            for layer in range(r.layers[0], min(r.layers[1], num_layers)):
                counts[layer] += 1
    return counts


def uncovered(counts: list[int]) -> list[list[int]]:
    """The ``[start, end)`` layer ranges whose count in ``counts`` (from ``coverage``) is 0."""
    out, start = [], None
    for i, c in enumerate([*counts, 1]):
        if c == 0 and start is None:
            start = i
        elif c != 0 and start is not None:
            out.append([start, i])
            start = None
    return out


def _coverage_bar(counts: list[int]) -> str:
    # one character per layer: '.' uncovered, then the holder count (9+ shown as '+')
    return "".join("." if c == 0 else (str(c) if c < 10 else "+") for c in counts)


def summarize(records: Sequence[StageRecord], rtt_ms: Mapping[str, float], *, now: float | None = None,
              probed: bool = False, not_listed: str = "", audits: Mapping[str, dict] | None = None) -> dict:
    """The JSON document of ``swarm peers --json``: ``{"models": [{model_id, name, num_layers,
    coverage, uncovered, stages: [...]}], "not_listed": str}``, models sorted by id, stages by range.

    Args:
        records: validated records.
        rtt_ms: PeerId -> this client's round trip in ms, for the stages that answered.
        now: the swarm's unix time; given, each stage has ``expires_in_s`` (seconds its record
            stays valid unless republished).
        probed: every record's stage was pinged: one absent from ``rtt_ms`` did not answer
            (``"answered": false``) and is not counted in ``coverage``. False: ``answered`` is None.
        not_listed: a line on the providers whose records were not valid (``ReadReport.describe``).
        audits: PeerId -> ``{audited, passed, failed, proof}`` (an auditor's tally; the state of the fraud
            proof against it on the DHT): each stage's ``audit`` (None where nothing is known).
    """
    models: dict[str, list[StageRecord]] = {}
    for r in records:
        models.setdefault(r.model_id, []).append(r)
    out = []
    for model_id, recs in sorted(models.items()):
        num_layers = max(r.num_layers for r in recs)
        counts = coverage([r for r in recs if not probed or r.peer_id in rtt_ms], num_layers)
        stages = [{"peer_id": r.peer_id, "layers": list(r.layers), "state": r.state, "addrs": list(r.addrs),
                   "throughput_tps": round(r.throughput_tps, 2), "sessions": r.sessions,
                   "free_kv_mib": round(r.free_kv_bytes / 2**20, 1), "dtype": r.dtype, "device": r.device,
                   "version": r.version, "rtt_ms": None if r.peer_id not in rtt_ms else round(rtt_ms[r.peer_id], 2),
                   "answered": (r.peer_id in rtt_ms) if probed else None,
                   "expires_in_s": None if now is None else round(r.expires_at - now, 1),
                   "audit": (audits or {}).get(r.peer_id)}
                  for r in sorted(recs, key=lambda r: (r.layers, r.peer_id))]
        names = sorted({r.model_name for r in recs})
        out.append({"model_id": model_id, "name": names[0] if len(names) == 1 else names, "num_layers": num_layers,
                    "coverage": counts, "uncovered": uncovered(counts), "stages": stages})
    return {"models": out, "not_listed": not_listed}


def _audit_text(a: dict | None) -> str:
    if not a:
        return "-"
    counts = "-" if a.get("audited") is None else f"{a['audited']}/{a['passed']}/{a['failed']}"
    if a.get("unavailable"):  # audits it could not answer, restarted since the job: not failures
        counts += f", {a['unavailable']} unavailable"
    return counts + (f", proof {a['proof']}" if a.get("proof") else "")


def render(summary: dict) -> str:
    """Plain-text tables of a ``summarize`` document."""
    lines = []
    for m in summary["models"]:
        name = m["name"] if isinstance(m["name"], str) else "/".join(m["name"])
        silent = sum(1 for s in m["stages"] if s.get("answered") is False)
        lines.append(f"model {name} (id {m['model_id'][:16]}), {m['num_layers']} layers, "
                     f"{len(m['stages'])} stage(s)" + (f", {silent} not answering" if silent else ""))
        probed = any(s.get("answered") is not None for s in m["stages"])
        legend = "no online stage that answered" if probed else "no online stage"
        lines.append(f"  coverage  {_coverage_bar(m['coverage'])}   ('.' = {legend})")
        if m["uncovered"]:
            lines.append("  uncovered " + ", ".join(f"[{a}, {b})" for a, b in m["uncovered"]))
        lines.append(f"  {'peer':<14} {'layers':<10} {'state':<9} {'tok/s':>8} {'sess':>5} {'free KV MiB':>12} "
                     f"{'rtt ms':>9} {'expires':>8}  device  audited/passed/failed")
        for s in m["stages"]:
            rtt = ("no answer" if s.get("answered") is False else "-") if s["rtt_ms"] is None else f"{s['rtt_ms']:.1f}"
            expires = "-" if s.get("expires_in_s") is None else f"{s['expires_in_s']:.0f} s"
            lines.append(f"  ..{s['peer_id'][-12:]:<12} [{s['layers'][0]}, {s['layers'][1]}){'':<{max(0, 6 - len(str(s['layers'][0])) - len(str(s['layers'][1])))}}"
                         f" {s['state']:<9} {s['throughput_tps']:>8.1f} {s['sessions']:>5} {s['free_kv_mib']:>12.1f} "
                         f"{rtt:>9} {expires:>8}  {s['device']}/{s['dtype']}  {_audit_text(s.get('audit'))}")
        if silent:
            lines.append("  'no answer': the stage did not answer a ping from here (it may have died: its record "
                         "stays until 'expires' unless it republishes)")
    if summary.get("not_listed"):
        lines.append(f"not listed: {summary['not_listed']}")
    return "\n".join(lines)
