"""A dispatched step: the device arrays it fills, and their host copies once it is done."""

from __future__ import annotations

import dataclasses

import jax

from serve.core.runner.inputs import StepBatch
from serve.core.sampler import SamplerOutput
from serve.core.step_data import StepResult


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its batch and the device arrays it will fill."""

    batch: StepBatch
    out: SamplerOutput
    prompt: tuple[jax.Array, ...]  # prompt logprob arrays, empty for a decode loop
    num_emitted: jax.Array | None = None  # verify step: tokens each row emitted (out.tokens [S, k+1])
    expert_counts: jax.Array | None = None  # MoE models: token copies per expert [MoE layers, experts]
    drafts: jax.Array | None = None  # EAGLE: the next step's drafts [S, k] (-1 pads)

    def wait(self) -> None:
        """Block until the device has finished the step."""
        jax.block_until_ready(self.out.tokens)

    def fetch(self) -> StepResult:
        """The step's results on the host: tokens, and logprobs only when a row asked for them."""
        want_lp = bool(self.batch.sampling.logprobs.any())
        arrays = [self.out.tokens, *((self.out.logprob, self.out.top_ids, self.out.top_logprobs) if want_lp else ())]
        if self.batch.prompt_logprobs:
            arrays += list(self.prompt)
        extra = [a for a in (self.expert_counts, self.num_emitted, self.drafts) if a is not None]
        host = jax.device_get([*arrays, *extra])  # one transfer, whatever the step returned
        drafts = None if self.drafts is None else host.pop()
        res = StepResult(host[0], None if self.num_emitted is None else host.pop(), drafts=drafts)
        res.expert_counts = None if self.expert_counts is None else host.pop()
        if want_lp:
            res.logprobs = (host[1], host[2], host[3])
        if self.batch.prompt_logprobs:
            res.prompt_logprobs = (host[-3], host[-2], host[-1])
        return res
