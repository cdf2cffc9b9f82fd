"""Medusa proposer: ``K`` heads on the target's final hidden state draft a static tree verified in one forward.

The heads (:class:`~hf_specdec.modeling.medusa.MedusaHeads`) read the post-norm hidden state of the last committed
position, which the previous verification forward already produced (the loop returns it with the logits), so
drafting costs ``K`` small matrix products and no target forward. Head ``d`` scores the token ``d + 1`` places after
the root; its top ``k`` candidates are the children at depth ``d + 1``.

The tree is a *choices* list as the reference writes it (``medusa_choices.py``): each entry is a path of top-k
indices, ``[0, 1]`` = head 0's best token followed by head 1's second best. ``mc_sim_7b_63`` (63 nodes) is the
default on an accelerator; on a CPU, where a forward over more than a few tokens costs much more than over one, the
pool is its first :data:`CPU_CHOICES` entries. With the adaptive schedule (the default) each step keeps the pool
nodes whose predicted acceptance (the product of the heads' probabilities along the path) pays for the measured
cost of verifying them; ``draft_length_schedule="constant"`` verifies the whole pool. A chain
(``num_speculative_tokens=k``: the top-1 token of heads ``0..k-1``) is the vLLM-style form.

Acceptance is exact by default (greedy: the output equals ``generate(do_sample=False)``; sampling: the engine's
rule for deterministic drafts). ``acceptance="typical"`` is Medusa's **lossy** typical acceptance (sampling only):
a draft ``x`` is kept when the target's probability ``q(x) > min(posterior_threshold, posterior_alpha *
exp(-H(q)))``; the outputs are then *not* distributed as the target's, and ``speculative_stats["acceptance"]``
says ``"typical (lossy)"``.
"""

from __future__ import annotations

import json
import time

import torch

from ..conversions.medusa import LAYOUTS, convert_medusa, export_medusa
from ..coupling import apply_warpers
from ..default_model import MODEL_ID as SMOLLM2
from ..modeling.medusa import MedusaHeads
from ..placement import drafter_device
from ..registry import SCHEDULE, DrafterSpec, Method, Option, Shorthand
from ..syncs import host_side, to_device
from ..tree import DraftTree
from .base import draft_vocab_ids
from .features import FeatureDrafterProposer
from .hybrid import HYBRID

# The reference's default tree for a 7B target (FasterDecoding/Medusa ``medusa/model/medusa_choices.py``), in its
# published order (most valuable paths first, every path after its parent).
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1),
    (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0),
    (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)
CHOICES = {"mc_sim_7b_63": MC_SIM_7B_63}
CPU_CHOICES = 8  # the CPU pool: the first entries of mc_sim_7b_63 (depth <= 3)
TYPICAL = {"posterior_threshold": 0.09, "posterior_alpha": 0.3}  # the reference's medusa_generate defaults


def default_choices(device) -> tuple[tuple[int, ...], ...]:
    """The tree pool for a target on ``device``: ``mc_sim_7b_63`` on an accelerator, its first
    :data:`CPU_CHOICES` paths on a CPU."""
    return MC_SIM_7B_63[:CPU_CHOICES] if torch.device(device).type == "cpu" else MC_SIM_7B_63


