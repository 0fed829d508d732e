"""Quantization algorithms: each one's defining property on synthetic layers, then on real models."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxinfra
from jaxinfra.quant import QuantizedLinear
from jaxinfra.quant import decoder_linears as lin
from jaxinfra.quant.awq import search_clip, search_scales
from jaxinfra.quant.gptq import gptq, hessian
from jaxinfra.quant.quantize import QuantizeConfig, load_quantize_config, quantize_model
from jaxinfra.quant.rtn import QuantScheme, dequant, fake_quant, rtn
from jaxinfra.quant.smoothquant import smoothing_scales
from pallas_kernels.quant_matmul_reference import quantize_activations

EXCERPT = str(Path(__file__).parent / "fixtures" / "kjv_excerpt.txt")
IDS = jnp.asarray([[0, 17, 99, 4000, 5, 23, 1024, 77, 3, 512, 64, 8]])


def layer_data(seed=0, n=512, k=128, out=64, outliers=True):
    """Inputs with a few large channels (as LLM activations have) and a random weight."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)).astype(np.float32) * 0.3 + np.eye(k, dtype=np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32) @ mix
    if outliers:
        x[:, rng.choice(k, 4, replace=False)] *= 20
    w = rng.standard_normal((k, out)).astype(np.float32) * 0.05
    return jnp.asarray(x), jnp.asarray(w)


def output_error(x, w, wq):
    return float(jnp.mean((x @ w - x @ wq) ** 2))


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(8, None), QuantScheme(4, 32), QuantScheme(4, 128, symmetric=False), QuantScheme(4, None)],
)
def test_rtn_rounds_to_the_nearest_grid_point(scheme):
    _, w = layer_data(k=256)
    q, scale, zero = rtn(w, scheme)
    g = 256 // scale.shape[0]
    lo, hi = (-127, 127) if scheme.bits == 8 else (0, 15)
    assert float(q.min()) >= lo and float(q.max()) <= hi and np.all(np.asarray(q) == np.round(np.asarray(q)))
    back = dequant(q.reshape(-1, g, 64), scale[:, None], zero[:, None]).reshape(w.shape)
    step = np.repeat(np.asarray(scale), g, axis=0)
    assert np.all(np.abs(np.asarray(back - w)) <= step / 2 + 1e-6)  # nearest point, nothing clipped off the range
    np.testing.assert_array_equal(np.asarray(fake_quant(w, scheme)), np.asarray(back))


def test_gptq_beats_rtn_on_correlated_inputs():
    x, w = layer_data(outliers=False)
    h = hessian(x)
    for scheme in (QuantScheme(4, 32), QuantScheme(4, None), QuantScheme(4, 64, symmetric=False)):
        q, scale, zero = gptq(w, h, scheme)
        g = w.shape[0] // scale.shape[0]
        wq = dequant(q.reshape(-1, g, w.shape[1]), scale[:, None], zero[:, None]).reshape(w.shape)
        rtn_err = output_error(x, w, fake_quant(w, scheme))
        assert output_error(x, w, wq) < 0.7 * rtn_err, scheme
        q2, scale2, zero2 = gptq(w, h, scheme, act_order=True)
        wq2 = dequant(q2.reshape(-1, g, w.shape[1]), scale2[:, None], zero2[:, None]).reshape(w.shape)
        assert output_error(x, w, wq2) < rtn_err, scheme
        if scheme.group_size:  # static groups: each group's scale is the RTN scale of its original rows
            np.testing.assert_allclose(np.asarray(scale2), np.asarray(rtn(w, scheme)[1]), rtol=1e-6)


def test_gptq_zero_hessian_columns_quantize_to_zero():
    x, w = layer_data(outliers=False)
    x = x.at[:, :32].set(0.0)
    q, scale, zero = gptq(w, hessian(x), QuantScheme(4, 32))
    wq = dequant(q.reshape(4, 32, -1), scale[:, None], zero[:, None]).reshape(w.shape)
    assert float(jnp.abs(wq[:32]).max()) == 0.0


def test_awq_scales_and_clipping_cut_the_output_error():
    x, w = layer_data()
    scheme = QuantScheme(4, 128)
    rtn_err = output_error(x, w, fake_quant(w, scheme))
    s = search_scales(x, w, scheme)
    assert s.shape == (128,) and bool(jnp.all(s > 0))
    scaled = fake_quant(w * s[:, None], scheme) / s[:, None]
    awq_err = output_error(x, w, scaled)
    assert awq_err < 0.8 * rtn_err
    ratios = search_clip(x / s, w * s[:, None], scheme)
    assert float(ratios.min()) >= 0.5 and float(ratios.max()) <= 1.0
    clipped = fake_quant(w * s[:, None], scheme, ratios) / s[:, None]
    assert output_error(x, w, clipped) <= awq_err * (1 + 1e-5)


