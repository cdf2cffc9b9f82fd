"""Lookahead decoding (Fu et al., 2024): n-grams from Jacobi iterations on a 2D window, verified from a pool.

One verification forward carries two branches, both plain draft-tree nodes:

* the **lookahead branch**, a window of ``N - 1`` levels of ``W`` tokens (the Jacobi trajectory). Token (level
  ``l``, column ``i``) sits at depth ``i + 1 + l``: level 0 is a chain from the root and token ``(l, i)`` is the
  child of ``(l - 1, i)``. Its tree ancestors are then exactly the reference's attention mask (level-0 tokens
  ``0..i`` and column ``i`` of the lower levels) and ``root_position + depth`` its position. The target's argmax at
  the last level is the next level; column ``i`` read down the levels plus that argmax is an n-gram for the pool.
* the **verification branch**: the pool's n-grams whose key is the root token, merged into a trie under the root.

Every node is an ordinary deterministic draft, so the verifier is the one every method uses and stays exact
(a window token that happens to be the target's choice is accepted too). On a CPU, where a forward over many tokens
costs much more than over few, the adaptive schedule verifies only the guesses that pay for their nodes and runs
the window only while the n-grams it produced pay for it (:meth:`LookaheadProposer._choose`).
"""

from __future__ import annotations

import collections
import random
import zlib
from dataclasses import dataclass, field


from ..costs import AcceptanceEstimator
from ..registry import SCHEDULE, Method, Option
from ..tree import DraftTree
from .base import Proposer, rules_of

WINDOW = Option("window_size", int, 3, "W: columns of the Jacobi window (n-grams it yields per step)")
NGRAM = Option("ngram_size", int, 4, "N: n-gram size (the window keeps N - 1 levels; a guess drafts N - 1 tokens)")
GUESS = Option("guess_set_size", int, 3, "G: the most pool n-grams kept per key token and verified per step")
FROM_TEXT = Option("pool_from_prompt", bool, True,
                   "also fill the pool with the n-grams of the prompt and of the committed output")

WINDOW_SOURCE, TEXT_SOURCE, GUESS_SOURCE = "window", "text", "guess"  # where a pool n-gram came from
MAX_PAUSE = 32  # steps the window stays off, at most, before it is tried again
DECAY = 0.97  # per step, of the window's running yield


def window_tree(levels: list[list[int]], offset: int = 0) -> tuple[list[int], list[int], list[list[int]]]:
    """The window as draft nodes: ``(tokens, parents, slots)`` with ``slots[l][i]`` the node of (level ``l``,
    column ``i``). Parents use :meth:`DraftTree.from_rows` numbering (``0`` = root, ``j`` = the ``j``-th draft) and
    the window's drafts come after ``offset`` others. Level 0 is a chain from the root; ``(l, i)``'s parent is
    ``(l - 1, i)``, so it sits at depth ``i + 1 + l``."""
    tokens, parents, slots = [], [], []
    for l, level in enumerate(levels):
        row = []
        for i, tok in enumerate(level):
            if l == 0:
                parents.append(row[i - 1] if i else 0)
            else:
                parents.append(slots[l - 1][i])
            tokens.append(tok)
            row.append(offset + len(tokens))
        slots.append(row)
    return tokens, parents, slots


