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


_LAYOUTS: dict[tuple, Layout] = {}


def pack(tree: Any) -> tuple[dict[str, np.ndarray], Layout]:
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    parts: dict[str, list[np.ndarray]] = {}
    for a in arrays:
        parts.setdefault(a.dtype.str, []).append(a.reshape(-1))
    signature = (treedef, *((a.dtype.str, a.shape) for a in arrays))
    layout = _LAYOUTS.get(signature)
    if layout is None:  # one object per signature: the jit cache then matches it by identity
        sizes: dict[str, int] = {}
        entries = []
        for a in arrays:
            entries.append((a.dtype.str, sizes.get(a.dtype.str, 0), a.shape))
            sizes[a.dtype.str] = sizes.get(a.dtype.str, 0) + a.size
        layout = _LAYOUTS[signature] = Layout(treedef, tuple(entries))
    return {k: np.concatenate(v) for k, v in parts.items()}, layout


def unpack(buffers: dict[str, jax.Array], layout: Layout) -> Any:
    leaves = [
        buffers[key][offset : offset + int(np.prod(shape, dtype=np.int64))].reshape(shape)
        for key, offset, shape in layout.leaves
    ]
    return jax.tree.unflatten(layout.treedef, leaves)
