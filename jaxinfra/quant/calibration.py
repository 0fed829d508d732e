"""Calibration data and the layer-by-layer walk every calibrated method runs (the decoder's linears
themselves: jaxinfra.quant.decoder_linears).

Only one decoder layer's activations exist at a time: the embeddings of the calibration rows go
through layer 0, which the method rewrites (folding scales, replacing weights); its output, computed
with the rewritten layer, feeds layer 1, and so on. A model bigger than memory then needs only its
current layer on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxinfra.data import load_documents
from jaxinfra.data.pipeline import document_tokens
from jaxinfra.data.sources import split_documents
from jaxinfra.models import LlamaModel
from jaxinfra.models.layers import MLP, DecoderLayer
from jaxinfra.models.llama import row_positions
from jaxinfra.tokenizer import Tokenizer

DEFAULT_CALIBRATION = Path("data/kjv/kjv.txt")  # scripts/fetch_kjv.py; its training split (as the recipe's)
KJV_VALID_FRACTION = 0.03  # configs/train/default_model.yaml


def calibration_documents(path: str | Path | None) -> list[str]:
    """Documents of a text/JSONL file (or directory); by default the KJV training split."""
    if path is None:
        if not DEFAULT_CALIBRATION.is_file():
            raise ValueError(
                f"calibration: the default KJV corpus {DEFAULT_CALIBRATION} is missing "
                "(python scripts/fetch_kjv.py), or pass a text/JSONL file"
            )
        return split_documents(load_documents([DEFAULT_CALIBRATION]), KJV_VALID_FRACTION)[0]
    if not Path(path).exists():
        raise ValueError(f"calibration: {path} does not exist")
    return load_documents([path])


def calibration_rows(
    docs: list[str], tokenizer: Tokenizer, num_samples: int, seq_len: int, seed: int = 0
) -> np.ndarray:
    """`num_samples` windows of `seq_len` tokens from the documents joined end to end (a seeded choice)."""
    stream: list[int] = []
    for doc in docs:
        stream += document_tokens(tokenizer, doc)
        if len(stream) >= num_samples * seq_len * 4:
            break
    windows = len(stream) // seq_len
    if windows == 0:
        raise ValueError(f"calibration: the data holds {len(stream)} tokens, fewer than seq_len={seq_len}")
    picks = np.random.default_rng(seed).permutation(windows)[:num_samples]
    return np.stack([stream[i * seq_len : (i + 1) * seq_len] for i in sorted(picks)]).astype(np.int32)


@nnx.jit
def _captures(layer: DecoderLayer, x: jax.Array, positions: jax.Array) -> dict[str, jax.Array]:
    """The input of every linear group of `layer` for hidden states x, flattened to [tokens, K]."""
    from pallas_kernels import DenseMetadata

    attn_in = layer.input_norm(x)
    heads, _ = layer.attn.heads(attn_in, positions, DenseMetadata(), None)
    h = x + layer.attn.project(heads)
    mlp_in = layer.post_attn_norm(h)
    assert isinstance(layer.mlp, MLP), "quantize.check refuses mixture-of-experts models"
    flat = lambda a: a.reshape(-1, int(np.prod(a.shape[2:]))).astype(jnp.float32)
    return {
        "attn_in": flat(attn_in),
        "o_in": flat(heads),
        "mlp_in": flat(mlp_in),
        "down_in": flat(layer.mlp.hidden(mlp_in)),
    }


@nnx.jit
def _forward(layer: DecoderLayer, x: jax.Array, positions: jax.Array) -> jax.Array:
    from pallas_kernels import DenseMetadata

    return layer(x, positions, DenseMetadata(), None)[0]


LayerFn = Callable[[DecoderLayer, Callable[[], dict[str, jax.Array]]], None]


def walk_layers(model: LlamaModel, rows: np.ndarray, fn: LayerFn, *, desc: str) -> None:
    """Call fn(layer, capture) for each layer in order; capture() gives the current inputs of its linears."""
    tokens = jnp.asarray(rows)
    positions = row_positions(tokens)
    x = jnp.take(model.embed[...], tokens, axis=0)
    for layer in tqdm(model.layers, desc=desc, unit="layer"):
        fn(layer, functools.partial(_captures, layer, x, positions))
        x = _forward(layer, x, positions)
