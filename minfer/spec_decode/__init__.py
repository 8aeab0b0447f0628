"""Speculative decoding (chapter 7b; Leviathan et al., 2023, arXiv:2211.17192; Chen et al., 2023,
arXiv:2302.01318): propose k cheap tokens, verify them with one target forward over k + 1 positions.

    ngram.NgramProposer            prompt lookup: the tokens that followed the sequence's suffix earlier on
    draft_model.DraftModelProposer a small model with its own paged KV pool, k decode steps per proposal
    rejection.rejection_sample     accept/reject the drafts (exact match for greedy; min(1, p/q) for sampling)
    metrics.SpecDecodeMetrics      vLLM's counters: drafts, draft tokens, accepted tokens (per position)

The engine asks the proposer for drafts before scheduling (`Sequence.spec_token_ids`); the scheduler gives a
speculating sequence k + 1 slots; the worker runs it as a (k + 1)-token chunk and calls `rejection_sample`;
the engine appends what was accepted and gives back the rejected slots (`BlockManager.free_tail`).
"""

from minfer.spec_decode.metrics import SpecDecodeMetrics
from minfer.spec_decode.ngram import NgramProposer
from minfer.spec_decode.rejection import rejection_sample, speculation_supported

__all__ = ["NgramProposer", "SpecDecodeMetrics", "rejection_sample", "speculation_supported"]
