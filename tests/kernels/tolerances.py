"""Tolerances for float32 kernels checked against references that multiply at HIGHEST precision."""

import jax


def f32_atol(atol: float) -> float:
    """`atol` on CPU (interpret mode, exact float32 dots); on a GPU, where a float32 dot in a kernel or
    in XLA runs in TF32 (10-bit mantissa, Triton's and XLA's default), at least 2e-3 for outputs of
    order one: a TF32 rounding gives relative errors near 1e-3, far above float32's."""
    return atol if jax.default_backend() == "cpu" else max(atol, 2e-3)
