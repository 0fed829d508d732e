"""Speculative decoding: a config, proposers (n-gram on the host), the rejection sampler and counters."""

from serve.spec_decode.config import SPEC_METHODS, SpeculativeConfig
from serve.spec_decode.ngram_proposer import NgramProposer
from serve.spec_decode.rejection_sampler import SpecOutput, rejection_sample
from serve.spec_decode.stats import SpecDecodingStats

__all__ = ["SPEC_METHODS", "NgramProposer", "SpecDecodingStats", "SpecOutput", "SpeculativeConfig", "rejection_sample"]
