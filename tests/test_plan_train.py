"""plan-train's activation estimate against what the compiled forward actually keeps for the backward."""

import jax
import pytest
from flax import nnx

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.train import TrainConfig, Trainer
from jaxinfra.train.memory import activation_bytes, measured_activation_bytes
from sharding import MeshConfig, get_rules, make_mesh

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


def _model(vocab: int, width: int, mlp: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=mlp,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )


CONFIGS = {  # (model, rows, sequence length): GQA 3, MHA, GQA 4 at three widths and lengths
    "gqa3": (_model(300, 48, 80, 3, 6, 2, 8), 2, 32),
    "mha": (_model(1024, 128, 352, 4, 4, 4, 32), 2, 128),
    "gqa4": (_model(512, 96, 256, 2, 8, 2, 16), 4, 256),
}


def check(name: str, remat: str, attn_impl: str) -> None:
    cfg, rows, seq = CONFIGS[name]
    mesh = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    trainer = Trainer(LlamaModel(cfg, nnx.Rngs(0), attn_impl), mesh, get_rules("fsdp"), TrainConfig(remat=remat))
    measured = measured_activation_bytes(trainer, rows, seq)
    estimate = activation_bytes(cfg, rows, seq, remat, "bfloat16", attn_impl)
    assert measured > 0
    assert abs(estimate / measured - 1) < 0.2, (name, remat, estimate, measured)


@pytest.mark.parametrize("remat", ["none", "full", "save_dots"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_activation_estimate_within_20_percent_of_compiled(name, remat):
    """Materialized attention (the CPU default): float32 scores kept per layer unless rematerialized."""
    check(name, remat, "reference")


def test_activation_estimate_with_flash_attention():
    """Our flash kernel (interpret mode) keeps only its output and log-sum-exp (the policies that
    rematerialize attention do not depend on the kernel)."""
    check("gqa4", "none", "pallas")


def test_remat_policies_order_and_sharding_divides():
    cfg, rows, seq = CONFIGS["mha"]
    full, dots, none = (activation_bytes(cfg, rows, seq, r) for r in ("full", "save_dots", "none"))
    assert full < dots < none
    tp = activation_bytes(cfg, rows, seq, "save_dots", tensor=2)
    assert activation_bytes(cfg, rows, seq, "full", tensor=2) < full  # logits split over vocab shards
    assert dots / 2 < tp < dots  # head and MLP terms halve, the residual stream does not
    assert activation_bytes(cfg, rows, seq, "none", context=4) == pytest.approx(none / 4)