def test_smoothing_moves_outliers_into_the_weights():
    x, w = layer_data()
    s = smoothing_scales(jnp.max(jnp.abs(x), axis=0), w, 0.5)

    def w8a8(x, w):
        xq, xs = quantize_activations(x)
        wq, ws, _ = rtn(w, QuantScheme(8, None))
        return (xq.astype(jnp.float32) * xs[:, None]) @ (wq * ws)

    plain = float(jnp.mean((w8a8(x, w) - x @ w) ** 2))
    smooth = float(jnp.mean((w8a8(x / s, w * s[:, None]) - x @ w) ** 2))
    assert smooth < 0.5 * plain


@pytest.mark.parametrize("preset", ["tiny-qwen2", "kjv-small"])
def test_awq_folding_keeps_the_float_model(preset):
    """Scaling a group's weights by s and its producer (norm, v_proj with bias, up_proj) by 1/s is exact."""
    model = jaxinfra.load_model() if preset == "kjv-small" else jaxinfra.load_model(preset, dtype="float32")
    ids = IDS % model.cfg.vocab_size
    before = model(ids)
    layer = model.layers[0]
    rng = np.random.default_rng(0)
    for group in lin.GROUPS:
        if group.name == "o_in" and model.cfg.num_heads != model.cfg.num_kv_heads:
            continue
        k = lin.matrix(layer, group.linears[0]).shape[0]
        lin.fold_scales(layer, group, jnp.asarray(rng.uniform(0.5, 2.0, k), jnp.float32))
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(before), atol=2e-4, rtol=0)


def test_quantize_config_refuses_bad_arguments_before_work(tmp_path):
    with pytest.raises(ValueError, match="bits"):
        QuantizeConfig(bits=3)
    with pytest.raises(ValueError, match="group_size"):
        QuantizeConfig(group_size=100)
    with pytest.raises(ValueError, match="calibration"):
        QuantizeConfig(method="gptq", calibration=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="method"):
        QuantizeConfig(method="hqq")
    with pytest.raises(ValueError, match="unknown config field"):
        load_quantize_config(None, {"method": "awq", "alpha": 0.3})
    assert load_quantize_config(None, {"method": "smoothquant"}).scheme().act_bits == 8
    model = jaxinfra.load_model("tiny-llama")  # intermediate 172: no group of 32/64/128 divides it
    with pytest.raises(ValueError, match="172 of mlp.down_proj"):
        quantize_model(model, None, QuantizeConfig(method="rtn", bits=4, group_size=32))
    assert isinstance(model.layers[0].attn.q_proj, nnx.Param)  # nothing was touched


def heldout_nll(model, tokenizer):
    from jaxinfra.data import load_documents
    from jaxinfra.data.pipeline import document_tokens

    docs = [document_tokens(tokenizer, c) for c in load_documents([EXCERPT])[::33][:4]]
    ids = jnp.asarray([d[:128] for d in docs if len(d) >= 128])
    logp = jax.nn.log_softmax(model(ids)[:, :-1], axis=-1)
    return -float(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean())


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs,tol",
    [
        (dict(method="rtn", bits=8, group_size=0), 0.002),
        (dict(method="rtn", bits=4, group_size=64, symmetric=False), 0.03),
        (dict(method="awq", bits=4, symmetric=False), 0.03),
        (dict(method="gptq", bits=4, gptq_act_order=True), 0.03),
        (dict(method="smoothquant", bits=8, group_size=0), 0.01),
    ],
)
def test_methods_quantize_the_default_model(kwargs, tol):
    """Every decoder linear is replaced; held-out loss stays within `tol` nats of float32."""
    tokenizer = jaxinfra.load_tokenizer()
    ref = heldout_nll(jaxinfra.load_model(), tokenizer)
    cfg = QuantizeConfig(calibration=EXCERPT, num_samples=8, seq_len=128, **kwargs)
    model = quantize_model(jaxinfra.load_model(), tokenizer, cfg)
    for layer in model.layers:
        for name in lin.GROUPS[0].linears + lin.GROUPS[3].linears:
            ql = lin.get(layer, name)
            assert isinstance(ql, QuantizedLinear) and ql.bits == cfg.bits
            assert ql.act_bits == (8 if cfg.method == "smoothquant" else None)
    assert abs(heldout_nll(model, tokenizer) - ref) < tol


def test_pallas_and_reference_quantized_linears_agree():
    """The model with every linear on the Pallas kernels (interpreted) equals the XLA path."""
    model = quantize_model(jaxinfra.load_model(), None, QuantizeConfig(method="rtn", bits=4, symmetric=False))
    ref = model(IDS)
    for layer in model.layers:
        for group in lin.GROUPS:
            for name in group.linears:
                lin.get(layer, name).impl = "pallas"
    np.testing.assert_allclose(np.asarray(model(IDS)), np.asarray(ref), atol=1e-4, rtol=0)
