"""Test proposers that know the answer (the target's own output) and corrupt it on purpose.

They exercise every acceptance pattern of the loop: whole chains accepted, rejections at every depth, trees whose
correct child is not the first, rows of a batch accepting different numbers of tokens.
"""

from __future__ import annotations

import random

import torch

from hf_specdec.proposers.base import Proposer
from hf_specdec.tree import DraftTree


class OracleChain(Proposer):
    name = "oracle_chain"

    def __init__(self, reference: torch.LongTensor, k: int = 5, error_rate: float = 0.25, seed: int = 0,
                 vocab: int = 96):
        self.ref = reference
        self.k = k
        self.max_nodes = k + 1
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, state):
        bsz = state.batch_size
        drafts = torch.zeros(bsz, self.k, dtype=torch.long)
        counts = []
        for b in range(bsz):
            n = min(state.max_drafts[b], self.k, self.rng.randint(0, self.k))
            start = state.lengths[b]
            true = self.ref[b, start:start + n].tolist()
            row = [t if self.rng.random() > self.error_rate else self.rng.randrange(3, self.vocab) for t in true]
            drafts[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            counts.append(len(row))
        return DraftTree.chain(state.roots(), drafts, torch.tensor(counts))


class OracleTree(Proposer):
    """Random trees (different per row) that contain the true continuation, or a corrupted one, at a random
    sibling rank, with random decoy branches."""

    name = "oracle_tree"

    def __init__(self, reference: torch.LongTensor, depth: int = 4, width: int = 3, error_rate: float = 0.2,
                 seed: int = 0, vocab: int = 96):
        self.ref = reference
        self.depth = depth
        self.width = width
        self.max_nodes = 1 + depth * width * 2
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.vocab = vocab

    def _row(self, true: list[int]):
        tokens, parents = [None], [-1]
        node = 0
        for t in true:
            if self.rng.random() < self.error_rate:
                t = self.rng.randrange(3, self.vocab)
            decoys = [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(0, self.width - 1))]
            decoys = [d for d in decoys if d != t]
            rank = self.rng.randint(0, len(decoys))
            kids = decoys[:rank] + [t] + decoys[rank:]
            true_node = None
            for tok in kids:
                tokens.append(tok)
                parents.append(node)
                if tok == t and true_node is None:
                    true_node = len(tokens) - 1
                # a decoy may get one child of its own
                if tok != t and self.rng.random() < 0.3:
                    tokens.append(self.rng.randrange(3, self.vocab))
                    parents.append(len(tokens) - 2)
            node = true_node
        return tokens, parents

    def propose(self, state):
        bsz = state.batch_size
        rows = []
        for b in range(bsz):
            n = min(state.max_drafts[b], self.depth)
            start = state.lengths[b]
            rows.append(self._row(self.ref[b, start:start + n].tolist()))
        width = max(len(t) for t, _ in rows)
        tokens = torch.zeros(bsz, width, dtype=torch.long)
        parents = torch.zeros(bsz, width, dtype=torch.long)
        valid = torch.zeros(bsz, width, dtype=torch.bool)
        roots = state.roots()
        # keep the depth of every node within the row's budget (decoy children may go one deeper)
        for b, (toks, pars) in enumerate(rows):
            depth = [0] * len(toks)
            for i in range(1, len(toks)):
                depth[i] = depth[pars[i]] + 1
            keep = [i for i in range(len(toks)) if depth[i] <= state.max_drafts[b]]
            remap = {old: new for new, old in enumerate(keep)}
            for new, old in enumerate(keep):
                tokens[b, new] = roots[b] if old == 0 else toks[old]
                parents[b, new] = -1 if old == 0 else remap[pars[old]]
                valid[b, new] = True
            parents[b, len(keep):] = 0
        return DraftTree(tokens=tokens, parents=parents, valid=valid)
