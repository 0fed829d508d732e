"""Hugging Face checkpoints: load safetensors (single or sharded, memory-mapped) and export back."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.models.families import TensorMap, family
from jaxinfra.quant.checkpoint import attach as attach_quantized
from jaxinfra.quant.checkpoint import quantized_tensors

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
# HF tensors that carry no weights of their own (buffers older exports saved).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_LAYER_MAP = {
    ("input_norm", "scale"): TensorMap("input_layernorm.weight", "same"),
    ("post_attn_norm", "scale"): TensorMap("post_attention_layernorm.weight", "same"),
    ("attn", "q_proj"): TensorMap("self_attn.q_proj.weight", "linear"),
    ("attn", "k_proj"): TensorMap("self_attn.k_proj.weight", "linear"),
    ("attn", "v_proj"): TensorMap("self_attn.v_proj.weight", "linear"),
    ("attn", "o_proj"): TensorMap("self_attn.o_proj.weight", "linear", n_in=2),
    ("attn", "q_bias"): TensorMap("self_attn.q_proj.bias", "flat"),
    ("attn", "k_bias"): TensorMap("self_attn.k_proj.bias", "flat"),
    ("attn", "v_bias"): TensorMap("self_attn.v_proj.bias", "flat"),
    ("attn", "o_bias"): TensorMap("self_attn.o_proj.bias", "flat"),
    ("attn", "q_norm", "scale"): TensorMap("self_attn.q_norm.weight", "same"),
    ("attn", "k_norm", "scale"): TensorMap("self_attn.k_norm.weight", "same"),
    ("mlp", "gate_proj"): TensorMap("mlp.gate_proj.weight", "linear"),
    ("mlp", "up_proj"): TensorMap("mlp.up_proj.weight", "linear"),
    ("mlp", "down_proj"): TensorMap("mlp.down_proj.weight", "linear"),
}
_TOP_MAP = {
    ("embed",): TensorMap("model.embed_tokens.weight", "same"),
    ("norm", "scale"): TensorMap("model.norm.weight", "same"),
    ("lm_head",): TensorMap("lm_head.weight", "linear"),
}


def tensor_map(path: tuple, model_type: str = "llama") -> TensorMap:
    """The HF name and layout of the parameter at `path` in our model state."""
    if path[0] == "layers":
        key = tuple(path[2:])
        m = family(model_type).tensors.get(key) or _LAYER_MAP[key]
        return dataclasses.replace(m, hf_name=f"model.layers.{path[1]}.{m.hf_name}")
    return _TOP_MAP[tuple(path)]


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files found")
    return files


class _TensorReader:
    """Name -> lazily read numpy array across all safetensors files of a checkpoint (memory-mapped).
    A bare decoder (LlamaModel, as sentence-transformers saves embedding models) is read under the
    causal LM's names ("model." prefixed); `bare` says it has no LM head."""

    def __init__(self, directory: Path) -> None:
        self.handles = [safe_open(str(p), framework="numpy") for p in _safetensors_files(directory)]
        stored = {name: h for h in self.handles for name in h.keys()}  # noqa: SIM118 - safetensors handles are not dicts
        self.bare = "embed_tokens.weight" in stored
        self.names = {("model." + n if self.bare else n): n for n in stored}
        self.where = {name: stored[n] for name, n in self.names.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(self.names[name]).get_shape())

    def read(self, name: str) -> np.ndarray:
        return self.where[name].get_tensor(self.names[name])


