"""What both device proposers (draft model, EAGLE head) need to decode one token a row on their own
KV pool: the flat batch's metadata recut to one query token per row, and each row's slot at a position."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from pallas_kernels.paged_tiles import kernel_work_list, tile_plan
from serve.core.runner.inputs import StepInputs


def one_token_rows(inputs: StepInputs, kv_max: Int[Array, " S"], block_size: int) -> StepInputs:
    """`inputs` with one query token per row; the tile plan's pages reach `kv_max` keys a row."""
    s = inputs.kv_lens.shape[0]
    cu = jnp.minimum(jnp.arange(s + 1), s).astype(jnp.int32)
    plan = tile_plan(cu, kv_max, inputs.block_tables, block_size, s, 1, jnp) if inputs.plan is not None else None
    work = kernel_work_list(cu, s, 1, jnp) if inputs.work is not None else None
    return dataclasses.replace(inputs, cu_q_lens=cu, plan=plan, work=work)


def row_slots(
    tables: Int[Array, "S W"], pos: Int[Array, " S"], active: Bool[Array, " S"], block_size: int
) -> jax.Array:
    """Each row's KV slot at `pos` through its block table (-1 where not active: nothing written)."""
    rows = jnp.arange(tables.shape[0])
    block = tables[rows, jnp.minimum(pos // block_size, tables.shape[1] - 1)]
    return jnp.where(active, block * block_size + pos % block_size, -1)