class NGramPool:
    """Lade's ``token_map``: key token -> up to ``capacity`` ``(N-1)``-tuples, least recently seen first; a tuple
    seen again moves to the end, a new one past the capacity drops the oldest. Each tuple keeps its first source."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: dict[int, collections.OrderedDict] = {}

    def add(self, key: int, value: tuple, source: str) -> bool:
        """Add (or refresh) one n-gram; whether it was new."""
        if self.capacity <= 0:
            return False
        kept = self.entries.setdefault(key, collections.OrderedDict())
        if value in kept:
            kept.move_to_end(value)
            return False
        kept[value] = source
        if len(kept) > self.capacity:
            kept.popitem(last=False)
        return True

    def guesses(self, key: int) -> list[tuple[tuple, str]]:
        """``(tuple, source)`` for ``key``, most recently seen first."""
        kept = self.entries.get(key)
        return list(reversed(kept.items())) if kept else []

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())


@dataclass
class _Guess:
    """One node of the guess trie: its token, parent node (0 = root) and depth, its rank among its siblings, the
    source of the n-gram that created it, and its estimated probability of being accepted."""

    token: int
    parent: int
    depth: int
    rank: int
    source: str
    prob: float = 0.0
    node: int = 0  # its node in this step's tree


@dataclass
class _Row:
    """What lookahead keeps for one row of the batch during a generate call."""

    index: int
    pool: NGramPool
    rng: random.Random
    prompt: list[int]
    levels: list[list[int]] | None = None  # the Jacobi window, level 0 first (None: the window is off)
    pause: int = 0  # steps left before the window is tried again
    backoff: int = 1  # the next pause
    stale: int = 0  # steps in a row whose window n-grams were all in the pool already
    credit: float = 0.0  # tokens the window yielded (its own accepted tokens and its n-grams'), decayed per step
    runs: float = 0.0  # steps it ran, decayed alike
    text_done: int = 0  # n-grams of the committed text already in the pool (by start position)
    guesses: list[_Guess] = field(default_factory=list)  # this step's verified guess nodes
    slots: list[list[int]] | None = None  # this step's window nodes, by level and column (None: not run)


class LookaheadProposer(Proposer):
    """Lookahead decoding: the Jacobi window and the n-gram pool of Fu et al. (2024) as one draft tree.

    Args:
        window_size: ``W``, columns of the window.
        ngram_size: ``N``, the n-gram size: the window keeps ``N - 1`` levels and a pool n-gram drafts its last
            ``N - 1`` tokens (``N = 2``: plain Jacobi decoding of a one-level window).
        guess_set_size: ``G``, the most n-grams kept per key token and verified per step (``0``: no pool, the
            window's own tokens are the only drafts).
        pool_from_prompt: also fill the pool with the prompt's n-grams and the output's as it is committed (the
            reference's ``POOL_FROM_PROMPT``).
        adaptive: verify only the guesses that pay for their nodes by the measured costs and running acceptance
            rates, and run the window only while its yield pays for its nodes (off: pause 1, 2, 4 .. 32 steps,
            then try again). ``False`` always verifies all guesses and the whole window, as the reference does.
    """

    name = "lookahead"

    def __init__(self, window_size: int = WINDOW.default, ngram_size: int = NGRAM.default,
                 guess_set_size: int = GUESS.default, pool_from_prompt: bool = FROM_TEXT.default,
                 adaptive: bool = True):
        for option, value, low in ((WINDOW, window_size, 1), (NGRAM, ngram_size, 2), (GUESS, guess_set_size, 0)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"lookahead: {option.name} must be an int, got {type(value).__name__} {value!r}.")
            if value < low:
                raise ValueError(f"lookahead: {option.name} must be >= {low}, got {value}.")
        self.window_size, self.ngram_size, self.guess_set_size = window_size, ngram_size, guess_set_size
        self.pool_from_prompt = bool(pool_from_prompt)
        self.adaptive = adaptive
        n_levels = ngram_size - 1
        # while the window fills (k < N - 1 levels) every level is W + N - 1 - k wide; then N - 1 levels of W
        self.window_depth = window_size + ngram_size - 2
        widest = max(k * (window_size + ngram_size - 1 - k) for k in range(1, n_levels + 1))
        self.max_nodes = 1 + widest + guess_set_size * n_levels

    # ------------------------------------------------------------------------------------------------ life cycle
    def begin(self, state) -> None:
        self.rules = rules_of(state)
        self.estimator = AcceptanceEstimator(prior_alpha=0.3, prior_weight=2.0, decay=0.95)
        self.rows = []
        for b in range(state.batch_size):
            prompt = state.row_list(b)
            seed = zlib.crc32(",".join(map(str, prompt)).encode())  # deterministic per prompt, no global RNG
            row = _Row(index=b, pool=NGramPool(self.guess_set_size), rng=random.Random(seed), prompt=prompt)
            self._start_window(row)
            self.rows.append(row)
        self.tree: DraftTree | None = None  # the tree of the last proposal
        self._harvest_text(state)

    def propose(self, state):
        tokens, parents = [], []
        roots = [state.host_tokens[b][n - 1] for b, n in enumerate(state.lengths)]
        for b, row in enumerate(self.rows):
            row.guesses, row.slots = [], None
            budget = state.max_drafts[b]
            if budget <= 0:
                tokens.append([])
                parents.append([])
                continue
            guesses = self._guess_trie(row.pool.guesses(roots[b]), min(budget, self.ngram_size - 1), state)
            if row.levels is None:  # the adaptive schedule switched it off: count the pause down
                row.pause -= 1
                if row.pause <= 0:
                    self._start_window(row, state.row_list(b))
            window = row.levels is not None and budget >= self.window_depth
            guesses, window = self._choose(state, row, guesses, window)
            row_tokens = [g.token for g in guesses]
            row_parents = [g.parent for g in guesses]
            for j, g in enumerate(guesses):
                g.node = j + 1
            if window:
                w_tokens, w_parents, row.slots = window_tree(row.levels, offset=len(row_tokens))
                row_tokens += w_tokens
                row_parents += w_parents
            row.guesses = guesses
            tokens.append(row_tokens)
            parents.append(row_parents)
        if not any(tokens):
            return None
        self.tree = DraftTree.from_rows(state.roots(), tokens, parents)
        return self.tree

    def commit(self, state, tree, result) -> None:
        ours = tree is self.tree and state.tree_logits is not None  # not a plain step the loop took on its own
        self.tree = None
        # [B, N] the target's argmax at every node (raw logits: the n-grams are only guesses, exact either way)
        choice = None
        if ours:  # greedy acceptance read them with the paths; else one read here
            choice = result.choices if result.choices is not None else state.tree_logits.argmax(-1).tolist()
        for b, row in enumerate(self.rows):
            row.credit *= DECAY
            row.runs *= DECAY
            path = result.paths[b]
            if not ours or not path or (not row.guesses and row.slots is None):
                continue
            on_path = set(path)
            self._learn_guesses(row, on_path, choice[b])
            if row.slots is not None:
                row.runs += 1.0
                row.credit += sum(1 for n in path if n > len(row.guesses))  # the window's own accepted tokens
                self._step_window(state, row, choice[b])
        self._harvest_text(state)

    # ------------------------------------------------------------------------------------------------ guesses
    def _guess_trie(self, candidates, depth: int, state) -> list[_Guess]:
        """The pool's n-grams for the root merged into a trie (parents first), cut to ``depth`` tokens and before an
        end-of-sequence token; each node's acceptance probability is the product of its edges' running rates."""
        nodes: list[_Guess] = []
        children: dict[int, dict[int, int]] = {0: {}}  # node -> {token: node}
        stops = set(state.eos_token_ids)
        for value, source in candidates:
            parent = 0
            for token in value[:depth]:
                if token in stops:
                    break
                kids = children[parent]
                if token not in kids:
                    rank = len(kids)
                    above = nodes[parent - 1] if parent else None
                    node_depth = above.depth + 1 if above else 1
                    key = self._edge_key(node_depth, rank)
                    prob = (above.prob if above else 1.0) * self.estimator.alpha(key, self._prior(key))
                    nodes.append(_Guess(token, parent, node_depth, rank, source, prob))
                    kids[token] = len(nodes)
                    children[len(nodes)] = {}
                parent = kids[token]
        return nodes

    @staticmethod
    def _edge_key(depth: int, rank: int) -> tuple[int, int]:
        return min(depth, 2), min(rank, 2)

    @staticmethod
    def _prior(key) -> float:
        depth, rank = key
        return (0.3, 0.12, 0.08)[rank] if depth == 1 else (0.6, 0.25, 0.15)[rank]

    def _learn_guesses(self, row: _Row, on_path: set, choice: list[int]) -> None:
        """Update the edge rates with the verified guesses, credit the window with the accepted tokens of its
        n-grams, and harvest an n-gram from every full-length guess: its tokens after the first and the target's
        argmax after its last, keyed by its first."""
        deepest = None
        for g in row.guesses:
            if g.parent == 0 or g.parent in on_path:  # the walk reached its parent: it was tried
                self.estimator.update(self._edge_key(g.depth, g.rank), 1, int(g.node in on_path))
            if g.node in on_path:
                deepest = g
        if deepest is not None and deepest.source == WINDOW_SOURCE:
            row.credit += deepest.depth
        full = self.ngram_size - 1
        for g in row.guesses:
            if g.depth == full:
                chain = [g]
                while chain[-1].parent:
                    chain.append(row.guesses[chain[-1].parent - 1])
                chain.reverse()
                row.pool.add(chain[0].token, tuple(c.token for c in chain[1:]) + (choice[g.node],), GUESS_SOURCE)

    # ------------------------------------------------------------------------------------------------ the window
    def _start_window(self, row: _Row, text: list[int] | None = None) -> None:
        """A fresh window: level 0 drawn from the prompt, or from ``text`` (``W + N - 2`` tokens: each of the
        ``N - 2`` filling steps shortens every level by one, as the window moves one position per step)."""
        row.levels = [[row.rng.choice(text or row.prompt) for _ in range(self.window_depth)]]
        row.stale = 0

    def _step_window(self, state, row: _Row, choice: list[int]) -> None:
        """One Jacobi step: the target's argmax at the last level is the next level; once there are ``N - 1``
        levels, each column read down the levels plus that argmax is a pool n-gram keyed by its level-0 token, and
        the oldest level is dropped. The window moves one position per step, whatever was accepted (the reference's
        default)."""
        stops = set(state.eos_token_ids)
        new = [choice[n] for n in row.slots[-1]]
        new = [row.rng.choice(row.prompt) if t in stops else t for t in new]
        levels = row.levels
        if len(levels) == self.ngram_size - 1:
            fresh = False
            for i, key in enumerate(levels[0]):
                fresh |= row.pool.add(key, tuple(level[i] for level in levels[1:]) + (new[i],), WINDOW_SOURCE)
            row.levels = levels[1:] + [new]
            row.stale = 0 if fresh else row.stale + 1
            if row.stale >= self.ngram_size:  # stuck at a fixed point (a loop of one token, say): start again
                self._start_window(row, state.row_list(row.index))
        else:  # still filling: every level loses the column the root just passed
            row.levels = [level[1:] for level in levels] + [new[1:]]

    def _choose(self, state, row: _Row, guesses: list[_Guess], window: bool) -> tuple[list[_Guess], bool]:
        """The guesses to verify (a prefix of the nodes by estimated probability: parents first) and whether the
        window runs. Adaptive: the most expected tokens per unit of verification cost, ``(1 + sum of the guesses'
        probabilities + the window's yield per step) / relative_cost(1 + guesses + window nodes)``; the window's
        yield is what it earned (its accepted tokens and its n-grams' accepted tokens) per step it ran. A filling
        window always runs; a full one that does not pay is switched off for a pause that doubles each time (the
        rule lookahead_window_pause; off: the window always runs, only the guesses are cut)."""
        if not self.adaptive:
            return guesses, window
        pausing = self.rules.lookahead_window_pause
        filling = window and len(row.levels) < self.ngram_size - 1
        order = sorted(range(len(guesses)), key=lambda j: -guesses[j].prob)  # stable: parents before children
        cost = state.cost_model
        w_nodes = sum(len(level) for level in row.levels) if window else 0
        yield_ = (row.credit + 0.3 * 2.0) / (row.runs + 2.0)  # prior: 0.3 tokens per step, weight of two steps
        if filling and pausing:  # a window fills only where a full one could pay (not on a large batch's steep curve)
            full_nodes = self.window_size * (self.ngram_size - 1)
            filling = 1.0 + yield_ >= cost.relative(1 + full_nodes)
        best = None
        expected = 1.0
        for n in range(len(order) + 1):
            if n:
                expected += guesses[order[n - 1]].prob
            for on in (True,) if filling or (window and not pausing) else (False, True) if window else (False,):
                rate = (expected + (yield_ if on else 0.0)) / cost.relative(1 + n + (w_nodes if on else 0))
                if best is None or rate > best[0]:
                    best = (rate, n, on)
        _, n, on = best
        if n == 0 and guesses and not on and cost.explore_due():
            n = 1
        if window and not on:  # a full window that does not pay: off for a while
            row.levels, row.pause = None, row.backoff
            row.backoff = min(2 * row.backoff, MAX_PAUSE)
        elif on and not filling:
            row.backoff = 1
        renumber = {0: 0}
        kept = []
        for j in sorted(order[:n]):
            g = guesses[j]
            kept.append(_Guess(g.token, renumber[g.parent], g.depth, g.rank, g.source, g.prob))
            renumber[j + 1] = len(kept)
        return kept, on

    # ------------------------------------------------------------------------------------------------ text n-grams
    def _harvest_text(self, state) -> None:
        """Add the n-grams of the committed text not seen yet (prompt and output) to each row's pool."""
        if not self.pool_from_prompt:
            return
        n = self.ngram_size
        for b, row in enumerate(self.rows):
            seq = state.row_list(b)[row.text_done:]  # from the first n-gram not added yet
            for j in range(len(seq) - n + 1):
                row.pool.add(seq[j], tuple(seq[j + 1:j + n]), TEXT_SOURCE)
            row.text_done += max(len(seq) - n + 1, 0)


METHOD = Method(
    name="lookahead",
    summary="Jacobi iterations on a 2D window (lookahead branch) and a pool of the n-grams they and the text yield "
            "(verification branch), one draft tree; sizes adapted to measured costs",
    description="Lossless lookahead decoding (Fu et al., 2024) for any causal LM in transformers, without a drafter "
                "or a datastore: a lookahead branch runs Jacobi iterations on a window of `window_size` (W) columns "
                "and `ngram_size - 1` (N - 1) levels, and the n-grams read off its columns go into a pool; a "
                "verification branch checks the pool's n-grams that start with the last committed token (at most "
                "`guess_set_size`, G). Both branches are nodes of one draft tree verified in one forward (the "
                "window's tree ancestors are the reference's attention mask), so the acceptance rules are the exact "
                "ones of every method and any batch size works. The pool also holds the prompt's and the output's "
                "n-grams (`pool_from_prompt`). With the adaptive schedule only the guesses that pay for their nodes "
                "are verified and the window runs only while its n-grams pay for it: on a CPU, where a forward over "
                "many tokens costs much more than over few, it is mostly off.",
    build=lambda target, opts: LookaheadProposer(window_size=opts["window_size"], ngram_size=opts["ngram_size"],
                                                 guess_set_size=opts["guess_set_size"],
                                                 pool_from_prompt=opts["pool_from_prompt"],
                                                 adaptive=opts["draft_length_schedule"] != "constant"),
    options=(WINDOW, NGRAM, GUESS, FROM_TEXT, SCHEDULE),
)
