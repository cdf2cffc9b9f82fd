"""Oracle proposers (benchmark only): drafts from the target's own greedy continuation, computed beforehand.

:class:`OracleProposer` drafts a chain of that continuation: every draft is accepted, so the acceptance length is
``k + 1`` and what the method costs beyond its forwards is the engine's own overhead: it measures the loop, not a
drafter. :class:`ReplayProposer` runs a method's real proposer (its drafter's cost is paid) and rewrites the tokens of
its tree so that exactly a chosen number of drafts is accepted per step (``benchmarks/gpu.py``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..proposers.base import Proposer
from ..syncs import to_device
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


class ReplayProposer(Proposer):
    """A method's own proposer whose drafts are replaced so that exactly ``accept`` of them are accepted per step
    (benchmark only, greedy decoding).

    The wrapped proposer runs as it always does (its drafter's forwards, its tree building, its cache bookkeeping:
    all of its cost is paid); only the tokens of the tree it returns are rewritten, on the device and without host
    reads: along one root-to-leaf path the first ``accept`` drafts become the reference continuation (the target's
    own greedy output of the same call), every other draft a token that differs from the reference at its depth. The
    tree keeps its shape (nodes, parents, padding), so verification costs what it would; the target then accepts
    exactly ``min(accept, depth of that path)`` drafts and adds its own token, so the acceptance length is fixed at
    ``accept + 1`` and a benchmark measures the loop, not the drafter's luck.

    The path: at each depth, among the children of the path's node, the one whose subtree reaches deepest (the
    first such in node order), so a tree deep enough anywhere is used to its depth.

    Args:
        inner: the method's proposer (built by :func:`hf_specdec.build_proposer`).
        reference: ``[B, L]`` the plain greedy ``generate()`` output of the same inputs (prompt included).
        accept: drafts accepted per step (``tau - 1``).
        vocab_size: the target's vocabulary (the wrong tokens stay inside it).

    ``replay_seconds`` is the host time spent rewriting tokens in the call (a benchmark may subtract it).
    """

    def __init__(self, inner: Proposer, reference: torch.LongTensor, accept: int, vocab_size: int):
        if accept < 0:
            raise ValueError(f"accept must be >= 0 drafts per step, got {accept}.")
        self.inner = inner
        self.reference = reference  # [B, L]
        self.accept = accept
        self.vocab_size = vocab_size
        self.name = f"replay:{inner.name}"
        self.replay_seconds = 0.0

    # the loop reads these from the proposer: the wrapped one's
    @property
    def target_hidden_states(self):
        return self.inner.target_hidden_states

    @property
    def typical_acceptance(self):
        return self.inner.typical_acceptance

    @property
    def max_nodes(self):
        return self.inner.max_nodes

    @property
    def adaptive(self):
        return getattr(self.inner, "adaptive", True)

    def draft_modules(self) -> list:
        return self.inner.draft_modules()

    def network_parts(self) -> list:
        return self.inner.network_parts()

    def prepare(self, model) -> None:
        self.inner.prepare(model)

    def begin(self, state) -> None:
        self.inner.begin(state)
        self.replay_seconds = 0.0
        bsz, length = self.reference.shape
        # [B, L + max_nodes]: room for the deepest node past the end (such nodes are never accepted: no budget)
        ref = self.reference.to(state.device)
        self._ref = torch.cat([ref, ref.new_zeros(bsz, self.max_nodes + 1)], dim=1)

    def propose(self, state):
        tree = self.inner.propose(state)
        if tree is None:
            return None
        t0 = time.perf_counter()
        tree = self.replace(state, tree)
        self.replay_seconds += time.perf_counter() - t0
        return tree

    def replace(self, state, tree: DraftTree) -> DraftTree:
        """``tree`` with its drafts rewritten (see the class docstring); device operations only."""
        lengths = state.lengths
        if not isinstance(lengths, torch.Tensor):
            lengths = to_device(lengths, state.device)
        tokens, valid = tree.tokens, tree.valid  # [B, N]
        depth = tree.depths  # [B, N]
        anc = tree.ancestors  # [B, N, N]: anc[b, i, j] = j is i or one of its ancestors
        n = tokens.shape[1]
        # the reference token at each node's depth: the root is committed token lengths - 1
        index = (lengths.to(tokens.device) - 1)[:, None] + depth  # [B, N]
        node_ref = self._ref.gather(1, index.clamp(max=self._ref.shape[1] - 1))  # [B, N]
        wrong = (node_ref + 1) % self.vocab_size
        # how deep the subtree of every node reaches
        reach = (anc & valid[:, :, None]).long().mul(depth[:, :, None]).amax(dim=1)  # [B, N]
        order = torch.arange(n, 0, -1, device=tokens.device)  # ties: the first node in node order
        on_path = torch.zeros_like(valid)
        on_path[:, 0] = True
        parents = tree.parents.clamp(min=0)
        for d in range(1, self.accept + 1):
            candidate = valid & (depth == d) & on_path.gather(1, parents)  # [B, N]
            score = torch.where(candidate, reach * (n + 1) + order, torch.full_like(reach, -1))
            pick = score.argmax(dim=1, keepdim=True)  # [B, 1]
            found = score.gather(1, pick) >= 0
            on_path = on_path.scatter(1, pick, found | on_path.gather(1, pick))
        new = torch.where(on_path, node_ref, wrong)
        new[:, 0] = tokens[:, 0]  # the root stays
        new = torch.where(valid, new, tokens)  # padding nodes as they were
        return dataclasses.replace(tree, tokens=new)

    def commit(self, state, tree, result) -> None:
        self.inner.commit(state, tree, result)

    def on_compact(self, state, index) -> None:
        self.inner.on_compact(state, index)

    def end(self, state) -> None:
        self.inner.end(state)
