"""The auditor role: re-running other stages' work on their opened inputs, and judging fraud proofs.

Any process that can load a layer range's weights may audit the stages that serve it (``swarm audit``,
a warm spare with idle time): it picks receipts by a hash of the signed job receipt
(``swarm.proofs.pick``), opens windows (``swarm.openings``), re-runs the block
(``swarm.model.recompute``) within a comparable class, and turns a mismatch into a fraud proof
(``swarm.proofs``); :func:`swarm.auditor.judge.verify_proof` re-checks a proof with the weights.

Modules: ``judge`` (with torch, no networking: blocks by range, a stage's opened rows judged, a
proof re-checked), ``run`` (the networked auditor: fetch, judge, tally, publish), ``exclusions``
(who routing, heals and placement shut out: identities with a proof this process re-ran), ``tally``
(the tally file: audited / passed / failed per stage, written by ``swarm audit run``, read by
``swarm peers`` and ``swarm serve``), ``offers`` (a coordinator offering its signed job receipt to
auditor-role stages: ``swarm stage --audit-rate``, whose side is ``swarm.stage.auditor_role``).

Imported by stage, coordinator, serve and cli.
"""
