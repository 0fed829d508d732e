"""The proposer interface: the scheduler's side of every method (`HostProposer`), the runner's side of
a method that drafts on device (`DeviceProposer`), and `PROPOSERS`, which builds both from `method`.

Nothing outside spec_decode/ names a method: the scheduler calls a HostProposer's hooks around each
step and the runner a DeviceProposer's (prepare -> propose -> step or verify -> accept). Import this
module only where the runner is already imported (the engine core), or for types: the device
proposers it builds import the runner's modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax

from jaxinfra.config import ModelConfig
from jaxinfra.loading import load_model, model_dir
from jaxinfra.models import LlamaModel
from jaxinfra.models.eagle import load_eagle_head
from serve.core.host_transfer import Layout
from serve.core.runner.device_step import DeviceStep
from serve.core.runner.inflight import InFlight
from serve.core.runner.inputs import StepBatch
from serve.core.sequence import Sequence
from serve.core.spec_decode.config import SpeculativeConfig
from serve.core.spec_decode.draft_model import DraftModelRunner
from serve.core.spec_decode.draft_slots import DraftSlots
from serve.core.spec_decode.eagle import EagleRunner
from serve.core.spec_decode.eagle_drafts import EagleDrafts
from serve.core.spec_decode.ngram_proposer import NgramProposer
from serve.core.step_data import SchedulerOutput, StepResult

if TYPE_CHECKING:
    from serve.config import EngineArgs


class HostProposer(Protocol):
    """The scheduler's side: each decode's drafts (at most k), the KV slots a step needs past its own
    tokens (`lookahead`), and hooks around each step."""

    k: int
    lookahead: int

    def propose_seqs(self, seqs: list[Sequence], max_new: list[int]) -> list[list[int]]:
        """Each row's drafts, at most max_new[b] tokens."""
        ...

    def before_step(self, sched: SchedulerOutput) -> None:
        """A step was scheduled (before its tokens are counted computed)."""
        ...

    def after_step(self, sched: SchedulerOutput, res: StepResult) -> None:
        """A step's results came back (before its tokens are appended)."""
        ...


class DeviceProposer(Protocol):
    """The runner's side of a method that drafts on device, on its own KV pool beside the target's;
    `verify_min_rows`: a verify step's rows are padded to at least this many."""

    kv_cache: Any
    verify_min_rows: int

    @property
    def num_compilations(self) -> int:
        """Its own step shapes compiled so far."""
        ...

    def before_step(self, batch: StepBatch, buffers: Any, layout: Layout, prev_tokens: jax.Array) -> Any:
        """Its work before the target's step; returns the step's packed inputs (on device if read twice)."""
        ...

    def verify(
        self,
        verify: Any,
        weights: list,
        kv_cache: Any,
        buffers: Any,
        prev_tokens: jax.Array,
        *,
        layout: Layout,
        max_q_len: int,
    ) -> tuple:
        """The target's verify step over its drafts (`verify`: the target's jitted one, drafts packed)."""
        ...

    def after_step(
        self,
        flight: InFlight,
        weights: list,
        hidden: list,
        buffers: Any,
        layout: Layout,
        prev_tokens: jax.Array,
        last: jax.Array,
    ) -> None:
        """Its work after the target's step (`hidden`: the step's hidden states, if it asked for them)."""
        ...


StepOf = Callable[[LlamaModel], tuple[DeviceStep, list]]  # a model's step closure and weights, as the runner's


class DeviceBuilder(Protocol):
    """Places a DeviceProposer beside the target's step (its KV pool of `num_blocks` blocks)."""

    def __call__(
        self, target: DeviceStep, step_of: StepOf, num_blocks: int, kv_cache_dtype: str, max_len: int, /
    ) -> DeviceProposer: ...


@dataclasses.dataclass(frozen=True)
class Proposer:
    """A configured method: its scheduler side and, if it drafts on device, its model's config (its
    weights and KV pool share the device's memory) and its runner side's builder."""

    host: HostProposer
    draft_cfg: ModelConfig | None = None
    device: DeviceBuilder | None = None
    target_hidden: bool = False  # the target's single and verify steps also return their hidden states


def _on_device(spec: SpeculativeConfig, args: EngineArgs) -> str:
    """What a device proposer cannot serve with yet is refused here; returns its model's path."""
    for name in ("tensor_parallel_size", "num_scheduler_steps"):
        if (value := getattr(args, name)) != 1:
            raise ValueError(f"EngineArgs.{name} must be 1 with speculative_config.method {spec.method}, got {value}")
    assert spec.model is not None
    return spec.model


def _ngram(spec: SpeculativeConfig, target: ModelConfig, args: EngineArgs) -> Proposer:
    return Proposer(NgramProposer(spec))


def _draft_model(spec: SpeculativeConfig, target: ModelConfig, args: EngineArgs) -> Proposer:
    """A draft model (its vocabulary was checked against the target's) in the target's dtype."""
    draft = load_model(_on_device(spec, args), target.dtype, attn_impl=args.attn_impl)

    def build(target: DeviceStep, step_of: StepOf, num_blocks: int, dtype: str, _: int) -> DeviceProposer:
        return DraftModelRunner(target, *step_of(draft), num_blocks=num_blocks, kv_cache_dtype=dtype)

    return Proposer(DraftSlots(spec.num_speculative_tokens), draft.cfg, build)


def _eagle(spec: SpeculativeConfig, target: ModelConfig, args: EngineArgs) -> Proposer:
    """An EAGLE head (checked against the target's shape) in the target's dtype."""
    head = load_eagle_head(model_dir(_on_device(spec, args)), target, attn_impl=args.attn_impl)
    k = spec.num_speculative_tokens

    def build(target: DeviceStep, _: StepOf, num_blocks: int, dtype: str, max_len: int) -> DeviceProposer:
        return EagleRunner(target, head, k, num_blocks=num_blocks, kv_cache_dtype=dtype, max_len=max_len)

    return Proposer(EagleDrafts(k), head.cfg, build, target_hidden=True)  # the head's features


# method -> its builder, from the config, the target model's config and the engine's arguments
PROPOSERS: dict[str, Callable[[SpeculativeConfig, ModelConfig, EngineArgs], Proposer]] = {
    "ngram": _ngram,
    "draft_model": _draft_model,
    "eagle": _eagle,
}
