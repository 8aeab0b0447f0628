"""Speculative-decoding counters with vLLM's names (`vllm:spec_decode_*`, here `minfer:spec_decode_*`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    """Cumulative counts since the engine started.

    num_drafts: verification rounds (one per speculating sequence per step).
    num_draft_tokens: tokens proposed. num_accepted_tokens: of which accepted.
    num_accepted_tokens_per_pos[i]: drafts whose token i (0-based) was accepted; acceptance at position i is
        this / num_drafts_per_pos[i] (drafts that had a token i).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        grow = num_proposed - len(self.num_drafts_per_pos)
        if grow > 0:
            self.num_drafts_per_pos += [0] * grow
            self.num_accepted_tokens_per_pos += [0] * grow
        for i in range(num_proposed):  # k is a handful of positions, not tokens of the sequence
            self.num_drafts_per_pos[i] += 1
            self.num_accepted_tokens_per_pos[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (vLLM's draft acceptance rate), 0 when nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round: accepted drafts + the corrected or bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