def check_choices(choices, num_heads: int) -> list[tuple[int, ...]]:
    """``choices`` (a name in :data:`CHOICES` or a list of paths) as sorted tuples, parents first (by length, then
    value, as the reference sorts them); paths longer than the heads can draft are dropped. Raises on a path whose
    parent is missing, a negative index or a duplicate."""
    if isinstance(choices, str) and choices.lstrip().startswith("["):  # a list written on the command line
        try:
            choices = json.loads(choices)
        except json.JSONDecodeError as err:
            raise ValueError(f"medusa_choices {choices!r} is not a JSON list of paths: {err}.") from None
    if isinstance(choices, str):
        if choices not in CHOICES:
            raise ValueError(f"Unknown medusa_choices {choices!r}; known: {', '.join(CHOICES)} (or pass a list of "
                             "paths such as [[0], [0, 0], [1]]).")
        choices = CHOICES[choices]
    paths = [tuple(int(i) for i in c) for c in choices]
    if not paths or any(len(p) == 0 for p in paths):
        raise ValueError("medusa_choices must be a non-empty list of non-empty paths, e.g. [[0], [0, 0], [1]].")
    if any(i < 0 for p in paths for i in p):
        raise ValueError("medusa_choices indices are top-k ranks and must be >= 0.")
    if len(set(paths)) != len(paths):
        raise ValueError("medusa_choices lists a path twice.")
    known = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"medusa_choices has {list(p)} but not its parent {list(p[:-1])}.")
    kept = sorted((p for p in paths if len(p) <= num_heads), key=lambda p: (len(p), p))
    if not kept:
        raise ValueError(f"No medusa_choices path fits {num_heads} heads.")
    return kept


