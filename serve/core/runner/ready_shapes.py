"""Which step shapes are compiled, and the smallest compiled one a batch fits.

While warm-up compiles the remaining shapes in the background, a batch pads to the smallest shape of
its kind that is ready and holds it (padding never changes a row's outputs), so the engine serves as
soon as the largest shape of each kind is compiled.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import NamedTuple


class Shape(NamedTuple):
    """One compiled step shape: `kind` is the jitted call ("step", "loop": the decode loop, "resample",
    "verify"), then the padded tokens, rows, block-table width and max_q_len."""

    kind: str
    tokens: int
    rows: int
    width: int
    q: int


def holds(shape: Shape, need: Shape, mixed: bool) -> bool:
    """Whether a batch padded to `need` also fits `shape`: same call, at least as many tokens, rows
    and columns, and the same query layout: with a prompt chunk (`mixed`), queries as long as the
    tokens; else `need.q` tokens a row."""
    if shape.kind != need.kind or shape.tokens < need.tokens or shape.rows < need.rows or shape.width < need.width:
        return False
    if mixed:
        return shape.q == shape.tokens
    return shape.q == need.q and shape.tokens == shape.rows * shape.q


def resample_shape(rows: int) -> Shape:
    """The resampler's shape for a step of `rows` rows (penalties, logit_bias, grammar masks)."""
    return Shape("resample", rows, rows, 0, 1)


class ReadyShapes:
    """The compiled shapes, added from compile threads and read by the step loop. `complete`: every
    shape a batch may need is compiled (or compiles on first use, with no warm-up): a batch takes its
    own shape."""

    def __init__(self) -> None:
        self._ready: set[Shape] = set()
        self._lock = threading.Lock()
        self.complete = True

    def add(self, shape: Shape) -> None:
        """Mark `shape` compiled (thread-safe)."""
        with self._lock:
            self._ready = self._ready | {shape}  # a new set: readers iterate the old one unlocked

    def __iter__(self) -> Iterator[Shape]:
        return iter(self._ready)

    def __contains__(self, shape: Shape) -> bool:
        return shape in self._ready

    def __len__(self) -> int:
        return len(self._ready)

    def pick(self, need: Shape, mixed: bool = False, resample: bool = False) -> Shape:
        """The smallest ready shape (fewest tokens, then rows, then columns) that holds `need` (a batch
        with a prompt chunk when `mixed`), with the resampler of as many rows when `resample`; `need`
        itself when every shape is compiled or none ready holds it (it then compiles on the spot)."""
        if self.complete:
            return need
        ready = self._ready
        fits = [s for s in ready if holds(s, need, mixed) and (not resample or resample_shape(s.rows) in ready)]
        return min(fits, key=lambda s: (s.tokens, s.rows, s.width), default=need)
