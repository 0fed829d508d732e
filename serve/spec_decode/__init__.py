"""Speculative decoding: a config, proposers (n-gram on the host) and the rejection sampler."""

from serve.spec_decode.config import SPEC_METHODS, SpeculativeConfig
from serve.spec_decode.ngram_proposer import NgramProposer
from serve.spec_decode.rejection_sampler import rejection_sample

__all__ = ["SPEC_METHODS", "NgramProposer", "SpeculativeConfig", "rejection_sample"]