class MedusaProposer(FeatureDrafterProposer):
    """Args:
        drafter: :class:`~hf_specdec.modeling.medusa.MedusaHeads` for the target.
        choices: the tree (a list of top-k paths or a name in :data:`CHOICES`; see the module docstring).
        adaptive: keep only the nodes that pay for their verification (and back off when none does).
        acceptance: ``"exact"`` or ``"typical"`` (lossy, sampling only).
        posterior_threshold, posterior_alpha: typical acceptance's ``epsilon`` and ``delta``.
    """

    name = "medusa"

    def __init__(self, drafter: MedusaHeads, choices=MC_SIM_7B_63, adaptive: bool = True, acceptance: str = "exact",
                 posterior_threshold: float = TYPICAL["posterior_threshold"],
                 posterior_alpha: float = TYPICAL["posterior_alpha"]):
        if acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {acceptance!r}.")
        if acceptance == "typical" and not (0 < posterior_threshold <= 1 and posterior_alpha > 0):
            raise ValueError("typical acceptance needs 0 < posterior_threshold <= 1 and posterior_alpha > 0.")
        super().__init__(drafter, adaptive)
        self.choices = check_choices(choices, drafter.num_heads)
        self.max_nodes = len(self.choices) + 1
        self.top_k = 1 + max(max(p) for p in self.choices)
        self.depth = max(len(p) for p in self.choices)
        self.max_path = self.depth + 1
        index = {p: i for i, p in enumerate(self.choices)}
        self._parent = [index[p[:-1]] if len(p) > 1 else -1 for p in self.choices]  # [P] pool index (-1: the root)
        self._indices: dict = {}  # (device, depth, k) -> the pool's index tensors (:meth:`_index`)
        self._allowed_nodes: dict = {}  # (depth, k, budget) -> the pool nodes a row may draft (:meth:`_allowed`)
        self._slots: dict = {}  # a row's pool nodes -> their parents' tree slots (:meth:`_tree`)
        self.typical_acceptance = (float(posterior_threshold), float(posterior_alpha)) if acceptance == "typical" \
            else None

    # ---- life cycle
    def begin(self, state) -> None:
        if self.typical_acceptance is not None and not state.do_sample:
            raise ValueError("acceptance='typical' is a sampling rule (do_sample=True); greedy Medusa decoding is "
                             "always exact. Drop acceptance= or pass do_sample=True.")
        self._start(state)
        self._worth = None
        hidden = self._fuse(state.hidden_states)  # [B, T, H]: the final hidden state of every prefilled column
        last = (state.layout.last_real() - state.cached).clamp(min=0).to(hidden.device)
        self.last = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]  # [B, H]

    def commit(self, state, tree, result) -> None:
        hidden = self._fuse(state.hidden_states)  # [B, N, H] for every tree node
        # the last kept node's state is the one whose LM head gave the row's next token (a row without a path keeps
        # its state)
        moved = to_device([[p[-1] if p else 0, int(bool(p))] for p in result.paths], self.device)  # [B, 2]
        picked = hidden.gather(1, moved[:, :1, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        self.last = torch.where(moved[:, 1:].bool(), picked, self.last)

    def on_compact(self, state, index) -> None:
        pass  # the heads keep no per-column state

    def can_continue(self, carried) -> bool:
        return True  # the heads read the last column's hidden state only: the prefill gives it

    def hand_back(self, state, index) -> None:
        return None

    # ---- drafting
    def propose(self, state):
        if self.adaptive and self.backoff.skipping():
            return None
        start = time.perf_counter()
        depth = state.deepest(self.depth)
        if depth <= 0:
            return None
        k = min(self.top_k, self.drafter.config.draft_vocab_size)
        head, rank, ancestors = self._index(depth, k)
        if self._fixed is not None:  # one fixed-shape region (a CUDA graph on a GPU)
            node_tokens, reach = self._heads_fixed(state, depth, k)
        else:
            logits = self.drafter(self.last, heads=depth).float()  # [B, D, Vd]
            logits = state.perturb(logits, range(depth), draft_vocab_ids(state, self.drafter, logits.shape[-1]))
            node_tokens, reach = self._pool(logits, head, rank, ancestors, k)
        node_tokens = node_tokens.to(state.device)
        self._worth = None
        rows = self._allowed(state, depth, k)
        if self.adaptive:
            rows = self._adapt(state, reach.tolist(), rows)  # the proposal's one host read
        tree = self._tree(state, node_tokens, rows)
        if self.adaptive:
            self.backoff.judge(state, time.perf_counter() - start, *(self._worth or (None, None)))
        return tree

    def _pool(self, logits, head, rank, ancestors, k: int):
        """``(tokens, reach)``, each ``[B, P]``: every pool node's draft (target ids) and path probability (the
        product of its own and its ancestors' probabilities), from the heads' scores ``logits [B, D, Vd]``."""
        top_logp, top_ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)  # [B, D, k]
        node_logp = top_logp[:, head, rank]  # [B, P]
        # a zero column pads the paths
        reach = torch.cat([node_logp, node_logp.new_zeros(node_logp.shape[0], 1)], 1)[:, ancestors].sum(-1).exp()
        return self.drafter.draft_to_target(top_ids[:, head, rank]), reach

    def _heads(self, last, noise, processors, head, rank, ancestors, depth: int, k: int):
        """:meth:`_pool` of the first ``depth`` heads over the rows' last hidden states ``last [B, H]`` as one
        fixed-shape region (:mod:`hf_specdec.graphs`); ``noise [B, D, Vd]``: coupled sampling's, added after the
        call's warpers ``processors`` (``None``: not coupled)."""
        logits = self.drafter(last, heads=depth).float()
        if noise is not None:
            logits = apply_warpers(processors, logits) + noise
        return self._pool(logits, head, rank, ancestors, k)

    # ---- drafting at fixed shapes (compile=True: hf_specdec.graphs)
    def draft_at_fixed_shapes(self, runner) -> bool:
        """The heads draft at fixed shapes under ``compile=True`` (:meth:`_heads`: one region, a CUDA graph per depth
        on a GPU); they keep no cache."""
        self._fixed = runner
        return runner is not None

    def graph_key(self):
        """What a CUDA graph of :meth:`_heads` is recorded over (:mod:`hf_specdec.graphs`): the heads."""
        return self.drafter

    def _heads_fixed(self, state, depth: int, k: int):
        """:meth:`_heads` through the runner's fixed-shape region; the first time for this batch size, every depth
        (as a budget near a call's end may ask for fewer heads): no compilation mid-decoding, none on later calls."""
        region = self._fixed.fixed(type(self)._heads)
        vocab = self.drafter.config.draft_vocab_size

        def run(d):
            return region(self, self.last, *self._coupling_inputs(state, vocab, d), *self._index(d, k), d, k)

        region.warm(self, (state.batch_size, k, state.coupling is None),
                    [d for d in range(1, self.depth + 1) if d != depth], run)
        return run(depth)

    @host_side
    def _index(self, depth: int, k: int):
        """Device index tensors of the pool (cached): each node's head and top-k rank (``[P]``, clamped into the heads
        and ranks drafted; such nodes are never kept) and its ancestors-or-self ``[P, D]`` (``P``: padding)."""
        key = (str(self.device), depth, k)
        if key not in self._indices:
            size = len(self.choices)
            paths = [[i] for i in range(size)]
            for path in paths:
                while self._parent[path[-1]] >= 0:
                    path.append(self._parent[path[-1]])
            index = [[min(len(c), depth) - 1 for c in self.choices], [min(c[-1], k - 1) for c in self.choices]]
            index.append([q for path in paths for q in path + [size] * (self.depth - len(path))])
            head, rank, ancestors = to_device(index[0], self.device), to_device(index[1], self.device), \
                to_device(index[2], self.device).view(size, self.depth)
            self._indices[key] = (head, rank, ancestors)
        return self._indices[key]

    @host_side
    def _allowed(self, state, depth: int, k: int) -> list[list[int]]:
        """Each row's pool nodes (pool order, parents first) it may draft: no deeper than ``depth`` and its budget,
        every rank on the path among the ``k`` drafted (cached: host facts)."""
        rows = []
        for budget in state.max_drafts:
            key = (depth, k, budget)
            if key not in self._allowed_nodes:
                limit = min(depth, budget)
                self._allowed_nodes[key] = [i for i, c in enumerate(self.choices) if len(c) <= limit and max(c) < k]
            rows.append(self._allowed_nodes[key])
        return rows

    @host_side
    def _adapt(self, state, reach: list[list[float]], rows: list[list[int]]) -> list[list[int]]:
        """Each row's nodes cut to those that pay for their verification (``reach[b][i]``: node ``i``'s path
        probability, host floats): the best first, as many as pay for the row; back in pool
        order, closed under ancestors. Records the predictions for the back-off."""
        ordered = []
        for b, nodes in enumerate(rows):
            order = sorted(nodes, key=lambda i: -reach[b][i])  # stable: ties keep pool order (parents first)
            ordered.append(order[:self._pays(state, [reach[b][i] for i in order])])
        kept = []
        for b, nodes in enumerate(ordered):
            chosen = set(nodes)
            for i in nodes:  # a tie between a node and its parent can leave the parent out: add ancestors back
                p = self._parent[i]
                while p >= 0 and p not in chosen:
                    chosen.add(p)
                    p = self._parent[p]
            kept.append(sorted(chosen))
            if chosen:
                self._note_worth(state, sum(reach[b][i] for i in chosen), len(chosen))
        return kept

    @host_side
    def _tree(self, state, node_tokens: torch.Tensor, rows: list[list[int]]):
        """The draft tree of each row's pool nodes ``rows[b]`` (pool order, closed under ancestors); ``node_tokens
        [B, P]`` every pool node's token, on the device. Parents come from the pool (host data): one copy of the
        indices to the device, nothing read back."""
        width = max(len(nodes) for nodes in rows)
        if width == 0:
            return None
        if len(self._slots) > 4096:  # adaptive rows pick many subsets: keep the cache bounded
            self._slots.clear()
        packed, chains = [], True
        for nodes in rows:
            key = tuple(nodes)
            if key not in self._slots:
                slot = {p: i + 1 for i, p in enumerate(nodes)}  # the root is slot 0
                self._slots[key] = [slot.get(self._parent[p], 0) for p in nodes]
            parents = self._slots[key]
            chains = chains and parents == list(range(len(nodes)))
            pad = [0] * (width - len(nodes))
            packed.append(nodes + pad + parents + pad + [len(nodes)])
        packed = to_device(packed, state.device)  # [B, 2W + 1]: pool index and parent slot of every node, count
        tokens = node_tokens.gather(1, packed[:, :width])
        root = state.roots()
        if chains:  # every row a chain: the verifier's fast path
            return DraftTree.chain(root, tokens, [len(nodes) for nodes in rows])
        valid = torch.arange(width + 1, device=state.device)[None, :] <= packed[:, -1:]
        parents = torch.cat([root.new_full((root.shape[0], 1), -1), packed[:, width:2 * width]], 1)
        return DraftTree(tokens=torch.cat([root[:, None], tokens], 1), parents=parents, valid=valid,
                         host_depth=max(len(self.choices[p]) for nodes in rows for p in nodes))


def _choices_arg(opts, device):
    if opts["num_speculative_tokens"] is not None:
        k = opts["num_speculative_tokens"]
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}.")
        if opts["medusa_choices"] is not None:
            raise ValueError("Pass medusa_choices or num_speculative_tokens, not both.")
        return [(0,) * d for d in range(1, k + 1)]
    if opts["medusa_choices"] is not None:
        return opts["medusa_choices"]
    return default_choices(device)


