"""Disaggregation, scheduler side: waiting prompts whose KV a remote engine computed hold blocks and
wait out of the queue while the worker pulls those tokens, then rejoin it at the front."""

from __future__ import annotations

from serve.core.kv_cache import BlockManager
from serve.core.scheduling_policy import FcfsPolicy
from serve.core.sequence import Sequence
from serve.kv_transfer.base import KVConnectorBase


class RemoteLoads:
    """The sequences whose remote KV is loading, by seq id, and the connector that says what to load."""

    def __init__(self, connector: KVConnectorBase, bm: BlockManager) -> None:
        self.connector = connector
        self.bm = bm
        self.loading: dict[int, Sequence] = {}

    def next_waiting(self, waiting: FcfsPolicy) -> Sequence:
        """The waiting sequence to admit next: the first that holds blocks (its remote KV loaded: at most
        one more block to run), else the head. A head short of blocks must not wait for those: a deadlock."""
        return next((seq for seq in waiting if seq.block_ids), None) or waiting.head()

    def start(self, seq: Sequence, waiting: FcfsPolicy) -> bool:
        """The next of `waiting`, if a remote engine computed its prompt: blocks for those tokens, out of
        the queue while the worker loads them (this step); True if so."""
        external = self.connector.get_num_new_matched_tokens(seq, seq.num_computed_tokens)
        if external == 0 or not self.bm.allocate_slots(seq, external):
            return False
        self.connector.update_state_after_alloc(seq, seq.block_ids, external)
        seq.num_computed_tokens += external
        waiting.remove(seq)
        self.loading[seq.seq_id] = seq
        return True

    def drop(self, seq: Sequence) -> bool:
        """Forget a sequence that leaves (finished or aborted); whether it was loading."""
        return self.loading.pop(seq.seq_id, None) is not None

    def finish(self, loaded: set[str], failed: set[str]) -> list[Sequence]:
        """The worker loaded (or failed to load: recompute past the local prefix) these requests' remote
        KV: the sequences to put back at the front of the queue, computed."""
        done = []
        for seq in list(self.loading.values()):
            if seq.request_id in failed:
                seq.num_computed_tokens = seq.num_cached_tokens
            elif seq.request_id not in loaded:
                continue
            del self.loading[seq.seq_id]
            seq.kv_transfer_params = None  # pulled or gone: never asked for again (a preemption recomputes)
            done.append(seq)
        return done
