"""Acceptance rules: which drafts the target keeps, and the target's own next token.

One module for every method:

* **greedy** — walk down the tree and keep the child whose token equals the target's argmax (after its logits
  processors) at the current node; the target's argmax at the last kept node is the next token. The output is
  identical to ``generate(do_sample=False)``.
* **sampling, sampled drafts** (``DraftTree.draft_probs`` given) — speculative sampling (Leviathan et al. /
  Chen et al.): accept child ``x`` drawn from ``p`` with probability ``min(1, q(x) / p(x))``; on rejection the
  target distribution becomes ``norm(max(0, q - p))`` and the next sibling is tried (SpecInfer's multi-round rule,
  exact for siblings drawn independently from ``p``); when no child is kept the next token is sampled from what
  is left of ``q``.
* **sampling, deterministic drafts** (``draft_probs`` is ``None``: prompt lookup, top-k tree children) — accept
  child ``x`` with probability ``q(x)``; on rejection remove ``x`` from ``q`` and renormalise. This is sampling
  from ``q`` by elimination, so it is exact for any fixed candidate list.
* **coupled sampling** (``noise`` given: :mod:`hf_specdec.coupling`) — the greedy rule on perturbed scores: the
  target's choice at a node of depth ``d`` is ``argmax(scores + noise[:, d])``, so every committed token is an exact
  sample of the target's distribution and the text does not depend on the drafts. When every processor is a warper
  the walk runs on the device, one depth at a time for all rows (the processors see one node per row and depth, as
  in plain decoding), with one host read; otherwise on the host with each node's own prefix.
* **typical acceptance** (Medusa, opt-in and *lossy*, sampling only) — a child ``x`` is acceptable when
  ``q(x) > min(threshold, alpha * exp(-H(q)))``; the deepest acceptable path is kept (ties: the highest summed
  ``log q``), then the next token is sampled from ``q`` at its last node. Outputs are then *not* distributed as
  the target's.

``q`` is the softmax of the target's logits after the processors and warpers of the call (temperature, top-k,
top-p, repetition penalty, ...), each applied with the node's own prefix.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .graphs import dense
from .tree import DraftTree


@dataclass
class AcceptResult:
    """What one verification step keeps.

    ``paths[b]`` are the kept tree nodes of row ``b`` (root first, so ``len(paths[b]) - 1`` drafts were accepted);
    ``new_tokens[b]`` are the tokens the row commits (accepted drafts, then the target's own token);
    ``scores[b]`` / ``logits[b]`` hold one processed / raw score row per committed token when asked for;
    ``proposed[b]`` is the number of drafts row ``b`` had in the tree.
    Inactive rows have an empty path and no tokens. ``path_index`` (``[B, W]`` on the device, ``W >= len(paths[b])``)
    holds the same paths where the rule ran on the device, so that the loop keeps cache columns without sending the
    paths back; there ``choices[b]`` is the target's argmax at every node (read with the paths: lookahead decoding
    harvests its window from them).
    """

    paths: list[list[int]]
    new_tokens: list[list[int]]
    scores: list[list[torch.Tensor]] | None = None
    logits: list[list[torch.Tensor]] | None = None
    proposed: list[int] | None = None
    path_index: torch.LongTensor | None = None
    choices: list[list[int]] | None = None

    @property
    def num_accepted(self) -> list[int]:
        return [max(len(p) - 1, 0) for p in self.paths]

    def is_prefix_paths(self) -> bool:
        """True when every kept path is the node prefix 0, 1, ..., n (always the case for chains)."""
        return all(p == list(range(len(p))) for p in self.paths)


ScoreFn = Callable[[int, torch.LongTensor, torch.Tensor], torch.Tensor]


def accept(
    tree: DraftTree,
    logits: torch.Tensor,
    prefixes: list[torch.LongTensor],
    active: list[bool],
    process: ScoreFn | None,
    do_sample: bool,
    want_scores: bool = False,
    want_logits: bool = False,
    typical: tuple[float, float] | None = None,
    noise: torch.Tensor | None = None,
    warp: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fused: Callable | None = None,
    deepest: int = 0,
) -> AcceptResult:
    """Apply the acceptance rule to a verified tree.

    Args:
        tree: the drafts that were verified.
        logits: ``[B, N, V]`` float32 target logits, one row per tree node.
        prefixes: per row, the committed token ids (``[L_b]``, padded prompt included, root last).
        active: per row, False for rows that take no new tokens.
        process: ``process(row, input_ids[1, L], logits[1, V]) -> scores[1, V]`` applies the call's logits
            processors; ``None`` when there are none.
        do_sample: sampling or greedy.
        typical: ``(threshold, alpha)`` for Medusa's typical acceptance (lossy; sampling only), or ``None``.
        noise: coupled sampling: ``[B, W, V]`` Gumbel noise, column ``d`` for the target's choice at depth ``d``
            (``W > tree.max_depth()``); ``do_sample`` is then False.
        warp: coupled sampling with warpers only: applies them to ``[n, V]`` scores at once (then ``process`` is
            not used).
        fused: how the runner runs a function of the step's tensors (:meth:`~hf_specdec.runners.TargetRunner.fused`:
            the compiled runner compiles the greedy rule into one region), or ``None``.
        deepest: the deepest tree the call may verify (its proposer's longest path less the root): a compiled coupled
            rule compiles every depth it walks up to that one at its first use (so that a later step or call of
            deeper trees compiles nothing).
    """
    if typical is not None and not do_sample:
        raise ValueError("typical acceptance is a sampling rule; greedy decoding is always exact.")
    if noise is not None and (process is None or warp is not None):
        return _coupled(tree, logits, noise, warp, active, want_scores, want_logits,
                        fused=fused(coupled_rule, oblivious=True) if fused is not None else None, deepest=deepest)
    if not do_sample and process is None:
        return _greedy(tree, logits, active, want_scores, want_logits,
                       fused=fused(greedy_rule, oblivious=True) if fused is not None else None)
    bsz = tree.batch_size
    paths, new_tokens = [], []
    scores = [] if want_scores else None
    raw = [] if want_logits else None
    tokens = tree.tokens.tolist()
    for b in range(bsz):
        if not active[b]:
            paths.append([])
            new_tokens.append([])
            if scores is not None:
                scores.append([])
            if raw is not None:
                raw.append([])
            continue
        if typical is not None:
            path, toks, row_scores, row_raw = _typical(tree, b, tokens[b], logits[b], prefixes[b], process, *typical)
        else:
            path, toks, row_scores, row_raw = _walk(tree, b, tokens[b], logits[b], prefixes[b], process, do_sample,
                                                    noise[b] if noise is not None else None)
        paths.append(path)
        new_tokens.append(toks)
        if scores is not None:
            scores.append(row_scores)
        if raw is not None:
            raw.append(row_raw)
    proposed = (tree.valid.sum(1) - 1).tolist()
    return AcceptResult(paths=paths, new_tokens=new_tokens, scores=scores, logits=raw, proposed=proposed)


def _greedy(tree: DraftTree, logits: torch.Tensor, active: list[bool], want_scores: bool,
            want_logits: bool, fused=None) -> AcceptResult:
    """The greedy rule on the device, for chains and trees, with one host read (:func:`greedy_rule`, through
    ``fused`` when given: the runner's way of running a function of the step's tensors)."""
    chain = tree.is_chain
    drafts = tree.host_drafts if chain else None
    rule = fused or greedy_rule
    packed, order = rule(tree.tokens, tree.parents, tree.valid, None if chain else tree.ancestors,
                         None if chain else tree.depths, logits, chain, drafts is None)
    rows = packed.tolist()  # the step's one host read
    if drafts is not None:
        rows = [row[:2] + [d] + row[2:] for row, d in zip(rows, drafts)]
    return _result(rows, tree.num_nodes, logits, active, want_scores, want_logits, order, chain=chain)


def greedy_rule(tokens: torch.LongTensor, parents: torch.LongTensor, valid: torch.BoolTensor,
                ancestors: torch.BoolTensor | None, depths: torch.LongTensor | None, logits: torch.Tensor,
                chain: bool, count_drafts: bool = True):
    """The greedy rule over a tree's tensors: a node is kept when its token is the target's argmax at its parent and
    every ancestor is kept; the deepest kept node ends the path (the first in node order among equals) and the
    target's argmax there is the next token. Returns ``(packed [B, ...], order [B, N])``: per row ``[accepted, next
    token, (drafts,) (path nodes,) path tokens, argmax per node]`` (drafts when ``count_drafts``; path nodes for trees
    only: a chain's are ``0..accepted``) and the path's nodes in depth order, then its last node repeated (a real node:
    of a tree padded with nodes that are not valid, never one of those). A chain needs no ``ancestors`` or
    ``depths``."""
    bsz, n = tokens.shape
    choice = logits.argmax(-1)  # [B, N]
    nodes = torch.arange(n, device=choice.device)
    counted = [valid.sum(1, keepdim=True) - 1] if count_drafts else []
    if chain:  # the path is nodes 0..n_acc: only the counts, the tokens and the choices come back
        match = (tokens[:, 1:] == choice[:, :-1]) & valid[:, 1:]
        n_acc = match.cumprod(1).sum(1)  # [B]
        nxt = choice.gather(1, n_acc[:, None])
        return torch.cat([n_acc[:, None], nxt, *counted, tokens, choice], 1), nodes.expand(bsz, n)
    ok = (tokens == choice.gather(1, parents.clamp(min=0))) & valid
    ok[:, 0] = True
    kept = ~(ancestors & ~ok[:, None, :]).any(-1) & valid  # every ancestor (itself included) ok
    last = torch.where(kept, depths, -1).argmax(1)  # [B] the first of the deepest kept nodes
    path = ancestors[torch.arange(bsz, device=choice.device), last]  # [B, N] its ancestors
    order = torch.where(path, nodes, n).sort(1).values  # path nodes first, in depth order
    order = torch.where(order < n, order, last[:, None])  # then its last node again (a real node, never padding)
    n_acc = path.sum(1) - 1
    nxt = choice.gather(1, last[:, None])
    return torch.cat([n_acc[:, None], nxt, *counted, order, tokens.gather(1, order), choice], dim=1), order


def _coupled(tree: DraftTree, logits: torch.Tensor, noise: torch.Tensor, warp, active: list[bool],
             want_scores: bool, want_logits: bool, fused=None, deepest: int = 0) -> AcceptResult:
    """Coupled sampling's rule on the device (see the module docstring; :func:`coupled_rule`, through ``fused`` when
    given: the runner's way of running a function of the step's tensors). One host read."""
    proposed = tree.host_drafts
    rule = fused or coupled_rule
    depth = tree.max_depth()
    # on a CPU without a compiled rule the walk stops as soon as every row's path has ended (reading a flag is free)
    stop_early = fused is None and logits.device.type == "cpu"
    if fused is not None:  # compiled: a graph per depth, so the walk runs to a power of 2 (past the path: repeats)
        depth = _walked(depth)
        key = (warp is None, want_scores or want_logits, proposed is None)
        walks = _WALKS.setdefault(fused, {}).setdefault(key, set())
        # first met: every walk up to the call's deepest tree compiled now (their results unused)
        top = depth if depth in walks else max(depth, _walked(deepest))
        if noise.shape[1] <= top:  # the noise of depths past the tree's is never used: zeros
            noise = torch.nn.functional.pad(noise, (0, 0, 0, top + 1 - noise.shape[1]))
        for d in sorted({(1 << b) - 1 for b in range(top.bit_length() + 1)} - walks - {depth}):
            rule(tree.tokens, tree.parents, tree.valid, logits, dense(noise[:, :d + 1]), d, warp, *key[1:])
            walks.add(d)
        walks.add(depth)
        noise = dense(noise[:, :depth + 1])  # a graph is specialised to strides: a slice of a wider block is copied
    packed, kept, scored = rule(tree.tokens, tree.parents, tree.valid, logits, noise, depth, warp,
                                want_scores or want_logits, proposed is None, stop_early)
    packed = packed.tolist()  # the step's one host read
    width = kept.shape[1]
    at = 1 + (proposed is None)  # where the path's nodes start
    paths, new_tokens = [], []
    scores = [] if want_scores else None
    raw = [] if want_logits else None
    drafts = []
    for b, row in enumerate(packed):
        count = row[0] + 1
        drafts.append(proposed[b] if proposed is not None else row[1])
        path = row[at:at + count] if active[b] else []
        toks = row[at + width:at + width + count] if active[b] else []
        paths.append(path)
        new_tokens.append(toks)
        if scores is not None:
            scores.append([scored[d][0][b] for d in range(len(path))])
        if raw is not None:
            raw.append([scored[d][1][b] for d in range(len(path))])
    return AcceptResult(paths=paths, new_tokens=new_tokens, scores=scores, logits=raw, proposed=drafts,
                        path_index=kept)


_WALKS = weakref.WeakKeyDictionary()  # a compiled coupled rule -> {its variant: the depths it walked (compiled)}


def _walked(depth: int) -> int:
    """The depth a compiled coupled rule walks for a tree of ``depth``: the next power of 2 less one."""
    return (1 << depth.bit_length()) - 1


def coupled_rule(tokens: torch.LongTensor, parents: torch.LongTensor, valid: torch.BoolTensor, logits: torch.Tensor,
                 noise: torch.Tensor, depth: int, warp, keep_scores: bool, count_drafts: bool,
                 stop_early: bool = False):
    """Coupled sampling's rule over a tree's tensors: from the root, one depth at a time for all rows, the target's
    choice ``argmax(warp(logits at the row's node) + noise[:, d])`` and the child carrying it (the first in node
    order) if there is one. Returns ``(packed [B, ...], kept [B, D'], scored)``: per row ``[accepted, (drafts,) path
    nodes, choices]`` (the path's nodes repeated past its end, the target's choice at each; drafts when
    ``count_drafts``), the path's nodes, and per depth ``(scores, raw logits)`` (``keep_scores``; else empty).
    ``stop_early``: stop once every row's path has ended (a host read per depth: eager on a CPU only)."""
    bsz = tokens.shape[0]
    rows = torch.arange(bsz, device=logits.device)
    node = torch.zeros(bsz, dtype=torch.long, device=logits.device)
    going = torch.ones(bsz, dtype=torch.bool, device=logits.device)
    nodes, choices, scored = [], [], []
    for d in range(depth + 1):
        raw = logits[rows, node]  # [B, V] each row's node at depth d
        scores = warp(raw) if warp is not None else raw
        choice = (scores + noise[:, d]).argmax(-1)
        nodes.append(node)
        choices.append(choice)
        if keep_scores:
            scored.append((scores, raw))
        if d == depth:
            break
        child = (parents == node[:, None]) & (tokens == choice[:, None]) & valid
        found = child.any(1) & going
        node = torch.where(found, child.int().argmax(1), node)
        going = found
        if stop_early and not bool(going.any()):
            break
    kept = torch.stack(nodes, 1)  # [B, D'] the path's nodes (repeated past its end)
    chosen = torch.stack(choices, 1)  # [B, D'] the target's choice at each of them
    n_acc = (kept[:, 1:] != kept[:, :-1]).sum(1) if kept.shape[1] > 1 else kept.new_zeros(bsz)
    counted = [valid.sum(1, keepdim=True) - 1] if count_drafts else []
    return torch.cat([n_acc[:, None], *counted, kept, chosen], 1), kept, scored


def _result(rows: list[list[int]], n: int, logits: torch.Tensor, active: list[bool], want_scores: bool,
            want_logits: bool, order: torch.LongTensor, chain: bool) -> AcceptResult:
    """The :class:`AcceptResult` of :func:`_greedy` from its one read: per row ``[accepted, next token, drafts,
    (path nodes,) path tokens, argmax per node]`` (path nodes only for trees: a chain's are ``0..accepted``)."""
    paths, new_tokens, proposed, choices = [], [], [], []
    scores = [] if want_scores else None
    raw = [] if want_logits else None
    at = 3 if chain else 3 + n  # where the path's tokens start
    for b, row in enumerate(rows):
        count = row[0] + 1
        proposed.append(row[2])
        choices.append(row[at + n:])
        if not active[b]:
            path, toks = [], []
        else:
            path = list(range(count)) if chain else row[3:3 + count]
            toks = row[at + 1:at + count] + [row[1]]
        paths.append(path)
        new_tokens.append(toks)
        if want_scores or want_logits:
            picked = [logits[b, i] for i in path]
            if scores is not None:
                scores.append(picked)
            if raw is not None:
                raw.append(picked)
    return AcceptResult(paths=paths, new_tokens=new_tokens, scores=scores, logits=raw, proposed=proposed,
                        path_index=order, choices=choices)


def _walk(tree: DraftTree, b: int, tokens: list[int], logits: torch.Tensor, prefix: torch.LongTensor,
          process: ScoreFn | None, do_sample: bool, noise: torch.Tensor | None = None):
    children = tree.children(b)
    node = 0
    path = [0]
    ids = prefix
    row_scores, row_raw = [], []
    while True:
        raw = logits[node]
        scores = raw if process is None else process(b, ids[None], raw[None])[0]
        row_scores.append(scores)
        row_raw.append(raw)
        kids = children[node]
        if not do_sample:
            target = int((scores if noise is None else scores + noise[len(path) - 1]).argmax())
            nxt_node = next((c for c in kids if tokens[c] == target), None)
            if nxt_node is None:
                return path, [tokens[i] for i in path[1:]] + [target], row_scores, row_raw
        else:
            q = torch.softmax(scores, dim=-1)
            nxt_node = None
            for c in kids:
                x = tokens[c]
                p = tree.draft_probs[b, c] if tree.draft_probs is not None else None
                if p is None:
                    total = q.sum()
                    if torch.rand(()) * total < q[x]:
                        nxt_node = c
                        break
                    q = q.clone()
                    q[x] = 0.0
                else:
                    if torch.rand(()) * p[x] < q[x]:
                        nxt_node = c
                        break
                    residual = (q - p).clamp_(min=0.0)
                    mass = residual.sum()
                    # q == p up to rounding: rejection had probability ~0; keep sampling from q itself
                    q = residual / mass if mass > 1e-12 else q
            if nxt_node is None:
                target = int(torch.multinomial(q / q.sum(), 1))
                return path, [tokens[i] for i in path[1:]] + [target], row_scores, row_raw
        path.append(nxt_node)
        node = nxt_node
        ids = torch.cat([ids, ids.new_tensor([tokens[node]])])


def _typical(tree: DraftTree, b: int, tokens: list[int], logits: torch.Tensor, prefix: torch.LongTensor,
             process: ScoreFn | None, threshold: float, alpha: float):
    """Medusa's typical acceptance over row ``b``'s tree (see the module docstring). Every node whose ancestors
    are all acceptable is scored once with its own prefix."""
    children = tree.children(b)
    seen = {}  # node -> (scores, raw, q)
    best = ([0], 0.0)
    stack = [(0, [0], 0.0, prefix)]
    while stack:
        node, path, logq, ids = stack.pop()
        raw = logits[node]
        scores = raw if process is None else process(b, ids[None], raw[None])[0]
        q = torch.softmax(scores, dim=-1)
        seen[node] = (scores, raw, q)
        if len(path) > len(best[0]) or (len(path) == len(best[0]) and logq > best[1]):
            best = (path, logq)
        entropy = float(-(q * torch.log(q + 1e-5)).sum())  # the reference's entropy (log of p + 1e-5)
        bar = min(threshold, alpha * math.exp(-entropy))
        for c in children[node]:
            x = tokens[c]
            if float(q[x]) > bar:
                stack.append((c, path + [c], logq + float(torch.log(q[x])), torch.cat([ids, ids.new_tensor([x])])))
    path = best[0]
    q = seen[path[-1]][2]
    target = int(torch.multinomial(q / q.sum(), 1))
    return (path, [tokens[i] for i in path[1:]] + [target], [seen[n][0] for n in path], [seen[n][1] for n in path])
