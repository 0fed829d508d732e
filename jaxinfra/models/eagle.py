"""An EAGLE-style draft head: one decoder layer over the target's last hidden state and the next
token's embedding, read out through the target's own LM head.

At position t the head takes fc([embed(x[t+1]); f[t]]), where f[t] is the target's final-norm hidden
state, and predicts f[t+1]: the target's LM head over its output gives the distribution of x[t+2].
Drafting feeds the head its own output as the next feature. The head has its own attention (one
layer, the target's shape) and KV cache; it shares the target's embedding and LM head, so its
checkpoint holds only the fc, the layer and a norm (~1/L of the target's layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int
from safetensors.numpy import load_file, save_file

from jaxinfra.config import ModelConfig
from jaxinfra.models.layers import DecoderLayer, RMSNorm
from jaxinfra.models.params import normal_param
from pallas_kernels import AttentionMetadata, PagedKVCache

EAGLE_ARCHITECTURE = "EagleLlamaForCausalLM"  # config.json's architectures entry for a head directory


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's shape: the target's, with one (dense) decoder layer."""
    return target.replace(num_layers=1, num_experts=0)


class EagleHead(nnx.Module):
    """fc over [token embedding; target feature] -> one decoder layer -> norm (a predicted feature)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attn_impl: str | None = None) -> None:
        """`cfg`: the head's shape (head_config of the target's)."""
        e = cfg.hidden_size
        self.cfg = cfg
        self.fc = normal_param(rngs, (2 * e, e), ("mlp", "embed"), cfg.initializer_range, cfg.dtype)
        self.layer = DecoderLayer(cfg, rngs, attn_impl)
        self.norm = RMSNorm(e, cfg.rms_norm_eps, "embed", cfg.dtype)

    def __call__(
        self,
        embeds: Float[Array, "B T E"],
        features: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        cache: PagedKVCache | None = None,
    ) -> tuple[Float[Array, "B T E"], PagedKVCache | None]:
        """Predicted next features at each position (and the head's KV pool, updated, when given)."""
        x = jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1) @ self.fc[...].astype(embeds.dtype)
        x, updated, _ = self.layer(x, positions, metadata, cache)
        assert updated is None or isinstance(updated, PagedKVCache)
        return self.norm(x), updated


def is_eagle_dir(path: str | Path) -> bool:
    """A directory holding an EAGLE head (its config.json names EAGLE_ARCHITECTURE)."""
    config = Path(path) / "config.json"
    return config.is_file() and EAGLE_ARCHITECTURE in json.loads(config.read_text()).get("architectures", [])


def save_eagle_head(head: EagleHead, directory: str | Path) -> None:
    """config.json (the head's shape, HF names) and model.safetensors (float32, our parameter paths)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {**head.cfg.to_hf(), "architectures": [EAGLE_ARCHITECTURE]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    flat = nnx.to_flat_state(nnx.state(head, nnx.Param))
    tensors = {".".join(map(str, path)): np.asarray(jax.device_get(v.get_value()), np.float32) for path, v in flat}
    save_file(tensors, str(out / "model.safetensors"))


def load_eagle_head(
    directory: str | Path, target: ModelConfig, dtype: str | None = None, attn_impl: str | None = None
) -> EagleHead:
    """The head saved in `directory`, for `target`; a ValueError if it was trained for another shape."""
    where = Path(directory)
    if not is_eagle_dir(where):
        raise ValueError(f"{where} is not an EAGLE head directory (config.json architectures {EAGLE_ARCHITECTURE})")
    saved = ModelConfig.from_hf(where)
    for name in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
        if getattr(saved, name) != getattr(target, name):
            raise ValueError(
                f"EAGLE head {where}: {name} {getattr(saved, name)} differs from the target's {getattr(target, name)}"
            )
    cfg = head_config(target).replace(dtype=dtype or target.dtype)
    head = nnx.eval_shape(lambda: EagleHead(cfg, nnx.Rngs(0), attn_impl))
    tensors = load_file(str(where / "model.safetensors"))
    graphdef, state = nnx.split(head)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        if name not in tensors or tensors[name].shape != var.shape:
            raise ValueError(f"EAGLE head {where}: tensor {name} {var.shape} is missing or has another shape")
        flat.append((path, var.replace(jnp.asarray(tensors[name], cfg.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
