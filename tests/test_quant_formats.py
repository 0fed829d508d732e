"""Quantized checkpoints: our round trips, the compressed-tensors package and Hugging Face `transformers`
as outside oracles, the AutoAWQ/GPTQ layouts, act-order g_idx, and serving a quantized directory."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxinfra
from jaxinfra.checkpoint import export_hf
from jaxinfra.loading import DEFAULT_MODEL
from jaxinfra.quant import QuantizedLinear, formats
from jaxinfra.quant import decoder_linears as lin
from jaxinfra.quant.quantize import QuantizeConfig, quantize_model
from serve import LLM, SamplingParams

EXCERPT = str(Path(__file__).parent / "fixtures" / "kjv_excerpt.txt")
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form"


def quantized(**kwargs):
    cfg = QuantizeConfig(calibration=EXCERPT, num_samples=4, seq_len=64, **kwargs)
    return quantize_model(jaxinfra.load_model(), jaxinfra.load_tokenizer(), cfg)


def export(model, path, fmt="compressed-tensors"):
    return export_hf(model, path, quant_format=fmt, tokenizer_dir=DEFAULT_MODEL)


def states_equal(a, b):
    la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))


CASES = [
    (dict(method="rtn", bits=4, group_size=64, symmetric=False), "compressed-tensors"),
    (dict(method="rtn", bits=4, group_size=32), "compressed-tensors"),
    (dict(method="rtn", bits=8, group_size=0), "compressed-tensors"),
    (dict(method="smoothquant", bits=8, group_size=0), "compressed-tensors"),
    (dict(method="gptq", bits=4, gptq_act_order=True), "gptq"),
    (dict(method="rtn", bits=8, group_size=0), "gptq"),
    (dict(method="rtn", bits=4, group_size=0), "gptq"),
    (dict(method="awq", bits=4, symmetric=False), "awq"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,fmt", CASES)
def test_round_trip_is_bit_exact(tmp_path, kwargs, fmt):
    model = quantized(**kwargs)
    out = export(model, tmp_path / "q", fmt)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == fmt
    loaded = jaxinfra.load_model(out)
    assert states_equal(model, loaded)
    ids = jnp.asarray([jaxinfra.load_tokenizer().encode(TEXT)])
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(model(ids)))


def ct_scheme(qcfg):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme.model_validate(qcfg["config_groups"]["group_0"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(method="rtn", bits=4, group_size=64, symmetric=False),
        dict(method="rtn", bits=4, group_size=128),
        dict(method="rtn", bits=8, group_size=0),
        dict(method="smoothquant", bits=8, group_size=0),
    ],
)
def test_compressed_tensors_decompresses_our_weights_to_ours(tmp_path, kwargs):
    """The compressed-tensors package reads our tensors back to exactly our dequantized weights."""
    from compressed_tensors.compressors.base import BaseCompressor
    from safetensors.torch import load_file

    model = quantized(**kwargs)
    out = export(model, tmp_path / "q")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = ct_scheme(qcfg)
    compressor = BaseCompressor.load_from_registry(qcfg["format"])
    tensors = load_file(str(out / "model.safetensors"))
    for i, name, prefix in [
        (1, "attn.o_proj", "model.layers.1.self_attn.o_proj"),
        (2, "mlp.up_proj", "model.layers.2.mlp.up_proj"),
    ]:
        local = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
        dense = compressor.decompress(local, scheme)["weight"]
        ql = lin.get(model.layers[i], name)
        np.testing.assert_array_equal(dense.float().numpy(), np.asarray(ql.dequantize()).T)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [dict(method="rtn", bits=4, group_size=128), dict(method="gptq", bits=4, group_size=32, gptq_act_order=True)],
)
def test_transformers_runs_our_checkpoint_to_our_logits(tmp_path, kwargs):
    """Hugging Face transformers (with compressed-tensors) loads the directory and computes our logits."""
    from transformers import AutoModelForCausalLM

    model = quantized(**kwargs)
    out = export(model, tmp_path / "q")
    ids = jaxinfra.load_tokenizer().encode(TEXT)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray([ids]))), ref, atol=1e-4, rtol=0)


def random_neutral(rng, k=128, n=48, group=32, bits=4, act_order=True):
    groups = k // group
    g_idx = rng.permutation(np.arange(k) // group).astype(np.int32) if act_order else np.arange(k) // group
    values = rng.integers(0, 16, (k, n)) if bits == 4 else rng.integers(-127, 128, (k, n))
    zeros = rng.integers(1, 16, (groups, n)).astype(np.int32) if bits == 4 else None  # GPTQ v1 cannot store 0
    scales = rng.uniform(0.01, 0.02, (groups, n)).astype(np.float32)
    return formats.Neutral(values.astype(np.int32), scales, zeros, g_idx.astype(np.int32), bits)


def neutral_dense(n):
    return (n.values - n.zero_grid[n.g_idx]) * n.scales[n.g_idx]


def test_gptq_desc_act_checkpoint_runs_through_a_row_permutation():
    """An external GPTQ act-order linear (shuffled g_idx) reads into a permuted layer computing x @ W."""
    rng = np.random.default_rng(0)
    neutral = random_neutral(rng)
    back = formats.gptq_read(lambda t: formats.gptq_write(neutral)[t], {"bits": 4, "sym": False})
    for field in ("values", "scales", "zeros", "g_idx"):
        np.testing.assert_array_equal(getattr(back, field), getattr(neutral, field))
    ql = formats.to_quantized_linear(back, (128,), (48,), jnp.float32)
    assert ql.perm is not None
    x = rng.standard_normal((5, 128)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(ql(jnp.asarray(x))), x @ neutral_dense(neutral), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ql.dequantize()), neutral_dense(neutral), rtol=1e-6)
    again = formats.from_linear(ql)
    np.testing.assert_array_equal(again.g_idx, neutral.g_idx)
    np.testing.assert_array_equal(again.values, neutral.values)


def test_layouts_match_autoawq_and_gptq_packing():
    """AutoAWQ packs 8 output columns per int32 in the order 0,2,4,6,1,3,5,7; GPTQ packs 8 input rows
    in order and stores zero points minus one; compressed-tensors packs signed values + 8 along `in`."""
    rng = np.random.default_rng(1)
    neutral = random_neutral(rng, act_order=False)
    u, z = neutral.values, neutral.zero_grid
    awq = formats.awq_write(neutral)
    word = sum(int(u[3, 8 * 2 + col]) << (4 * i) for i, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)))
    assert int(awq["qweight"][3, 2].astype(np.uint32)) == word
    gptq = formats.gptq_write(neutral)
    word = sum(int(u[8 * 5 + i, 7]) << (4 * i) for i in range(8))
    assert int(gptq["qweight"][5, 7].astype(np.uint32)) == word
    word = sum(int(z[1, 8 + i] - 1) << (4 * i) for i in range(8))
    assert int(gptq["qzeros"][1, 1].astype(np.uint32)) == word
    ct = formats.ct_write(neutral)
    word = sum(int(u[16 + i, 9]) << (4 * i) for i in range(8))  # (u - 8) + 8
    assert int(ct["weight_packed"][9, 2].astype(np.uint32)) == word
    for fmt, qcfg in (("awq", {"bits": 4}), ("gptq", {"bits": 4, "sym": False})):
        tensors = formats.WRITERS[fmt](neutral)
        back = formats.READERS[fmt](tensors.__getitem__, qcfg)
        np.testing.assert_array_equal(neutral_dense(back), neutral_dense(neutral))


def test_bad_quantized_checkpoints_are_refused(tmp_path):
    model = quantized(method="rtn", bits=4, group_size=128)
    out = export(model, tmp_path / "q", "gptq")
    with pytest.raises(ValueError, match="quantization='awq'"):
        jaxinfra.load_model(out, quantization="awq")
    with pytest.raises(ValueError, match="already gptq"):
        jaxinfra.load_model(out, quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        jaxinfra.load_model(out, quantization="fp4")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bitsandbytes"):
        jaxinfra.load_model(out)
    with pytest.raises(ValueError, match="4-bit GEMM"):
        formats.awq_read(lambda t: np.zeros((8, 8), np.int32), {"bits": 8})
    with pytest.raises(ValueError, match="format awq holds 4-bit"):
        from jaxinfra.quant.quantize import check_format

        check_format(QuantizeConfig(method="smoothquant", bits=8, group_size=0), "awq")


@pytest.mark.slow
def test_llm_serves_a_quantized_directory_like_the_model_itself(tmp_path):
    """LLM(model=dir) on a GPTQ int4 checkpoint: paged serving gives the greedy tokens of the quantized
    model's own dense decode; `quantization="int8"` rounds the float model as it loads."""
    model = quantized(method="gptq", bits=4)
    out = export(model, tmp_path / "q")
    prompts = ["And God said", "The LORD is my shepherd"]
    tok = jaxinfra.load_tokenizer()
    want = jaxinfra.generate(
        model, [tok.encode(p) for p in prompts], jaxinfra.GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(out), max_model_len=128)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [list(w) for w in want]
    paths = [".".join(map(str, path)) for path, _ in nnx.to_flat_state(llm.engine.core.runner.state)]
    assert "layers.0.attn.q_proj.qweight" in paths
    llm8 = LLM(DEFAULT_MODEL, quantization="int8", max_model_len=128)
    assert llm8.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids


def test_quantize_cli_writes_a_loadable_checkpoint(tmp_path, capsys):
    from jaxinfra.cli import main

    assert main(["quantize", "--bits", "3", "--out", str(tmp_path / "x")]) == 2
    assert "bits must be one of" in capsys.readouterr().err
    assert main(["quantize", "--method", "awq", "--calibration", str(tmp_path / "none.txt"), "--out", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["quantize", "--config", "configs/quant/rtn-int8.yaml", "--out", str(tmp_path / "q")]) == 0
    assert "wrote" in capsys.readouterr().out
    loaded = jaxinfra.load_model(tmp_path / "q")
    assert isinstance(loaded.layers[3].mlp.down_proj, QuantizedLinear) and loaded.layers[3].mlp.down_proj.bits == 8
    assert main(["info", "--model", str(tmp_path / "q")]) == 0
    assert "compressed-tensors" in capsys.readouterr().out
