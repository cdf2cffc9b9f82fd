"""EAGLE-3 proposer: a dynamic draft tree (EAGLE-2) or a chain from an :class:`Eagle3Drafter`.

Drafter rows pair a target feature with the *next* token: row ``t`` = ``(h_t, x_{t+1})`` at position ``t``. Every
target cache column therefore has exactly one drafter row (its feature, the token of the row's next column, or the
root for the last one), so the drafter's KV cache mirrors the target cache's column layout, holes included: after a
step the rows of the accepted path are fed with the target's own features of those nodes; tree rows drafted from
the drafter's own outputs are thrown away.

Tree expansion (Li et al., EAGLE-2): the root row's logits give ``top_k`` depth-1 nodes; at every further depth the
``top_k`` best frontier nodes (by cumulative log-probability) are expanded by ``top_k`` children each; finally the
``total_tokens - 1`` best nodes of all depths form the tree. Children are deterministic top-k picks, so the sampling
verifier uses its rule for deterministic drafts (exact). The chain mode (``num_speculative_tokens``) drafts the
argmax, or samples from the drafter's distribution when the call samples (exact speculative sampling).
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from ..conversions.eagle3 import LAYOUTS, convert_eagle3, export_eagle3
from ..costs import batch_cap
from ..default_model import MODEL_ID as SMOLLM2
from ..modeling.eagle3 import Eagle3Drafter
from ..registry import SCHEDULE, DrafterSpec, Method, Option, Shorthand
from ..tree import DraftTree, build_attention_mask
from .features import FeatureDrafterProposer
from .hybrid import HYBRID

# The dynamic tree's defaults per device type of the target: the reference's on accelerators; on a CPU in fp32 a
# forward over 5+ tokens costs much more than over 4 and every depth is a drafter forward on the critical path, so a
# small tree of three drafts (benchmarks/RESULTS.md, "τ per tree shape"); on a CPU in half precision a forward over 8
# tokens costs about one step, so a wider and deeper tree ("bfloat16 on the CPU").
TREE_DEFAULTS = {"cpu": {"top_k": 2, "depth": 3, "total_tokens": 4},
                 "cpu-half": {"top_k": 3, "depth": 4, "total_tokens": 8}}
REFERENCE_TREE = {"top_k": 10, "depth": 7, "total_tokens": 60}


def default_tree(device, dtype: torch.dtype | None = None) -> dict:
    """``top_k`` / ``depth`` / ``total_tokens`` of the dynamic tree for a target on ``device`` in ``dtype``."""
    kind = torch.device(device).type
    if kind == "cpu" and dtype in (torch.bfloat16, torch.float16):
        kind = "cpu-half"
    return dict(TREE_DEFAULTS.get(kind, REFERENCE_TREE))


class Eagle3Proposer(FeatureDrafterProposer):
    """Args:
        drafter: an ``Eagle3Drafter`` (bound to the target in ``prepare``).
        top_k, depth, total_tokens: the dynamic tree (reference defaults 10 / 7 / 60; ``generate`` with
            ``custom_generate="hf_specdec/eagle3"`` uses :func:`default_tree` for the target's device when the
            ``tree_*`` options are not given: 2 / 3 / 4 on a CPU in fp32, 3 / 4 / 8 in half precision).
        num_speculative_tokens: draft a chain of this length instead of a tree.
        adaptive: verify only as many of the best ``total_tokens - 1`` nodes as pay for their cost (the loop's
            measured forward costs, the drafter's calibrated probabilities); ``False`` always verifies them all.
            When even the best tree cannot pay for the drafting itself (measured time of a proposal, in units of a
            one-token target step), the tree is not drafted for the next 1, 2, 4 .. 16 steps; the
            drafter catches up on the skipped context at the next proposal. A chain is cut the same way: drafting
            stops once no row's next draft could add 2 % to its expected acceptance, and each row verifies the
            drafts that pay for their verification.
    """

    name = "eagle3"

    def __init__(self, drafter, top_k: int = REFERENCE_TREE["top_k"], depth: int = REFERENCE_TREE["depth"],
                 total_tokens: int = REFERENCE_TREE["total_tokens"],
                 num_speculative_tokens: int | None = None, adaptive: bool = True):
        if num_speculative_tokens is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}.")
        if num_speculative_tokens is None and not (top_k >= 1 and depth >= 1 and total_tokens >= 2):
            raise ValueError("The EAGLE-3 tree needs top_k >= 1, depth >= 1 and total_tokens >= 2.")
        super().__init__(drafter, adaptive)
        self.chain = num_speculative_tokens
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self.max_nodes = (num_speculative_tokens + 1) if num_speculative_tokens else total_tokens

    def begin(self, state) -> None:
        super().begin(state)
        self._worth = None

    # ---- drafter forwards
    def _mask(self, state, past_valid, past_pos, new_pos, new_attends):
        return build_attention_mask(self.drafter.config, past_valid.to(self.device), past_pos.to(self.device),
                                    new_pos.to(self.device), new_attends.to(self.device), self.dtype)

    def _feed_context(self, state):
        """Feed the drafter rows of the target columns it has not seen; return the root rows' outputs."""
        layout = state.layout
        start, end = self.synced, layout.length
        bsz = state.batch_size
        valid = layout.valid[:, start:end]
        # the token after each column: the row's next real column, or the root after its last one
        next_tok = torch.empty_like(layout.tokens[:, start:end])
        roots = state.roots()
        for b in range(bsz):
            following = int(roots[b])
            row_valid = valid[b].tolist()
            row_tok = layout.tokens[b, start:end].tolist()
            for j in range(end - start - 1, -1, -1):
                next_tok[b, j] = following
                if row_valid[j]:
                    following = row_tok[j]
        mask = self._context_mask(state, start, end)
        logits, hidden = self._draft_forward(next_tok.to(self.device), self.features[:, start:end],
                                             layout.positions[:, start:end].to(self.device), mask, step=0)
        self.synced = end
        # the root row of a row is its last real column
        idx = (layout.last_real() - start).clamp(min=0).to(self.device)
        root_logits = logits.gather(1, idx[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        root_hidden = hidden.gather(1, idx[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        return root_logits, root_hidden

    def propose(self, state):
        backs_off = self.adaptive
        if backs_off and self.backoff.skipping():
            return None
        start = time.perf_counter()
        if self.synced > state.layout.length:  # cannot happen unless the layout was rebuilt
            self.cache, self.synced = DynamicCache(), 0
        fed = state.layout.length - self.synced
        root_logits, root_hidden = self._feed_context(state)
        context = self.synced
        if fed > self.BACKLOG:  # the prompt, or a backlog after skipped steps: time the tree alone
            start = time.perf_counter()
        self._worth = None
        try:
            if self.chain:
                return self._chain(state, root_logits, root_hidden)
            return self._tree(state, root_logits, root_hidden)
        finally:
            cache_ops.crop(self.cache, context)  # tree rows are drafter guesses: never kept
            if backs_off:
                self._schedule(state, time.perf_counter() - start)

    def _schedule(self, state, seconds: float) -> None:
        """Back off when the best tree does not pay for its verification and drafting (:meth:`BackOff.judge`)."""
        self.backoff.judge(state, seconds, *(self._worth or (None, None)))

    def _draft_forward(self, tokens, hidden, positions, mask, step: int):
        """One drafter forward over rows ``tokens [B, k]`` (``step``: 0 for context rows, ``d`` for the rows that
        draft depth ``d + 1``); returns ``(logits, hidden)``. A drafter with one module per depth (MTP) picks it."""
        return self.drafter(tokens, hidden, positions, mask, self.cache)

    def _step(self, state, tokens, hidden, positions, rows_visible, rows_pos, step: int = 1):
        """Feed tree rows ``[B, k]`` after the context and the tree rows fed so far.

        ``rows_visible`` is ``[B, k, R]``: which of the ``R`` earlier tree rows each new row may see (its ancestors);
        each new row also sees the context and itself.
        """
        layout = state.layout
        bsz, k = tokens.shape
        context = layout.valid[:, None, :].expand(bsz, k, layout.length).to(self.device)
        past_valid = torch.cat([context, rows_visible.to(self.device)], dim=2)
        past_pos = torch.cat([layout.positions, rows_pos], dim=1)
        own = torch.eye(k, dtype=torch.bool, device=self.device).expand(bsz, k, k)
        mask = self._mask(state, past_valid, past_pos, positions, own)
        return self._draft_forward(tokens.to(self.device), hidden, positions.to(self.device), mask, step)

    def _chain(self, state, logits, hidden):
        bsz = state.batch_size
        k = min(self.chain, max(state.max_drafts))
        if k <= 0:
            return None
        drafts, probs, reaches = [], [], []
        reach = torch.ones(bsz, device=self.device)  # drafter probability that every draft so far is accepted
        rows_valid = torch.zeros(bsz, 0, dtype=torch.bool, device=state.device)
        rows_pos = torch.zeros(bsz, 0, dtype=torch.long, device=state.device)
        for i in range(k):
            scores = logits.float()
            p = torch.softmax(scores, dim=-1) if state.do_sample or self.adaptive else None
            if state.do_sample:
                pick = torch.multinomial(p, 1)[:, 0]
                probs.append(self._target_probs(state, p))
            else:
                pick = scores.argmax(-1)
            token = self.drafter.draft_to_target(pick)
            drafts.append(token.to(state.device))
            if self.adaptive:
                reach = reach * p.gather(1, pick[:, None])[:, 0]
                reaches.append(reach)
            if i == k - 1:
                break
            if self.adaptive and float(reach.max()) * self.calibration < 0.02:
                break  # no row's next draft could add 2 % to its expected acceptance: save the drafter forward
            pos = (state.root_positions + i)[:, None]  # row (g, d_{i+1}) sits at the position of d_i's parent
            logits, hidden = self._step(state, token[:, None], hidden[:, None], pos, rows_valid[:, None, :], rows_pos,
                                        step=i + 1)
            logits, hidden = logits[:, 0], hidden[:, 0]
            rows_valid = torch.cat([rows_valid, torch.ones(bsz, 1, dtype=torch.bool, device=state.device)], 1)
            rows_pos = torch.cat([rows_pos, pos], 1)
        counts = [min(m, len(drafts)) for m in state.max_drafts]
        if self.adaptive:  # verify only the drafts that pay for their verification (the measured costs)
            counts = self._cut_chains(state, torch.stack(reaches, dim=1), counts)
            if not any(counts):
                return None
        draft_probs = torch.stack(probs, dim=1) if probs else None
        return DraftTree.chain(state.roots(), torch.stack(drafts, dim=1),
                               torch.tensor(counts, device=state.device), draft_probs)

    def _tree(self, state, logits, hidden):
        """EAGLE-2 dynamic tree, expanded for every row of the batch at once."""
        bsz, dev = state.batch_size, self.device
        top_k = self.top_k
        max_depth = min(self.depth, max(state.max_drafts))
        if max_depth <= 0:
            return None
        logp = torch.log_softmax(logits.float(), dim=-1)
        frontier_score, frontier_tok = logp.topk(top_k, dim=-1)  # [B, k]
        # every candidate node: score, draft token, parent candidate index (-1 = root), depth
        cand_score = [frontier_score]
        cand_tok = [frontier_tok]
        cand_parent = [torch.full((bsz, top_k), -1, dtype=torch.long, device=dev)]
        cand_depth = [torch.ones(bsz, top_k, dtype=torch.long, device=dev)]
        frontier_idx = torch.arange(top_k, device=dev).expand(bsz, top_k)  # candidate index of each frontier node
        frontier_hidden = hidden[:, None].expand(-1, top_k, -1)
        frontier_row_anc = torch.zeros(bsz, top_k, 0, dtype=torch.bool, device=dev)  # ancestors among fed rows
        rows_pos = torch.zeros(bsz, 0, dtype=torch.long, device=state.device)
        n_cand = top_k
        for d in range(1, max_depth):
            if self.adaptive and float(frontier_score.max().exp()) * self.calibration < 0.02:
                break  # no deeper node could add 2 % to the expected acceptance: save the drafter forwards
            # feed the frontier: row (parent output, node token) at the position of the node's parent
            pos = (state.root_positions + d - 1)[:, None].expand(-1, top_k)
            tokens = self.drafter.draft_to_target(frontier_tok)
            step_logits, step_hidden = self._step(state, tokens, frontier_hidden, pos, frontier_row_anc, rows_pos,
                                                  step=d)
            # ancestors-or-self of each row just fed, among all rows fed so far
            row_anc = torch.cat([frontier_row_anc, torch.eye(top_k, dtype=torch.bool, device=dev).expand(bsz, -1, -1)],
                                dim=2)
            rows_pos = torch.cat([rows_pos, pos.to(state.device)], 1)
            # children of every frontier node
            child_logp, child_tok = torch.log_softmax(step_logits.float(), -1).topk(top_k, dim=-1)  # [B, k, k]
            child_score = frontier_score[:, :, None] + child_logp
            flat_score = child_score.reshape(bsz, -1)
            cand_score.append(flat_score)
            cand_tok.append(child_tok.reshape(bsz, -1))
            cand_parent.append(frontier_idx[:, :, None].expand(-1, -1, top_k).reshape(bsz, -1))
            cand_depth.append(torch.full((bsz, top_k * top_k), d + 1, dtype=torch.long, device=dev))
            # the next frontier: the best k children overall
            best_score, best = flat_score.topk(top_k, dim=-1)
            parent_slot = best // top_k
            frontier_score = best_score
            frontier_tok = child_tok.reshape(bsz, -1).gather(1, best)
            frontier_idx = n_cand + best
            frontier_hidden = step_hidden.gather(1, parent_slot[:, :, None].expand(-1, -1, step_hidden.shape[-1]))
            frontier_row_anc = row_anc.gather(1, parent_slot[:, :, None].expand(-1, -1, row_anc.shape[-1]))
            n_cand += top_k * top_k
        return self._select(state, torch.cat(cand_score, 1), torch.cat(cand_tok, 1), torch.cat(cand_parent, 1),
                            torch.cat(cand_depth, 1))

    def _select(self, state, score, tok, parent, depth):
        """Keep the best candidates of each row (at most ``total_tokens - 1``, fewer when more would not pay for
        their verification), ancestor-closed, in parent-first order."""
        bsz = state.batch_size
        budget = torch.tensor(state.max_drafts, device=score.device)
        score = score.masked_fill(depth > budget[:, None], float("-inf"))
        keep_n = min(self.total_tokens - 1, score.shape[1])
        rows_tokens, rows_parents = [], []
        self._predicted = []
        picked = []
        for b in range(bsz):
            top = score[b].topk(keep_n)
            finite = torch.isfinite(top.values)
            order, probs = top.indices[finite], top.values[finite].exp()
            n = self._pays(state, probs)
            picked.append((order[:n], probs[:n]))
        cap = keep_n
        if self.adaptive and bsz > 1 and state.cost_model is not None:  # the rows share one forward
            cap = batch_cap([(p * self.calibration).tolist() for _, p in picked], state.cost_model, state.active)
        for b, (order, probs) in enumerate(picked):
            order, probs = order[:cap], probs[:cap]
            n = len(order)
            self._predicted.append(float(probs.sum()))
            self._note_worth(state, float(probs.sum()), n)
            chosen = set(order.tolist())
            par = parent[b].tolist()
            for c in list(chosen):  # ties can leave a parent out: add ancestors back
                p = par[c]
                while p >= 0 and p not in chosen:
                    chosen.add(p)
                    p = par[p]
            nodes = _depth_first(sorted(chosen), par)
            slot = {c: i + 1 for i, c in enumerate(nodes)}
            rows_tokens.append(self.drafter.draft_to_target(tok[b, nodes]).tolist() if nodes else [])
            rows_parents.append([slot.get(par[c], 0) for c in nodes])
        return DraftTree.from_rows(state.roots(), rows_tokens, rows_parents)


def _depth_first(nodes: list[int], parent: list[int]) -> list[int]:
    """``nodes`` (candidate indices, ancestor-closed) in depth-first order, each node's best child first: parents
    still precede their children, and the most likely path (every node's first child from the root) is a run of
    consecutive tree nodes, whose keys are a prefix of the cache -- the cheap case of the half-precision exact
    attention (:class:`hf_specdec.kernels._ExactRows`). Candidate indices grow with depth and, among siblings, with
    their rank."""
    children: dict[int, list[int]] = {}
    for c in nodes:  # ascending: each node's children in rank order
        children.setdefault(parent[c], []).append(c)
    order, stack = [], list(reversed(children.get(-1, [])))
    while stack:
        c = stack.pop()
        order.append(c)
        stack.extend(reversed(children.get(c, [])))
    return order


def _build(target, opts) -> Eagle3Proposer:
    chain = opts["num_speculative_tokens"]
    given = {k: opts[f"tree_{k}"] for k in ("top_k", "depth", "total_tokens") if opts[f"tree_{k}"] is not None}
    tree = {} if chain else {**default_tree(target.device, target.dtype), **given}
    return Eagle3Proposer(opts["drafter"], num_speculative_tokens=chain,
                          adaptive=opts["draft_length_schedule"] != "constant", **tree)


def _tree_arg(arg: str) -> dict:
    if not arg:
        return {}
    top_k, depth, total = (int(x) for x in arg.split("-"))
    return {"tree_top_k": top_k, "tree_depth": depth, "tree_total_tokens": total}


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_eagle3(target, tokenizer, out, draft_vocab=args.draft_vocab, **common)


METHOD = Method(
    name="eagle3",
    summary="one-layer drafter over fused low/mid/high target features; dynamic draft tree (EAGLE-2) or a chain",
    description="Lossless EAGLE-3 speculative decoding (Li et al., 2025): a one-layer drafter fed with three fused "
                "hidden states of the target drafts a dynamic tree (EAGLE-2) that the target verifies in one forward "
                "pass with a tree attention mask; sampling is exact (tree rejection rule for top-k drafts). Published "
                "layouts (research `yuhuili/EAGLE3-*`, SpecForge/SGLang, speculators) are converted in memory when "
                "given by repo id or folder; `hf-specdec convert eagle3 <repo> <out>` converts once to safetensors. "
                "The tree defaults depend on the target's device and dtype: the reference's on an accelerator, a "
                "small tree on a CPU in fp32, where a forward over 5 or more tokens costs much more than over 4 and "
                "every depth is one more drafter forward on the critical path, a larger one in half precision, where "
                "8 tokens cost about one step (measured in benchmarks/RESULTS.md); a `tree_*` option you pass "
                "replaces only that value.",
    build=_build,
    options=(
        Option("tree_top_k", int, None, f"children per expanded node (default by device: {REFERENCE_TREE['top_k']}; "
               f"CPU {TREE_DEFAULTS['cpu']['top_k']}, CPU half precision {TREE_DEFAULTS['cpu-half']['top_k']})"),
        Option("tree_depth", int, None, f"tree depth, the longest draft (default {REFERENCE_TREE['depth']}; "
               f"CPU {TREE_DEFAULTS['cpu']['depth']}, half {TREE_DEFAULTS['cpu-half']['depth']})"),
        Option("tree_total_tokens", int, None, f"tree size, root included (default {REFERENCE_TREE['total_tokens']}; "
               f"CPU {TREE_DEFAULTS['cpu']['total_tokens']}, half {TREE_DEFAULTS['cpu-half']['total_tokens']})"),
        Option("num_speculative_tokens", int, None, "draft a chain of this length instead of a tree"),
        SCHEDULE,
        HYBRID,
    ),
    drafter=DrafterSpec.published(
        Eagle3Drafter, convert_eagle3, LAYOUTS,
        export=export_eagle3,
        doc="an EAGLE-3 drafter",
        shipped={SMOLLM2: "smollm2-135m-instruct-eagle3"},
        train=_train,
        example="drafter=\"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B\")   # published repo, converted folder, or model",
    ),
    shorthands={
        "eagle3": Shorthand("TOPK-DEPTH-TOTAL", _tree_arg),
        "eagle3_chain": Shorthand("K", lambda arg: {"num_speculative_tokens": int(arg or 4)}),
    },
)
