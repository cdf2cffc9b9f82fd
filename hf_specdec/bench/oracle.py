"""The oracle proposer (benchmark only): drafts the target's own greedy continuation, computed beforehand.

Every draft is accepted, so the acceptance length is ``k + 1`` and what the method costs beyond its forwards is
the engine's own overhead: it measures the loop, not a drafter.
"""

from __future__ import annotations

import torch

from ..proposers.base import Proposer
from ..tree import DraftTree


class OracleProposer(Proposer):
    def __init__(self, reference: torch.LongTensor, k: int):
        self.reference = reference  # [B, L] the plain greedy output of the same call
        self.k = k
        self.max_nodes = k + 1
        self.name = f"oracle:{k}"

    def propose(self, state):
        bsz = state.batch_size
        drafts = torch.zeros(bsz, self.k, dtype=torch.long, device=state.device)
        counts = []
        for b in range(bsz):
            start = state.lengths[b]
            n = max(min(self.k, state.max_drafts[b], self.reference.shape[1] - start), 0)
            if n:
                drafts[b, :n] = self.reference[b, start:start + n].to(state.device)
            counts.append(n)
        if not any(counts):
            return None
        return DraftTree.chain(state.roots(), drafts, torch.tensor(counts, device=state.device))
