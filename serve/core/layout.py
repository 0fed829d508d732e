"""The engine core's layout: EngineArgs and the model resolved once into the numbers every core part
(scheduler, model runner, input builder, device step) takes whole."""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxinfra.config import ModelConfig
from pallas_kernels import cpu_paged_attention, paged_impl
from serve.config import EngineArgs, kv_storage_dtype
from serve.core.kv_budget import (
    DeviceMemory,
    engine_max_model_len,
    kv_cache_blocks,
    step_token_budget,
    xla_mem_fraction,
)
from serve.core.runner.sizing import buckets
from serve.sampling_params import INT32_MAX


@dataclasses.dataclass(frozen=True)
class CoreLayout:
    """Lengths, block size and count (the memory plan), step buckets, EOS ids, speculation k and the
    parallel layout; `resolve` makes the engine's, tests may build one by hand (EngineArgs' defaults)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # the step token budget
    max_model_len: int = INT32_MAX
    block_size: int = 16
    num_blocks: int = 0  # KV blocks per pool
    eos_token_ids: tuple[int, ...] = ()  # the model's and the tokenizer's, merged
    enable_chunked_prefill: bool = True
    prefill_tokens_per_decode: int = 0
    pairs_per_token: int = 0  # query-key pairs costing one prompt token's matmuls (the prefill cap's)
    scheduling_policy: str = "fcfs"
    num_scheduler_steps: int = 1
    num_speculative_tokens: int = 0  # k: drafts a row per verify step (0: no speculation)
    disable_spec_above: int | None = None  # speculation's disable_by_batch_size
    kv_cache_dtype: str = "auto"
    attn_impl: str = "xla"  # resolved: pallas | xla | cpu | reference
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1  # enable_expert_parallel resolved
    context_parallel_size: int = 1  # devices a step's tokens are split over
    scan_layers: bool = True
    token_buckets: tuple[int, ...] = ()  # tokens a step pads to
    seq_buckets: tuple[int, ...] = ()  # rows a decode-only step pads to
    mixed_seq_buckets: tuple[int, ...] = ()  # rows a step with a prompt chunk pads to
    width_buckets: tuple[int, ...] = ()  # block-table columns
    max_loras: int = 0  # adapter slots on the device (0: LoRA off)
    max_lora_rank: int = 16  # the slots' rank
    max_cpu_loras: int = 0  # adapters kept in host memory
    lora_target_modules: tuple[str, ...] = ()  # the projections the slots hold

    @property
    def max_blocks(self) -> int:
        """Blocks of the longest sequence."""
        return math.ceil(self.max_model_len / self.block_size)


def resolve(
    args: EngineArgs, cfg: ModelConfig, eos_token_ids: tuple[int, ...] = (), draft: ModelConfig | None = None
) -> CoreLayout:
    """The engine's layout for `cfg` (with `draft`: a proposer model's pool shares the KV memory); what
    it cannot serve is a ValueError naming the argument."""
    max_model_len = engine_max_model_len(cfg, args)
    if max_model_len > cfg.context_length:
        raise ValueError(
            f"EngineArgs.max_model_len ({max_model_len}) exceeds the model's "
            f"context length ({cfg.context_length}: max_position_embeddings with its RoPE scaling)"
        )
    ep = args.expert_parallel()
    if ep > 1 and not cfg.num_experts:
        raise ValueError(f"EngineArgs.expert_parallel_size ({ep}) needs a mixture-of-experts model (this is dense)")
    if ep > 1 and cfg.num_experts % ep:
        raise ValueError(
            f"EngineArgs.expert_parallel_size ({ep}) must divide the model's num_experts ({cfg.num_experts})"
        )
    check_context_parallel(args, cfg)
    if args.enable_lora and cfg.num_experts:
        raise ValueError("EngineArgs.enable_lora needs a dense model (adapters on a mixture of experts are not served)")
    budget = step_token_budget(args, max_model_len)
    max_seqs, max_blocks = args.max_num_seqs, math.ceil(max_model_len / args.block_size)
    if args.runner == "pooling":  # pooling keeps no KV: the pool is one sequence's, the least the runner takes
        num_blocks = max_blocks
    else:
        num_blocks = args.num_gpu_blocks_override or blocks_from_memory(cfg, args, budget, draft)
    if num_blocks * args.block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks x {args.block_size} tokens, fewer than "
            f"max_model_len ({max_model_len}); give it more memory or lower max_model_len"
        )
    attn_impl = paged_impl(args.attn_impl)
    if attn_impl == "cpu" and not cpu_paged_attention.reads(kv_storage_dtype(args.kv_cache_dtype, cfg.dtype)):
        attn_impl = "xla"  # what the attention layers run instead: its tile plans are built here
    spec = args.speculative()
    return CoreLayout(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=args.block_size,
        num_blocks=num_blocks,
        eos_token_ids=tuple(dict.fromkeys((*cfg.eos_token_id, *eos_token_ids))),
        enable_chunked_prefill=args.enable_chunked_prefill,
        prefill_tokens_per_decode=args.prefill_tokens_per_decode,
        pairs_per_token=(
            cfg.attention_pairs_per_token if args.prefill_pairs_per_token is None else args.prefill_pairs_per_token
        ),
        scheduling_policy=args.scheduling_policy,
        num_scheduler_steps=args.num_scheduler_steps,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        disable_spec_above=spec.disable_by_batch_size if spec is not None else None,
        kv_cache_dtype=args.kv_cache_dtype,
        attn_impl=attn_impl,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel_size=ep,
        context_parallel_size=args.context_parallel_size,
        scan_layers=args.scan_layers,
        max_loras=args.max_loras if args.enable_lora else 0,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras or args.max_loras,
        lora_target_modules=args.lora_modules(),
        # A prompt chunk beside the decodes pads to the next power of two (its matmuls cost what it pads
        # to; coarser buckets, x4, made 16 decodes + a 64-token prompt a 256-token step)
        token_buckets=tuple(buckets(budget, min(16, budget))),
        seq_buckets=tuple(buckets(max_seqs, 1)),
        # Rows of a step with a prompt chunk: coarser, since each pairs with the token buckets
        mixed_seq_buckets=tuple(buckets(max_seqs, min(16, max_seqs), factor=4)),
        # Block-table columns (both attention implementations read only the pages a batch uses); below
        # 16 pages a narrower table saves less than its compiled shapes cost at start-up.
        width_buckets=tuple(buckets(max_blocks, min(16, max_blocks), factor=4)),
    )


def check_context_parallel(args: EngineArgs, cfg: ModelConfig) -> None:
    """context_parallel_size > 1 needs a dense model and a mesh (x tensor_parallel_size) that divides
    the devices; else a ValueError naming the argument."""
    cp, devices = args.context_parallel_size, len(jax.devices())
    if cp == 1:
        return
    if cfg.num_experts:
        raise ValueError(f"EngineArgs.context_parallel_size ({cp}) needs a dense model (this is a mixture of experts)")
    if devices % (cp * args.tensor_parallel_size):
        raise ValueError(
            f"EngineArgs.context_parallel_size ({cp}) x tensor_parallel_size ({args.tensor_parallel_size}) "
            f"must divide the {devices} devices"
        )


def blocks_from_memory(cfg: ModelConfig, args: EngineArgs, step_tokens: int, draft: ModelConfig | None = None) -> int:
    """KV blocks for this device's memory (what is in use now: the weights, a draft's or head's too,
    all on the first device until the runner shards them); their pool shares the budget."""
    device = jax.devices()[0]
    if device.platform == "gpu" and args.kv_cache_memory is None:
        memory = DeviceMemory.from_stats(device.memory_stats(), xla_mem_fraction())
        return kv_cache_blocks(cfg, args, step_tokens, memory, memory.in_use, draft)
    return kv_cache_blocks(cfg, args, step_tokens, draft=draft)
