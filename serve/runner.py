"""Model runner: packs scheduled tokens into bucketed flat batches and runs one jitted step.

The step is model forward over the flat ragged batch with paged attention (the KV pools donated and
updated in place), logits only where a token is sampled, and sampling on device. Shapes are padded
to a few buckets (tokens, sequences, block-table width, decode-only or not), so after `warmup()` no
new compilation happens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxinfra.models import LlamaModel
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import PagedKVCache, PagedMetadata
from sharding import get_rules, logical_rules, shard_state
from serve.sampler import SamplerOutput, SamplingTensors, sample
from serve.scheduler import SchedulerOutput
from serve.sequence import Sequence


def _buckets(limit: int, start: int, factor: int = 4) -> list[int]:
    out = [start]
    while out[-1] < limit:
        out.append(min(out[-1] * factor, limit))
    return out


def _fit(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass
class StepResult:
    """Host copies of what the device step produced, rows in scheduled order."""

    sampled: SamplerOutput
    prompt_logprob: np.ndarray | None = None   # [T] log p(next prompt token)
    prompt_top_ids: np.ndarray | None = None   # [T, n]
    prompt_top_logprobs: np.ndarray | None = None


def num_blocks_for_memory(model: LlamaModel, block_size: int, kv_dtype: str, memory_bytes: int) -> int:
    cfg = model.cfg
    width = 1 + 4 / cfg.head_dim if kv_dtype == "int8" else jnp.dtype(cfg.dtype).itemsize
    per_block = cfg.kv_bytes_per_token(1) * width * block_size
    return int(memory_bytes // per_block)


class ModelRunner:
    def __init__(self, model: LlamaModel, *, block_size: int, num_blocks: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, kv_cache_dtype: str = "auto",
                 eos_token_ids: tuple[int, ...] = (), mesh: Mesh | None = None) -> None:
        cfg = model.cfg
        self.mesh = mesh  # tensor parallelism: weights and KV pools split over the mesh's `tensor` axis
        self.eos_token_ids = tuple(eos_token_ids)  # held back, with stop_token_ids, until min_tokens
        self.cfg = cfg
        self.block_size = block_size
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.graphdef, self.state = nnx.split(model)
        dtype = jnp.int8 if kv_cache_dtype == "int8" else cfg.dtype
        self.caches = [PagedKVCache.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
                       for _ in range(cfg.num_layers)]
        self.rules = get_rules("tp")
        if mesh is not None:
            if cfg.num_kv_heads % mesh.shape["tensor"]:
                raise ValueError(f"num_kv_heads ({cfg.num_kv_heads}) must be divisible by tensor_parallel_size "
                                 f"({mesh.shape['tensor']})")
            self.state = shard_state(self.state, mesh, self.rules.params)
            kv = NamedSharding(mesh, PartitionSpec(None, None, "tensor"))
            self.caches = jax.device_put(self.caches, kv)
        self.token_buckets = _buckets(max_num_batched_tokens, min(16, max_num_batched_tokens))
        self.seq_buckets = _buckets(max_num_seqs, min(8, max_num_seqs))
        self.width_buckets = _buckets(self.max_blocks, min(4, self.max_blocks))  # block-table columns
        self.num_compilations = 0
        self._step = jax.jit(self._step_impl, donate_argnums=(1,),
                             static_argnames=("max_q_len", "num_logprobs", "use_penalties", "prompt_logprobs"))

    # --- device step --------------------------------------------------------------------------
    def _step_impl(self, state, caches, inputs, sampling, *, max_q_len, num_logprobs, use_penalties,
                   prompt_logprobs):
        self.num_compilations += 1  # runs only while tracing: counts compilations
        if self.mesh is not None:
            with logical_rules(self.mesh, self.rules.activations):
                return self._forward_and_sample(state, caches, inputs, sampling, max_q_len=max_q_len,
                                                num_logprobs=num_logprobs, use_penalties=use_penalties,
                                                prompt_logprobs=prompt_logprobs)
        return self._forward_and_sample(state, caches, inputs, sampling, max_q_len=max_q_len,
                                        num_logprobs=num_logprobs, use_penalties=use_penalties,
                                        prompt_logprobs=prompt_logprobs)

    def _forward_and_sample(self, state, caches, inputs, sampling, *, max_q_len, num_logprobs, use_penalties,
                            prompt_logprobs):
        model = nnx.merge(self.graphdef, state)
        meta = PagedMetadata(inputs["slot_mapping"], inputs["block_tables"], inputs["cu_q_lens"],
                             inputs["kv_lens"], max_q_len)
        h, caches = model.hidden_states(inputs["input_ids"][None], inputs["positions"][None], meta, caches)
        h = h[0]
        out = sample(model.logits(h[inputs["logits_indices"]]), sampling, num_logprobs=num_logprobs,
                     use_penalties=use_penalties)
        extra = None
        if prompt_logprobs is not None:
            lp = jax.nn.log_softmax(model.logits(h), axis=-1)
            target = jnp.take_along_axis(lp, inputs["prompt_targets"][:, None], axis=-1)[:, 0]
            top_lp, top_ids = jax.lax.top_k(lp, max(prompt_logprobs, 1))
            extra = (target, top_ids, top_lp)
        return out, extra, caches

    # --- host side ----------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> tuple[dict, SamplingTensors, dict]:
        """Numpy inputs for one step (the host work the overhead benchmark times)."""
        seqs = [s for s, _ in sched.scheduled]
        n_seq = len(seqs)
        counts = np.fromiter((n for _, n in sched.scheduled), np.int32, n_seq)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, n_seq)
        n_tok = int(counts.sum())
        decode_only = int(counts.max(initial=0)) <= 1
        sb = _fit(n_seq, self.seq_buckets)
        tb = sb if decode_only else _fit(n_tok, self.token_buckets)  # decodes: one token per sequence slot
        cu = np.zeros(sb + 1, np.int32)
        np.cumsum(counts, out=cu[1:n_seq + 1])
        cu[n_seq + 1:] = cu[n_seq]
        seq_of_tok = np.repeat(np.arange(n_seq), counts)
        positions = np.zeros(tb, np.int32)
        positions[:n_tok] = starts[seq_of_tok] + np.arange(n_tok) - cu[seq_of_tok]
        width = _fit(max(len(s.block_ids) for s in seqs), self.width_buckets)
        block_tables = np.zeros((sb, width), np.int32)
        block_tables[:n_seq] = [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]
        input_ids = np.zeros(tb, np.int32)
        input_ids[:n_tok] = [t for s, n in sched.scheduled
                             for t in s.tokens[s.num_computed_tokens:s.num_computed_tokens + n]]
        slots = np.full(tb, -1, np.int32)
        p = positions[:n_tok]
        slots[:n_tok] = block_tables[seq_of_tok, p // self.block_size] * self.block_size + p % self.block_size
        kv_lens = np.zeros(sb, np.int32)
        kv_lens[:n_seq] = starts + counts
        logits_indices = np.zeros(sb, np.int32)
        logits_indices[:n_seq] = cu[1:n_seq + 1] - 1
        inputs = dict(input_ids=input_ids, positions=positions, slot_mapping=slots, block_tables=block_tables,
                      cu_q_lens=cu, kv_lens=kv_lens, logits_indices=logits_indices)
        want_prompt = [s for s in seqs if s.wants_prompt_logprobs and s.num_computed_tokens < s.prompt_len]
        static = dict(max_q_len=1 if decode_only else tb,
                      num_logprobs=max((s.params.logprobs or 0 for s in seqs), default=0),
                      use_penalties=any(s.params.uses_penalties for s in seqs),
                      prompt_logprobs=max((s.params.prompt_logprobs for s in want_prompt), default=None))
        if static["prompt_logprobs"] is not None:
            targets = np.zeros(tb, np.int32)
            for i, (s, n) in enumerate(sched.scheduled):
                nxt = s.tokens[s.num_computed_tokens + 1:s.num_computed_tokens + n + 1]
                targets[cu[i]:cu[i] + len(nxt)] = nxt
            inputs["prompt_targets"] = targets
        return inputs, self._sampling(seqs, sb, static["use_penalties"]), static

    def _sampling(self, seqs: list[Sequence], sb: int, use_penalties: bool) -> SamplingTensors:
        n = len(seqs)
        floats = np.zeros((sb, 6), np.float32)
        floats[:, 2] = floats[:, 5] = 1.0  # top_p, repetition_penalty defaults for padding rows
        ints = np.zeros((sb, 4), np.int32)
        if n:
            floats[:n] = [(p.temperature, p.min_p, p.top_p, p.presence_penalty, p.frequency_penalty,
                           p.repetition_penalty) for p in (s.params for s in seqs)]
            ints[:n] = [(s.params.top_k, s.seed, s.index, s.num_output_tokens) for s in seqs]
        if use_penalties:
            width = _pow2(max(s.num_tokens for s in seqs))
            history = np.full((sb, width), -1, np.int32)
            is_out = np.zeros((sb, width), np.int32)
            for i, s in enumerate(seqs):
                history[i, :s.num_tokens] = s.tokens
                is_out[i, s.prompt_len:s.num_tokens] = 1
        else:
            history, is_out = np.full((sb, 1), -1, np.int32), np.zeros((sb, 1), np.int32)
        held = [(i, s) for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        banned_rows = {i: sorted(set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else set(self.eos_token_ids)))
                       for i, s in held}
        banned = np.full((sb, _pow2(max((len(b) for b in banned_rows.values()), default=1))), -1, np.int32)
        for i, b in banned_rows.items():
            banned[i, :len(b)] = b
        return SamplingTensors(
            temperature=floats[:, 0], top_k=ints[:, 0], top_p=floats[:, 2], min_p=floats[:, 1], seed=ints[:, 1],
            sibling=ints[:, 2], out_pos=ints[:, 3], presence=floats[:, 3], frequency=floats[:, 4],
            repetition=floats[:, 5], history=history, history_is_output=is_out, banned=banned)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        inputs, sampling, static = self.prepare(sched)
        out, extra, self.caches = self._step(self.state, self.caches, inputs, sampling, **static)
        out = jax.device_get(out)
        result = StepResult(out)
        if extra is not None:
            result.prompt_logprob, result.prompt_top_ids, result.prompt_top_logprobs = jax.device_get(extra)
        return result

    def shapes(self) -> list[tuple[int, int, int, int]]:
        """Every (tokens, sequences, block-table width, max_q_len) a step can have: decode-only
        batches (one token per sequence bucket slot) and batches with a prompt chunk."""
        out = [(sb, sb, w, 1) for sb in self.seq_buckets for w in self.width_buckets]
        for tb in self.token_buckets:
            for j, sb in enumerate(self.seq_buckets):
                if j and self.seq_buckets[j - 1] >= tb:
                    continue  # needs more sequences than tokens
                out += [(tb, sb, w, tb) for w in self.width_buckets]
        return out

    def warmup(self) -> None:
        """Compile every step shape (`shapes()`) for requests without logprobs or penalties."""
        for tb, sb, width, q in tqdm(self.shapes(), desc="compiling step shapes", unit="shape", leave=False):
            inputs = dict(input_ids=np.zeros(tb, np.int32), positions=np.zeros(tb, np.int32),
                          slot_mapping=np.full(tb, -1, np.int32), block_tables=np.zeros((sb, width), np.int32),
                          cu_q_lens=np.zeros(sb + 1, np.int32), kv_lens=np.zeros(sb, np.int32),
                          logits_indices=np.zeros(sb, np.int32))
            _, _, self.caches = self._step(self.state, self.caches, inputs, self._sampling([], sb, False),
                                           max_q_len=q, num_logprobs=0, use_penalties=False, prompt_logprobs=None)
