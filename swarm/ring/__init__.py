"""The coordinator's connections to a ring: dial and check stages, sessions, chunks, probes, swaps.

``RingClient`` holds two streams per stage (data: forward frames, session replies and the tail's
results; control: cancel and progress probes), one reader task per stream funnelling
``(stage, generation, frame)`` into one channel, the ring check at connect (each stage reports the
range, model and PeerId the ring file claims; the ranges tile ``[0, L)``), heartbeat probes while
waiting for a result (a frozen stage is detected in about two heartbeats, not at the hop timeout),
and swapping a warm spare into a ring position (``swap``; frames of the replaced connection are
ignored from then on). Glue over ``swarm.transport`` and ``swarm.wire`` (which loads torch for tensors).

Layout (each module's docstring says what it owns and may import):

- ``client``  ``RingClient``: sessions, chunks, results, cancels, receipts
- ``links``   ``StageInfo``, dialing and checking each stage, reader tasks, receiving frames
- ``probe``   progress probes, warm spares, swapping a link (heal support)
"""

from swarm.ring.client import RingClient
from swarm.ring.links import StageInfo

__all__ = ["RingClient", "StageInfo"]
