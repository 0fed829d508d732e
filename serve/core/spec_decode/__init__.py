"""Speculative decoding: a config, proposers (n-gram on the host; the draft model's slots and the EAGLE
head's drafts, their device sides in draft_model and eagle) behind the interface and registry of
`proposer` (imported from there, not here: its device sides import the runner), the rejection
sampler and counters."""

from serve.core.spec_decode.config import SPEC_METHODS, SpeculativeConfig
from serve.core.spec_decode.draft_slots import DraftSlots
from serve.core.spec_decode.eagle_drafts import EagleDrafts
from serve.core.spec_decode.ngram_proposer import NgramProposer
from serve.core.spec_decode.rejection_sampler import SpecOutput, rejection_sample
from serve.core.spec_decode.stats import SpecDecodingStats

__all__ = [
    "SPEC_METHODS",
    "DraftSlots",
    "EagleDrafts",
    "NgramProposer",
    "SpecDecodingStats",
    "SpecOutput",
    "SpeculativeConfig",
    "rejection_sample",
]
