"""Layer ranges: parsing, validation and tiling. Standard library only.

A stage holds the half-open range of decoder layers ``[start, end)``; it is written ``start:end``
on the command line and printed ``[start, end)``. A ring is valid only when its ranges tile
``[0, L)`` exactly: no gap, no overlap, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.errors import ConfigError


@dataclass(frozen=True, order=True)
class LayerRange:
    """Half-open range of decoder layers ``[start, end)`` held by one stage."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or not isinstance(self.end, int):
            raise ConfigError(f"layer range bounds must be integers, got {self.start!r}:{self.end!r}")
        if self.start < 0 or self.end <= self.start:
            raise ConfigError(f"layer range [{self.start}, {self.end}) is empty or negative")

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse ``"start:end"`` (e.g. ``"12:24"``).

        Raises:
            ConfigError: if the text is not two integers separated by ':' or the range is empty.
        """
        if isinstance(text, (list, tuple)) and len(text) == 2:
            return cls(int(text[0]), int(text[1]))
        parts = str(text).strip().split(":")
        if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ConfigError(f"layer range {text!r} is not of the form start:end (e.g. 12:24)")
        return cls(int(parts[0]), int(parts[1]))

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    def check_within(self, num_layers: int) -> None:
        """Raise ConfigError unless this range lies inside ``[0, num_layers)``."""
        if self.end > num_layers:
            raise ConfigError(f"layer range {self} is out of bounds: the model has {num_layers} layers [0, {num_layers})")

    def as_list(self) -> list[int]:
        return [self.start, self.end]


def check_tiling(ranges: list[LayerRange], num_layers: int) -> None:
    """Check that ``ranges``, in ring order, tile ``[0, num_layers)`` exactly.

    Raises:
        ConfigError: naming the first gap, overlap or overrun, with the stage index.
    """
    if not ranges:
        raise ConfigError("the ring has no stages")
    if sorted(ranges) != list(ranges):
        try:
            check_tiling(sorted(ranges), num_layers)
        except ConfigError:
            pass
        else:
            order = ", ".join(str(r) for r in ranges)
            raise ConfigError(f"stages are listed out of order ({order}): list them in layer order, starting at 0")
    expected = 0
    for i, r in enumerate(ranges):
        if r.start > expected:
            raise ConfigError(f"gap in the ring: layers [{expected}, {r.start}) are held by no stage (before stage {i} {r})")
        if r.start < expected:
            raise ConfigError(f"overlap in the ring: stage {i} {r} starts at {r.start} but layers up to {expected} are already held")
        expected = r.end
    if expected < num_layers:
        raise ConfigError(f"gap in the ring: layers [{expected}, {num_layers}) are held by no stage (after the last stage)")
    if expected > num_layers:
        raise ConfigError(f"the ring overruns the model: the last stage ends at {expected} but the model has {num_layers} layers")


def even_split(num_layers: int, num_stages: int) -> list[LayerRange]:
    """Split ``[0, num_layers)`` into ``num_stages`` contiguous ranges differing by at most one layer."""
    if num_stages < 1 or num_stages > num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        out.append(LayerRange(start, end))
        start = end
    return out
