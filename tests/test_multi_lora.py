"""Multi-LoRA serving: a batch mixing 8 PEFT adapters (ranks 2-8, different target modules) and the base
model gives, greedily, each adapter's output merged into the weights; fewer slots than adapters swap them
(LRU) with the same outputs; the prefix cache keeps adapters apart; bad adapters are refused by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfra
from jaxinfra.lora import merge_lora
from jaxinfra.models.multi_lora import LoraPools, MultiLora
from pallas_kernels import lora_apply
from serve import LLM, EngineArgs, LoRARequest, SamplingParams
from tests.lora_helpers import ATTENTION, MLP, save_adapter
from tests.serve_helpers import ENGINE_DEFAULTS, PRESET, prompts

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# (rank, target modules) of the 8 adapters
SPECS = [
    (8, ATTENTION + MLP),
    (2, ("q_proj", "v_proj")),
    (4, MLP),
    (8, ("o_proj", "down_proj")),
    (4, ATTENTION),
    (2, ATTENTION + MLP),
    (6, ("k_proj", "up_proj")),
    (8, ("q_proj", "gate_proj")),
]
PROMPTS = prompts([5, 19, 11, 26, 8, 14, 30, 9, 17], seed=7)  # the last runs on the base model


def _adapter(path, seed: int, rank: int, targets: tuple[str, ...]) -> list[int]:
    """Save a random PEFT adapter at `path`; the greedy output of PROMPTS[seed] with it merged."""
    merged = merge_lora(save_adapter(path, seed, rank, targets))
    config = jaxinfra.GenerationConfig(max_new_tokens=GREEDY.max_tokens, stop_at_eos=False)
    return jaxinfra.generate(merged, [PROMPTS[seed]], config)[0]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The 8 adapters' requests and their merged models' outputs, then the base model's output."""
    root = tmp_path_factory.mktemp("adapters")
    requests, want = [], []
    for i, (rank, targets) in enumerate(SPECS):
        want.append(_adapter(root / f"a{i}", i, rank, targets))
        requests.append(LoRARequest(f"adapter-{i}", i + 1, str(root / f"a{i}")))
    config = jaxinfra.GenerationConfig(max_new_tokens=GREEDY.max_tokens, stop_at_eos=False)
    base = jaxinfra.generate(jaxinfra.load_model(PRESET), [PROMPTS[-1]], config)[0]
    return requests, want, base


def _lora_llm(**kwargs) -> LLM:
    return LLM(**{**ENGINE_DEFAULTS, "enable_lora": True, "max_lora_rank": 8, **kwargs})


def test_mixed_batch_of_8_adapters_equals_each_merged(adapters):
    requests, want, base = adapters
    assert len({tuple(w) for w in want}) == len(want)  # the adapters really differ
    llm = _lora_llm(max_loras=8, max_num_seqs=16)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[*requests, None])
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"adapter {i} (rank {SPECS[i][0]}, {SPECS[i][1]})"
    assert got[-1] == base
    assert llm.engine.core.runner.lora.loads == 8


def test_fewer_slots_than_adapters_swap_with_the_same_outputs(adapters):
    requests, want, base = adapters
    llm = _lora_llm(max_loras=2, max_cpu_loras=3)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[*requests, None])
    assert [o.outputs[0].token_ids for o in outs] == [*want, base]
    lora = llm.engine.core.runner.lora
    assert lora.loads >= 8 and len(lora.slot_of) <= 2 and len(lora.host) <= 3
    # a second pass reuses the slots it can, reloading the others from their folders
    again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=requests[:2])
    assert [o.outputs[0].token_ids for o in again] == want[:2]


