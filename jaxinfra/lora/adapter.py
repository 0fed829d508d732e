"""LoRA adapters around the model's projections: `apply_lora` (the math, for any caller), `LoraLinear`
(a wrapped weight the layers call through `linear`), and adding, merging and removing them."""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jaxtyping import Array, Float

from jaxinfra.lora.config import ATTENTION_MODULES, MLP_MODULES, LoraConfig
from jaxinfra.models import LlamaModel
from jaxinfra.models.layers import MLP
from jaxinfra.models.mixed_precision import weight_einsum
from jaxinfra.models.moe import MoE
from jaxinfra.quant.qlinear import WrappedLinear, linear

_N_IN = {"o_proj": 2}  # leading input dims of each weight ([H, D, E] for o_proj; 1 for the rest)


class LoraParam(nnx.Param):
    """An adapter matrix: in a model with adapters, the only parameters training updates."""


def apply_lora(
    spec: str,
    x: Float[Array, "*xs"],
    y: Float[Array, "*ys"],
    a: Float[Array, "*ins R"],
    b: Float[Array, "R ..."],
    scale: float,
    dropout: float = 0.0,
    key: jax.Array | None = None,
) -> Float[Array, "*ys"]:
    """y + scale * (dropout(x) @ A) @ B, where y is x's projection by the base weight (einsum `spec`,
    the weight's input dims first); A [in dims..., r], B [r, out dims...]."""
    xs, rest = spec.split(",")
    ws, outs = rest.split("->")
    r = next(c for c in string.ascii_letters if c not in spec)
    ins, out_dims = ws[: a.ndim - 1], ws[a.ndim - 1 :]
    mid = "".join(c for c in xs if c not in ins) + r
    if dropout and key is not None:
        keep = jax.random.bernoulli(key, 1.0 - dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - dropout), 0).astype(x.dtype)
    h = weight_einsum(f"{xs},{ins}{r}->{mid}", x, a)
    delta = weight_einsum(f"{mid},{r}{out_dims}->{outs}", h, b)
    return y + (scale * delta).astype(y.dtype)


class LoraLinear(WrappedLinear):
    """A frozen base weight W plus trainable A [in..., r] (uniform, as PEFT's) and B [r, out...] (zeros),
    sharded by W's logical axes: A by its input axes, B by its output axes."""

    def __init__(self, base: nnx.Param, n_in: int, rank: int, scale: float, dropout: float, rngs: nnx.Rngs) -> None:
        axes = base.get_metadata().get("logical_axes") or (None,) * base.ndim
        in_shape, out_shape = base.shape[:n_in], base.shape[n_in:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32, -bound, bound)
        self.base = base
        self.lora_a = LoraParam(a.astype(base.dtype), logical_axes=(*axes[:n_in], None))
        self.lora_b = LoraParam(jnp.zeros((rank, *out_shape), base.dtype), logical_axes=(None, *axes[n_in:]))
        self.scale = scale
        self.dropout = dropout

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[-1])

    def __call__(self, spec: str, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        a = self.lora_a[...]
        if key is not None and self.dropout:  # each adapter (and scanned layer) its own mask: A's bits
            bits = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(a.reshape(-1)[0]).astype(jnp.float32), jnp.uint32)
            key = jax.random.fold_in(key, bits)
        return apply_lora(spec, x, linear(spec, x, self.base), a, self.lora_b[...], self.scale, self.dropout, key)

    def merged(self) -> nnx.Param:
        """W + scale * A @ B as a plain parameter (W's dtype and axes)."""
        w = self.base[...]
        delta = jnp.tensordot(self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32), axes=1)
        value = (w.astype(jnp.float32) + self.scale * delta).astype(w.dtype)
        return nnx.Param(value, logical_axes=self.base.get_metadata().get("logical_axes"))


def split_params(params: dict, trains: Callable[[tuple], bool]) -> tuple[dict, dict]:
    """(the entries whose path `trains`, the rest) of a nested params dict."""
    flat = traverse_util.flatten_dict(params)
    parts = [{p: x for p, x in flat.items() if trains(p) == t} for t in (True, False)]
    return traverse_util.unflatten_dict(parts[0]), traverse_util.unflatten_dict(parts[1])


def join_params(trained: dict, frozen: dict) -> dict:
    """The inverse of split_params."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(trained)})


def _projections(model: LlamaModel) -> Iterator[tuple[nnx.Module, str, tuple]]:
    """(owner module, attribute, state path) of every projection an adapter may wrap."""
    for i, layer in enumerate(model.layers):
        for name in ATTENTION_MODULES:
            yield layer.attn, name, ("layers", i, "attn", name)
        mlp: nnx.Module | None = layer.mlp
        where: tuple = ("layers", i, "mlp")
        if isinstance(mlp, MoE):  # routed experts are not linears by name; the shared expert is
            mlp, where = mlp.shared, (*where, "shared")
        if isinstance(mlp, MLP):
            for name in MLP_MODULES:
                yield mlp, name, (*where, name)


def lora_layers(model: LlamaModel) -> list[tuple[tuple, LoraLinear]]:
    """(path of the wrapped weight in a plain model's state, adapter) of every adapter in `model`."""
    return [(path, w) for owner, name, path in _projections(model) if isinstance(w := getattr(owner, name), LoraLinear)]


def add_lora(model: LlamaModel, cfg: LoraConfig, rngs: nnx.Rngs) -> LlamaModel:
    """Wrap `cfg.target_modules` of every layer with fresh adapters (in place; returns `model`)."""
    if lora_layers(model):
        raise ValueError("lora: the model already has adapters")
    wrapped = 0
    for owner, name, path in _projections(model):
        if name not in cfg.target_modules:
            continue
        w = getattr(owner, name)
        if not isinstance(w, nnx.Param):
            raise ValueError(
                f"lora.target_modules: {'.'.join(map(str, path))} is quantized; adapters need dense weights"
            )
        setattr(owner, name, LoraLinear(w, _N_IN.get(name, 1), cfg.rank, cfg.scale, cfg.dropout, rngs))
        wrapped += 1
    if not wrapped:
        raise ValueError(f"lora.target_modules: none of {list(cfg.target_modules)} is a dense projection of this model")
    return model


def merge_lora(model: LlamaModel) -> LlamaModel:
    """Fold every adapter into its base weight (W + scale * A @ B) and drop it (in place)."""
    for owner, name, _ in _projections(model):
        if isinstance(w := getattr(owner, name), LoraLinear):
            setattr(owner, name, w.merged())
    return model


def unload_lora(model: LlamaModel) -> LlamaModel:
    """Drop every adapter, restoring the base weights unchanged (in place)."""
    for owner, name, _ in _projections(model):
        if isinstance(w := getattr(owner, name), LoraLinear):
            setattr(owner, name, w.base)
    return model
