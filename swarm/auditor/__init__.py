"""The auditor role: re-running other stages' work on their opened inputs, and judging fraud proofs.

Imported by stage, coordinator, serve and cli. How an audit runs, and what it proves: docs/audits.md.

- ``judge``       with torch, no networking: blocks by range, a stage's opened rows judged, a proof re-checked
- ``run``         the networked auditor: fetch, judge, tally, publish
- ``exclusions``  whom routing, heals and placement shut out: identities with a proof this process re-ran
- ``tally``       the tally file: audited / passed / failed per stage, written by ``swarm audit run``
- ``offers``      a coordinator offering its signed job receipt to auditor-role stages
"""