def abstract_model(cfg: ModelConfig, attn_impl: str | None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its state as shapes (nothing allocated), to be filled by a loader."""
    return nnx.split(nnx.eval_shape(lambda: LlamaModel(cfg, nnx.Rngs(0), attn_impl)))


def _hf_name(path: tuple) -> str:
    return tensor_map(path).hf_name


def is_sequence_classifier(directory: Path | None) -> bool:
    """Whether a HF folder holds a *ForSequenceClassification checkpoint (a `score` head, no LM head)."""
    if directory is None or not (directory / "config.json").is_file():
        return False
    archs = json.loads((directory / "config.json").read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def load_hf_model(directory: str | Path, dtype: str | None = None, attn_impl: str | None = None) -> LlamaModel:
    """Build a LlamaModel from a local HF directory; every tensor is checked by name and shape."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory}: not a Hugging Face model directory (no config.json)")
    cfg = ModelConfig.from_hf(directory / "config.json")
    classifier = is_sequence_classifier(directory)
    reader = _TensorReader(directory)
    if classifier or reader.bare:  # no LM head (pooling models): a classifier's `score` is read by serve.pooling
        cfg = cfg.replace(tie_word_embeddings=True)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    abstract = nnx.eval_shape(lambda: LlamaModel(cfg, nnx.Rngs(0), attn_impl))
    quantized: set[str] = set()
    qcfg = json.loads((directory / "config.json").read_text()).get("quantization_config")
    if qcfg is not None and cfg.num_experts:
        raise ValueError(f"{directory}: quantized mixture-of-experts checkpoints are not supported")
    if qcfg is not None:  # quantized linears are read now; the dense tensors below
        quantized = attach_quantized(abstract, qcfg, reader.where.__contains__, reader.read, _hf_name, cfg.dtype)
    graphdef, state = nnx.split(abstract)
    flat = [(path, var) for path, var in nnx.to_flat_state(state) if isinstance(var, nnx.Param)]
    maps = {path: tensor_map(path, cfg.model_type) for path, _ in flat}
    expected = {name for path, var in flat for name in maps[path].hf_names(var.shape)} | quantized
    unexpected = sorted(
        n
        for n in reader.where
        if n not in expected
        and not n.endswith(IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
        and not (classifier and n == "score.weight")
    )
    if unexpected:
        raise ValueError(f"{directory}: unexpected tensor(s) for {cfg.model_type}: {unexpected[:8]}")
    loaded = [(path, var) for path, var in nnx.to_flat_state(state) if not isinstance(var, nnx.Param)]
    for path, var in tqdm(flat, desc=f"loading {directory.name}", unit="tensor", leave=False):
        m = maps[path]
        shape = m.slice_shape(var.shape)
        slices = []
        for name in m.hf_names(var.shape):
            if name not in reader.where:
                raise ValueError(f"{directory}: missing tensor {name!r}")
            want, got = m.hf_shape(shape), reader.shape(name)
            if got != want:
                raise ValueError(f"{directory}: tensor {name!r} has shape {list(got)}, expected {list(want)}")
            slices.append(m.to_ours(reader.read(name), shape))
        value = np.stack(slices) if m.per_expert else slices[0]
        loaded.append((path, var.replace(value=jnp.asarray(value, dtype=cfg.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _hf_tensors(model: LlamaModel, dtype: str | None) -> Iterator[tuple[str, np.ndarray]]:
    """Dense parameters in HF names and layouts (quantized linears are written by jaxinfra.quant)."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        m = tensor_map(path, model.cfg.model_type)
        value = np.asarray(var[...])
        for name, w in zip(m.hf_names(value.shape), value if m.per_expert else [value], strict=True):
            w = m.to_hf(w)
            yield name, w.astype(jnp.dtype(dtype)) if dtype else w


def export_hf(
    model: LlamaModel,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_dir: str | Path | None = None,
    quant_format: str = "compressed-tensors",
) -> Path:
    """Write config.json and model*.safetensors (sharded with an index past `max_shard_bytes`).

    Quantized linears are written in `quant_format` (compressed-tensors, awq or gptq)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg.replace(dtype=dtype) if dtype else model.cfg
    qtensors, qcfg = (  # MoE models are never quantized (their experts are not linears by name)
        ([], None)
        if cfg.num_experts
        else quantized_tensors(model, quant_format, _hf_name, jnp.dtype(dtype) if dtype else None)
    )
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, w in [*_hf_tensors(model, dtype), *qtensors]:
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        total = sum(w.nbytes for shard in shards for w in shard.values())
        with open(out_dir / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = cfg.to_hf() if qcfg is None else {**cfg.to_hf(), "quantization_config": qcfg}
    with open(out_dir / "config.json", "w") as f:
        json.dump(hf_config, f, indent=2)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (out_dir / name).resolve():
                shutil.copy(src, out_dir / name)
    return out_dir