def _build(target, opts) -> MedusaProposer:
    return MedusaProposer(opts["drafter"], choices=_choices_arg(opts, drafter_device(target)),
                          adaptive=opts["draft_length_schedule"] != "constant", acceptance=opts["acceptance"],
                          posterior_threshold=opts["posterior_threshold"], posterior_alpha=opts["posterior_alpha"])


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_medusa(target, tokenizer, out, heads=args.heads, layers=args.layers or 1,
                                 draft_vocab=args.draft_vocab, **common)


METHOD = Method(
    name="medusa",
    summary="K heads on the target's final hidden state; a static top-k tree (mc_sim_7b_63) or a chain",
    description="Medusa speculative decoding (Cai et al., 2024): K residual heads read the target's final "
                "hidden state, which the verification forward already computed, and head i scores the token i + 2 "
                "places ahead; their top-k candidates form a static tree from a choices list (the reference's "
                "mc_sim_7b_63 on an accelerator, its first 8 paths on a CPU, sized each step from the measured "
                "forward costs) that the target verifies in one forward. Lossless (greedy, and exact sampling) "
                "unless acceptance='typical' (Medusa's typical acceptance, lossy, sampling only). FasterDecoding "
                "Medusa-1 heads (medusa_lm_head.pt/.safetensors), vLLM Medusa folders and Medusa-2 full "
                "checkpoints are converted in memory; `hf-specdec convert medusa <repo> <out>` converts once.",
    build=_build,
    options=(
        Option("medusa_choices", (str, list, tuple), None,
               f"the tree: a list of top-k paths or 'mc_sim_7b_63' (default by device: mc_sim_7b_63; CPU its "
               f"first {CPU_CHOICES} paths)"),
        Option("num_speculative_tokens", int, None, "draft a chain of the heads' top-1 tokens of this length"),
        Option("acceptance", str, "exact", "'exact' (lossless) or 'typical' (Medusa's typical acceptance: LOSSY, "
               "sampling only)", choices=("exact", "typical")),
        Option("posterior_threshold", float, TYPICAL["posterior_threshold"], "typical acceptance: epsilon"),
        Option("posterior_alpha", float, TYPICAL["posterior_alpha"], "typical acceptance: delta (entropy factor)"),
        SCHEDULE,
        HYBRID,
    ),
    drafter=DrafterSpec.published(
        MedusaHeads, convert_medusa, LAYOUTS,
        export=export_medusa,
        doc="Medusa heads",
        shipped={SMOLLM2: "smollm2-135m-instruct-medusa"},
        train=_train,
        example="drafter=\"FasterDecoding/medusa-vicuna-7b-v1.3\")   # published repo, converted folder, or model",
    ),
    shorthands={
        "medusa": Shorthand("N", lambda arg: {"medusa_choices": list(MC_SIM_7B_63[:int(arg)])} if arg else {}),
        "medusa_chain": Shorthand("K", lambda arg: {"num_speculative_tokens": int(arg or 3)}),
    },
)
