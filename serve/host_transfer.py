"""One host-to-device copy per dtype for a step's many small input arrays.

Each array handed to a jitted function is its own transfer (tens of microseconds on CPU, more over
PCIe); a step has ~30. `pack` concatenates a pytree of numpy arrays into one flat buffer per dtype
plus a static `Layout`; `unpack`, inside the jit, slices them back out at no cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf lives: (dtype, offset, shape), in tree order. Hashable: a static jit argument."""

    treedef: Any
    leaves: tuple[tuple[str, int, tuple[int, ...]], ...]


def pack(tree: Any) -> tuple[dict[str, np.ndarray], Layout]:
    leaves, treedef = jax.tree.flatten(tree)
    parts: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, int] = {}
    entries = []
    for leaf in leaves:
        a = np.asarray(leaf)
        key = a.dtype.str
        entries.append((key, sizes.get(key, 0), a.shape))
        parts.setdefault(key, []).append(a.reshape(-1))
        sizes[key] = sizes.get(key, 0) + a.size
    return {k: np.concatenate(v) for k, v in parts.items()}, Layout(treedef, tuple(entries))


def unpack(buffers: dict[str, jax.Array], layout: Layout) -> Any:
    leaves = [buffers[key][offset:offset + int(np.prod(shape, dtype=np.int64))].reshape(shape)
              for key, offset, shape in layout.leaves]
    return jax.tree.unflatten(layout.treedef, leaves)
