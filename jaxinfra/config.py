"""Model configuration: one dataclass for the Llama family, read from YAML presets or HF config.json
(each model_type's own fields by its registered family, jaxinfra.models.families)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from jaxinfra.yaml_config import load_config

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # the repository's configs/, shipped in the package
MODEL_PRESETS_DIR = CONFIGS_DIR / "models"

DTYPES = ("float32", "bfloat16", "float16")


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face defines it: Llama 3.1's ("llama3"), position interpolation
    ("linear"), dynamic NTK ("dynamic": the base grows with the sequence past the original length)
    and YaRN ("yarn": interpolated low frequencies, extrapolated high ones, cos/sin scaled)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp's bounds, in rotations over the original length
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn: cos/sin scale (None: from factor, mscale, mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the ramp's bounds to whole dimensions

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            supported = ", ".join(ROPE_TYPES)
            raise ValueError(f"rope_scaling.rope_type: unsupported {self.rope_type!r} (supported: {supported})")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and flags of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    attn_logit_softcap: float | None = None
    initializer_range: float = 0.02
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # mixture of experts (num_experts 0: every layer a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0  # each expert's MLP width; 0: intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (sigmoid-gated); 0: none
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # MoE in layers i with (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these (dense MLP)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id or ()))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        families = FAMILIES
        if self.model_type not in families:
            raise ValueError(f"ModelConfig.model_type: unsupported {self.model_type!r}; supported: {sorted(families)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig.sliding_window must be > 0 or null, got {self.sliding_window}")
        self._check_moe()

    def _check_moe(self) -> None:
        families = FAMILIES
        if (self.num_experts > 0) != families[self.model_type].moe:
            moe_types = sorted(t for t, f in families.items() if f.moe)
            raise ValueError(
                f"ModelConfig.num_experts must be > 0 exactly for the MoE model types {moe_types}, "
                f"got {self.num_experts} for {self.model_type!r}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"ModelConfig.shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}"
            )

    @property
    def context_length(self) -> int:
        """The longest sequence the model serves: max_position_embeddings, stretched by linear, dynamic
        and YaRN scaling (YaRN from its original length), as vLLM derives it."""
        r = self.rope_scaling
        if r is None or r.rope_type == "llama3":
            return self.max_position_embeddings
        base = r.original_max_position_embeddings if r.rope_type == "yarn" else self.max_position_embeddings
        return max(int(base * r.factor), self.max_position_embeddings)

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has a mixture of experts (else a dense MLP), as HF decides."""
        sparse = self.num_experts > 0 and (index + 1) % self.decoder_sparse_step == 0
        return sparse and index not in self.mlp_only_layers

    def _ffn_params(self, active: bool) -> int:
        """Feed-forward parameters over all layers: every expert's, or only the top-k's (`active`)."""
        e, total = self.hidden_size, 0
        for i in range(self.num_layers):
            if not self.is_moe_layer(i):
                total += 3 * e * self.intermediate_size
                continue
            experts = self.num_experts_per_tok if active else self.num_experts
            shared = 3 * e * self.shared_expert_intermediate_size + e * bool(self.shared_expert_intermediate_size)
            total += experts * 3 * e * self.moe_intermediate_size + e * self.num_experts + shared
        return total

    @property
    def num_params(self) -> int:
        """Number of parameters, counting a tied embedding once."""
        return self._count_params(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: num_params with only the top-k experts of each MoE layer."""
        return self._count_params(active=True)

    @property
    def num_matmul_params(self) -> int:
        """Weights one token is multiplied by: num_active_params less the embedding table, which is only
        gathered (a tied table still counts once, as the LM head)."""
        return self.num_active_params - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def _count_params(self, active: bool) -> int:
        e = self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + self._layer_params(active) + e + head

    def _layer_params(self, active: bool) -> int:
        """Parameters of the decoder layers (attention, norms, feed-forward), without embedding and head."""
        e, d = self.hidden_size, self.head_dim
        attn = e * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += (self.num_heads + 2 * self.num_kv_heads) * d * self.qkv_bias + e * self.o_bias
        attn += 2 * d * self.qk_norm
        return self.num_layers * (attn + 2 * e) + self._ffn_params(active)

    @property
    def attention_pairs_per_token(self) -> int:
        """Query-key pairs whose attention FLOPs (4 x heads x head_dim a layer) equal one prompt token's
        decoder matmul FLOPs (2 x the layers' parameters): what a token deep in a long prompt costs
        beyond its matmuls, per key it reads (llama-3.1-8b: 26,625)."""
        per_pair = 2 * self.num_layers * self.num_heads * self.head_dim
        return max(1, round(self._layer_params(active=True) / per_pair))

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # --- YAML presets -------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelConfig:
        return load_config(cls, path, kind="ModelConfig field")

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        path = MODEL_PRESETS_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown model preset {name!r}; available: {list_presets()}")
        return cls.from_yaml(path)

    # --- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json (path, directory or dict), transformers v4 or v5 style."""
        if isinstance(config, dict):
            data: dict[str, Any] = config
        else:
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            with open(path) as f:
                data = json.load(f)
        config = data
        model_type = config.get("model_type")
        families = FAMILIES
        if model_type not in families:
            raise ValueError(
                f"config.json: unsupported model_type {model_type!r} "
                f"(architectures {config.get('architectures')}); supported: {sorted(families)}"
            )
        if config.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (silu)")
        rope = dict(config.get("rope_parameters") or {})
        rope.update(config.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        scaling = None
        if rope_type not in (None, "default"):
            fields = {f.name for f in dataclasses.fields(RopeScaling)}
            given = {k: v for k, v in rope.items() if k in fields and v is not None}
            max_len = config.get("max_position_embeddings", 2048)
            if rope_type == "dynamic":  # HF grows the base past the config's own length
                given["original_max_position_embeddings"] = max_len
            elif rope_type == "yarn":
                given.setdefault("original_max_position_embeddings", max_len)
                given.setdefault("factor", max_len / given["original_max_position_embeddings"])
            scaling = RopeScaling(rope_type=rope_type, **given)
        attention_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        kwargs: dict[str, Any] = dict(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or 0,
            model_type=model_type,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            sliding_window=config.get("sliding_window"),
            initializer_range=config.get("initializer_range", 0.02),
            dtype=dtype if dtype in DTYPES else "float32",
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=() if eos is None else eos,
        )
        return cls(**{**kwargs, **families[model_type].config_from_hf(config)})

    def to_hf(self) -> dict[str, Any]:
        """The config.json `transformers` needs to rebuild this model."""
        if self.attn_logit_softcap is not None:
            raise ValueError("attn_logit_softcap has no Llama-family HF equivalent; cannot export")
        family = FAMILIES[self.model_type]
        out: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dataclasses.asdict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        }
        return {**out, **family.config_to_hf(self)}


class Family(Protocol):
    """What ModelConfig reads of an HF model_type's family (jaxinfra.models.families.Family, which
    also holds its tensor names and block class, registers itself here on import)."""

    @property
    def model_type(self) -> str: ...

    @property
    def architecture(self) -> str: ...

    @property
    def moe(self) -> bool: ...

    @property
    def config_from_hf(self) -> Callable[[dict[str, Any]], dict[str, Any]]: ...

    @property
    def config_to_hf(self) -> Callable[[ModelConfig], dict[str, Any]]: ...


# model_type -> its family, filled by jaxinfra.models.families (imported with jaxinfra itself), so
# that this module imports no model code
FAMILIES: dict[str, Family] = {}


def list_presets() -> list[str]:
    return sorted(p.stem for p in MODEL_PRESETS_DIR.glob("*.yaml"))
