"""Speculative decoding: a config, proposers (n-gram on the host; the draft model's slots, its device
side in draft_model), the rejection sampler and counters."""

from serve.spec_decode.config import SPEC_METHODS, SpeculativeConfig
from serve.spec_decode.draft_slots import DraftSlots
from serve.spec_decode.ngram_proposer import NgramProposer
from serve.spec_decode.rejection_sampler import SpecOutput, rejection_sample
from serve.spec_decode.stats import SpecDecodingStats

__all__ = [
    "SPEC_METHODS",
    "DraftSlots",
    "NgramProposer",
    "SpecDecodingStats",
    "SpecOutput",
    "SpeculativeConfig",
    "rejection_sample",
]
