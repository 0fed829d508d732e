"""Engine arguments with vLLM's names and meanings, loadable from configs/serve/*.yaml."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxinfra.config import DTYPES as MODEL_DTYPES
from jaxinfra.loading import DEFAULT_MODEL, QUANTIZATION_CHOICES
from jaxinfra.lora.config import TARGET_MODULES
from jaxinfra.yaml_config import load_config
from pallas_kernels import BLOCK_SIZES, PAGED_IMPLS
from serve.core.pooling.config import CONVERTS, RUNNERS, PoolerConfig, engine_pooling_spec
from serve.core.spec_decode.config import SpeculativeConfig
from serve.kv_transfer.config import KV_ROLES, KVTransferConfig

DTYPES = ("auto", *MODEL_DTYPES)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # fp8 = fp8_e4m3 (vLLM's names)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> jnp.dtype:
    """The paged pools' element dtype: the model's ("auto"), int8, or float8 e4m3."""
    if kv_cache_dtype == "int8":
        return jnp.dtype(jnp.int8)
    if kv_cache_dtype.startswith("fp8"):
        return jnp.dtype(jnp.float8_e4m3fn)
    return jnp.dtype(model_dtype)


def default_compilation_cache_dir() -> str:
    """JAX's persistent compilation cache: $JAXINFRA_CACHE_DIR, else the user's cache directory."""
    base = os.environ.get("JAXINFRA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxinfra"
    )
    return os.path.join(base, "jax-compilation-cache")


SCHEDULING_POLICIES = ("fcfs", "priority", "fair")


@dataclasses.dataclass
class EngineArgs:
    """The engine's arguments; `jaxinfra serve` makes one flag of each field, its docstring the help."""

    model: str = DEFAULT_MODEL
    """Local Hugging Face directory, training run directory or preset name (default: the embedded model)."""
    tokenizer: str | None = None
    """Tokenizer directory (default: the model's)."""
    dtype: str = "auto"
    """Weights' and activations' dtype: auto (the checkpoint's), float32, bfloat16 or float16."""
    seed: int = 0
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int | None = None
    """Prompt plus output tokens per sequence (default: the model's max_position_embeddings, capped at 4096)."""
    max_num_seqs: int = 256
    """Sequences running at once."""
    max_num_batched_tokens: int | None = None
    """Tokens per step (default: 2048 with chunked prefill, else max_model_len)."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    prefill_tokens_per_decode: int = 0
    """Chunked prefill while sequences decode: a step takes at most this many prompt tokens per running
    sequence (counted as at least 16), so a step that carries new prompts costs a small multiple of a
    decode step and streams keep an even pace; 0 = prompts fill the whole token budget (vLLM's way)."""
    prefill_pairs_per_token: int | None = None
    """With prefill_tokens_per_decode: the query-key pairs a step's prompt chunks may read per token of
    that cap, so chunks deep in a long prompt shrink (down to a token every few steps) instead of
    stalling the decodes (default: the model's FLOP ratio, ModelConfig.attention_pairs_per_token;
    0 = tokens only)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory for weights, activations and the KV pool."""
    num_gpu_blocks_override: int | None = None
    """KV blocks to allocate, whatever the memory."""
    kv_cache_memory: int | None = None
    """Bytes of KV pool on each device, whatever gpu_memory_utilization says (default off GPU: 256 MiB)."""
    kv_cache_dtype: str = "auto"
    """auto | int8 | fp8 (e4m3): quantized with a scale per token and head."""
    quantization: str | None = None
    """The checkpoint's method (default: read from its config.json), or int8 / int4 to round a dense
    model's linears as it loads (W8A16, W4A16 group 128)."""
    tensor_parallel_size: int = 1
    """Devices the weights and KV pools are split over (heads)."""
    enable_expert_parallel: bool = False
    """MoE models: split the experts over the tensor-parallel devices instead of each expert's MLP
    (vLLM's flag: expert_parallel_size = tensor_parallel_size)."""
    expert_parallel_size: int = 1
    """MoE models: devices the experts are split over, a multiple of tensor_parallel_size (attention is
    replicated over the extra ones); tokens travel to their experts' devices and back."""
    context_parallel_size: int = 1
    """Devices each step's tokens are split over (a long prompt's chunk prefilled in parallel, its keys
    all-gathered per layer); weights and KV pools are replicated over them. Dense models only."""
    attn_impl: str | None = None
    """pallas | xla | reference (default: pallas on GPU, xla elsewhere)."""
    scan_layers: bool = True
    """Run identical layers as one lax.scan over their stacked weights: warm-up compiles one layer body
    whatever the depth. Off: the layers are unrolled, each reading its own weights. XLA on CPU copies a
    scanned layer's weights out of the stack on every step, so a small model there steps faster
    unrolled (configs/serve/cpu.yaml) and a deep one starts faster scanned."""
    async_scheduling: bool = True
    """Prepare step n+1 on the host while step n runs on the device."""
    num_scheduler_steps: int = 1
    """> 1: decode-only batches no waiting request could join run that many steps in one jitted loop."""
    scheduling_policy: str = "fcfs"
    """fcfs | priority (requests' `priority` orders admission and preemption, lower first; vLLM's) | fair
    (weighted fair queueing between the tenants of --api-keys-file, by their `weight`; fcfs within one)."""
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding as vLLM's JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3}
    (see serve/core/spec_decode/config.py)."""
    structured_outputs_config: dict[str, Any] | None = None
    """vLLM's structured outputs JSON; the key read is disable_additional_properties (default true: a JSON
    schema's objects that do not say otherwise allow no other keys, as vLLM's default backend; false: JSON
    Schema's lenient reading), applied by the HTTP server; a request's strict or
    structured_outputs.additional_properties wins."""
    kv_transfer_config: dict[str, Any] | None = None
    """Prefill/decode disaggregation as vLLM's JSON, e.g. {"kv_connector": "SharedMemoryConnector",
    "kv_role": "kv_producer", "offer_timeout_s": 30} (set by --role prefill|decode; serve/kv_transfer/config.py)."""
    cpu_reserved_cores: int = 0
    """Cores kept out of XLA's CPU thread pool in the engine-core process of `python -m serve`, for the
    HTTP frontend and the threads that stream each token (XLA's pool takes the others, at least one; a
    PJRT_NPROC or NPROC in the environment wins). vLLM's CPU server reserves one the same way. 0: every
    core, XLA's default."""
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    """JAX's persistent compilation cache ("" = off)."""
    background_compile: bool = True
    """Report ready once warm-up has compiled the largest step shape of each kind (every batch fits one,
    padded) and compile the others on background threads, batches padding to the smallest compiled
    shape that holds them meanwhile; off: every shape is compiled before the server answers."""
    compile_threads: int = 0
    """Threads that compile step shapes at warm-up (0: one per core, up to 8)."""
    runner: str = "generate"
    """generate | pooling (vLLM's): pooling serves /v1/embeddings, /pooling, /score and /rerank."""
    convert: str = "auto"
    """With runner pooling: auto | none (classify a *ForSequenceClassification checkpoint, else embed) |
    embed | classify (needs the checkpoint's score head)."""
    pooler_config: dict[str, Any] | None = None
    """vLLM's pooler JSON, e.g. {"pooling_type": "MEAN", "normalize": true}: MEAN, LAST or CLS (default:
    a sentence-transformers checkpoint's modules.json, else LAST, normalized)."""
    enable_lora: bool = False
    """Serve LoRA adapters: a request's LoRARequest (HTTP: its `model`) picks one, rows of different
    adapters running in one step."""
    max_loras: int = 1
    """With enable_lora: adapters on the device at once (slots; sequences of more wait for one)."""
    max_lora_rank: int = 16
    """With enable_lora: the largest adapter rank (the slots' size; an adapter of a larger rank is refused)."""
    max_cpu_loras: int | None = None
    """With enable_lora: adapters kept in host memory, least recently used dropped (default: max_loras)."""
    lora_target_modules: str | tuple[str, ...] = "all"
    """With enable_lora (SGLang's name): the projections adapters may wrap, comma-separated (q_proj,v_proj)
    or all; the device slots hold only these and deltas run only on them, an adapter wrapping another is refused."""

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"EngineArgs.{field} {why}, got {getattr(self, field)!r}")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if self.block_size not in BLOCK_SIZES:
            raise bad("block_size", f"must be one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise bad("quantization", f"must be one of {', '.join(QUANTIZATION_CHOICES)} or None")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise bad("scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.attn_impl is not None and self.attn_impl not in PAGED_IMPLS:
            raise bad("attn_impl", f"must be one of {', '.join(PAGED_IMPLS)} or None")
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
            "kv_cache_memory",
            "max_cpu_loras",
        ):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise bad(name, "must be a positive int or None")
        for name in (
            "max_num_seqs",
            "tensor_parallel_size",
            "expert_parallel_size",
            "context_parallel_size",
            "num_scheduler_steps",
            "max_loras",
            "max_lora_rank",
        ):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "must be a positive int")
        for name in ("prefill_tokens_per_decode", "cpu_reserved_cores", "compile_threads"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "must be an int >= 0")
        pairs = self.prefill_pairs_per_token
        if pairs is not None and (not is_int(pairs) or pairs < 0):
            raise bad("prefill_pairs_per_token", "must be an int >= 0 or None")
        if self.runner not in RUNNERS:
            raise bad("runner", f"must be one of {', '.join(RUNNERS)}")
        if self.convert not in CONVERTS:
            raise bad("convert", f"must be one of {', '.join(CONVERTS)}")
        PoolerConfig.parse(self.pooler_config)
        if self.runner == "pooling":
            engine_pooling_spec(self.model, self.convert, self.pooler_config)  # e.g. classify without a score head
        if not is_int(self.seed):
            raise bad("seed", "must be an int")
        if (
            isinstance(self.gpu_memory_utilization, bool)
            or not isinstance(self.gpu_memory_utilization, (int, float))
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "async_scheduling",
            "enable_expert_parallel",
            "background_compile",
            "enable_lora",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        tp = self.tensor_parallel_size
        if self.enable_expert_parallel and self.expert_parallel_size not in (1, tp):
            raise bad("expert_parallel_size", f"must be 1 or tensor_parallel_size ({tp}) with enable_expert_parallel")
        if self.expert_parallel_size > 1 and self.expert_parallel_size % tp:
            raise bad("expert_parallel_size", f"must be a multiple of tensor_parallel_size ({tp})")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise bad("max_cpu_loras", f"must be >= max_loras ({self.max_loras}) or None")
        self.lora_modules()
        if self.enable_lora and self.speculative_config is not None:
            raise bad("speculative_config", "cannot be combined with enable_lora (not supported yet)")
        if self.enable_lora and tp > 1:
            raise bad("tensor_parallel_size", "must be 1 with enable_lora (adapter slots are not sharded yet)")
        if self.context_parallel_size > 1:
            self._check_context_parallel()
        if self.speculative_config is not None:
            self.speculative()
        self.kv_transfer()
        self.lenient_json_schemas()

    def _check_context_parallel(self) -> None:
        """context_parallel_size > 1 runs the plain generate step only: what it is not combined with."""
        unsupported = {
            "speculative_config": self.speculative_config is not None,
            "enable_lora": self.enable_lora,
            "expert parallelism": self.expert_parallel() > 1,
            "runner pooling": self.runner == "pooling",
        }
        for name, on in unsupported.items():
            if on:
                raise ValueError(
                    f"EngineArgs.context_parallel_size must be 1 with {name} (not supported yet), "
                    f"got {self.context_parallel_size}"
                )

    def lora_modules(self) -> tuple[str, ...]:
        """lora_target_modules resolved to projection names in the model's order; a ValueError naming the
        field for an unknown or empty one."""
        value = self.lora_target_modules
        names = value.split(",") if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"EngineArgs.lora_target_modules must be a string or a list of strings, got {value!r}")
        wanted = {n.strip() for n in names} - {""}
        if wanted == {"all"}:
            return TARGET_MODULES
        unknown = sorted(wanted - set(TARGET_MODULES))
        if unknown or not wanted:
            raise ValueError(
                f"EngineArgs.lora_target_modules: unknown or no module(s) {unknown}; choose from "
                f"{', '.join(TARGET_MODULES)} or all, got {value!r}"
            )
        return tuple(m for m in TARGET_MODULES if m in wanted)

    def expert_parallel(self) -> int:
        """Devices the experts are split over (1: none), enable_expert_parallel resolved."""
        return self.tensor_parallel_size if self.enable_expert_parallel else self.expert_parallel_size

    def lenient_json_schemas(self) -> bool:
        """Whether JSON schemas that do not say otherwise allow extra keys (structured_outputs_config's
        disable_additional_properties false); a bad structured_outputs_config is a ValueError."""
        config = self.structured_outputs_config or {}
        field = "EngineArgs.structured_outputs_config"
        if not isinstance(config, dict) or set(config) - {"disable_additional_properties"}:
            raise ValueError(f"{field} takes only disable_additional_properties, got {config!r}")
        disable = config.get("disable_additional_properties", True)
        if not isinstance(disable, bool):
            raise ValueError(f"{field}.disable_additional_properties must be a bool, got {disable!r}")
        return not disable

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config; a bad one (or a draft with another vocabulary than the
        model's) is a ValueError naming its field."""
        if self.speculative_config is None:
            return None
        try:
            return SpeculativeConfig.from_dict(self.speculative_config, target_model=self.model)
        except ValueError as e:
            raise ValueError(f"EngineArgs.{e}") from None

    def kv_transfer(self) -> KVTransferConfig | None:
        """The parsed kv_transfer_config (None: no connector); a bad one is a ValueError naming its field."""
        if self.kv_transfer_config is None:
            return None
        try:
            return KVTransferConfig.from_dict(self.kv_transfer_config)
        except ValueError as e:
            raise ValueError(f"EngineArgs.{e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineArgs:
        """Engine arguments from configs/serve/*.yaml, `overrides` winning."""
        return load_config(cls, path, overrides, kind="engine argument")


def with_role(args: EngineArgs, role: str) -> EngineArgs:
    """The engine arguments of `jaxinfra serve --role`: prefill/decode turn the connector on (a given
    kv_transfer_config keeps its other keys), both leaves them as given."""
    if role == "both":
        return args
    return dataclasses.replace(args, kv_transfer_config={**(args.kv_transfer_config or {}), "kv_role": KV_ROLES[role]})