def test_prefix_cache_keys_include_the_adapter(adapters):
    requests, _, _ = adapters
    llm = _lora_llm(max_loras=2)
    prompt = list(range(3, 43))  # five full blocks of 8
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests[0])
    same, other, base = (
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=r)[0] for r in (requests[0], requests[1], None)
    )
    assert same.num_cached_tokens >= 32 and other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    # a bad adapter is refused by name, and nothing of the call stays queued
    too_big = LoRARequest(requests[0].lora_name, 99, requests[0].lora_path)
    llm.engine.core.runner.lora.max_rank = 4
    with pytest.raises(ValueError, match="'adapter-0' has rank 8, above the engine's max_lora_rank"):
        llm.generate([prompt, prompt], GREEDY, use_tqdm=False, lora_request=[requests[1], too_big])
    assert not llm.engine.has_unfinished_requests()
    missing = LoRARequest("nowhere", 100, "/nonexistent/adapter")
    with pytest.raises(ValueError, match="LoRA adapter 'nowhere': .*not a PEFT adapter folder"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=missing)


def test_lora_requests_need_enable_lora_and_valid_args(adapters, tmp_path):
    requests, _, _ = adapters
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="EngineArgs.max_lora_rank must be a positive int"):
        EngineArgs(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="speculative_config cannot be combined with enable_lora"):
        EngineArgs(enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, str(tmp_path))
    llm = LLM(**ENGINE_DEFAULTS)
    with pytest.raises(ValueError, match="'adapter-0' requested, but the engine runs without enable_lora"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=requests[0])


def test_steps_without_adapters_skip_the_pools():
    """A step whose tokens all run the base model never reads the pools (NaN here: any read would show),
    so base-model batches pay no LoRA math; a mixed step adds each adapter token's delta, none elsewhere."""
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal((1, 6, n)), jnp.float32) for n in (16, 24))
    a = jnp.asarray(rng.standard_normal((2, 3, 16, 4)), jnp.float32)  # 2 layers, 3 slots
    b = jnp.asarray(rng.standard_normal((2, 3, 4, 24)), jnp.float32)
    scaling = jnp.asarray([0.5, 1.0, 2.0])
    nan = LoraPools({"q_proj": jnp.full_like(a, jnp.nan)}, {"q_proj": jnp.full_like(b, jnp.nan)}, scaling)
    none = jnp.full((6,), -1, jnp.int32)
    assert bool(jnp.array_equal(MultiLora.of(none, nan).layer(1).add("q_proj", x, y), y))
    pools = LoraPools({"q_proj": a}, {"q_proj": b}, scaling)
    for tokens in (6, 3):  # more tokens than slots (prefill), and no more (decode)
        mixed = jnp.asarray([2, -1, 0, -1, 1, 2][:tokens], jnp.int32)
        got = MultiLora.of(mixed, pools).layer(1).add("q_proj", x[:, :tokens], y[:, :tokens])
        want = y[0, :tokens] + lora_apply(x[0, :tokens], a[1], b[1], scaling, slots=mixed)
        np.testing.assert_allclose(got[0], want, rtol=1e-5)
        assert bool(jnp.array_equal(got[0, 1], y[0, 1])) and not bool(jnp.allclose(got[0, 0], y[0, 0]))


def test_target_modules_limit_the_slots_and_refuse_other_adapters(adapters):
    """lora_target_modules q_proj,v_proj: slots hold only those; an adapter wrapping them answers as merged
    beside the base model (and a batch without adapters as the base), one wrapping another is refused."""
    requests, want, base = adapters
    llm = _lora_llm(max_loras=2, lora_target_modules="q_proj,v_proj")
    assert set(llm.engine.core.runner.lora.pools.a) == {"q_proj", "v_proj"}
    outs = llm.generate([PROMPTS[1], PROMPTS[-1]], GREEDY, use_tqdm=False, lora_request=[requests[1], None])
    assert [o.outputs[0].token_ids for o in outs] == [want[1], base]
    assert llm.generate([PROMPTS[-1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == base
    with pytest.raises(
        ValueError,
        match=r"'adapter-2' wraps gate_proj, up_proj, down_proj, outside .*--lora-target-modules q_proj,v_proj",
    ):
        llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False, lora_request=requests[2])
    assert EngineArgs(lora_target_modules=["v_proj", "q_proj"]).lora_modules() == ("q_proj", "v_proj")
    assert len(EngineArgs(lora_target_modules="all").lora_modules()) == 7
    for bad in ("qkv_proj", "", 3):
        with pytest.raises(ValueError, match="EngineArgs.lora_target_modules"):
            EngineArgs(lora_target_modules=bad)
