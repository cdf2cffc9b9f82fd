"""Hybrid drafting: a model drafter and a drafter-free source (suffix decoding or prompt lookup) in one proposal.

The ``hybrid=`` option of the model-drafter methods (the draft model, EAGLE-3, DFlash, Medusa, LayerSkip, MTP) wraps
their proposer in :class:`HybridProposer`: by default (:func:`source`) with suffix decoding under the adaptive
schedule, and not under ``draft_length_schedule="constant"`` (the method's own drafts, every step); ``hybrid=False``
(``hybrid=off`` in command-line and bench strings) turns it off. The default is what keeps a drafter from running
slower than plain decoding where it does not pay and the text copies (issue 50: the demo's copy prompt, a long
summarisation prompt; benchmarks/RESULTS.md).

Every step each row takes the candidate that commits more tokens per unit of time: the drafter-free draft's expected
tokens (its calibrated probabilities) over its verification cost, against what the model drafter's own drafts have
committed per step over their verification and drafting cost (running figures, measured in this call). When every
row takes the drafter-free draft, the model drafter does not draft at all this step; otherwise it drafts for the rows
that take its drafts, and the rows' drafts are merged into one tree for one verification forward (a drafter whose
trees take no other rows, LayerSkip, drafts for all rows then). Exact for sampling too: a drafter-free draft in a
tree of sampled drafts is given as a point mass, for which the speculative-sampling rule is the rule for
deterministic drafts.

The model drafter still reads every verification forward (its features, its cache), whoever drafted.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from .. import registry
from ..registry import Option
from ..syncs import to_device
from ..tree import DraftTree
from .base import Proposer, RowDraft, rules_of

DEFAULT = "suffix"  # the drafter-free source of a model drafter under the adaptive schedule, unless hybrid= says


@dataclasses.dataclass(frozen=True)
class _HybridOption(Option):
    """``hybrid``: on the command line and in bench strings ``none``, ``off`` and ``false`` turn it off (``False``),
    as a user writing them means, not "the default"."""

    def parse(self, text: str):
        return False if text.lower() in ("none", "off", "false", "0", "") else text


HYBRID = _HybridOption(
    "hybrid", object, None,
    "also draft without the model: 'suffix', 'prompt_lookup' or a hf_specdec.SuffixCache (suffix decoding over it); "
    "per row and step the candidate that commits more per unit of time is verified (default: 'suffix' under the "
    "adaptive schedule, off under draft_length_schedule='constant'; False or 'off': off)")


def source(opts: dict):
    """The drafter-free source a model-drafter method's resolved options ask for: ``hybrid=`` as given, else
    :data:`DEFAULT` under the adaptive schedule and none under ``draft_length_schedule="constant"``.

    Example:
        >>> source({"hybrid": None, "draft_length_schedule": "adaptive"}), source({"hybrid": False})
        ('suffix', False)
    """
    value = opts.get("hybrid")
    if value is None:
        return DEFAULT if opts.get("draft_length_schedule", "adaptive") != "constant" else None
    return value


def alone(method: str, opts: dict) -> dict:
    """``opts`` of ``method`` with hybrid drafting off unless ``hybrid=`` is among them: the method's own drafts only,
    as transformers' candidate generators make them (``auto``; a proposer run in transformers' own loop).

    Example:
        >>> alone("prompt_lookup", {}), alone("eagle3", {})["hybrid"], alone("eagle3", {"hybrid": "suffix"})["hybrid"]
        ({}, False, 'suffix')
    """
    if "hybrid" in registry.get(method).option_names and opts.get("hybrid") is None:
        return {**opts, "hybrid": False}
    return opts


def lookup_proposer(value):
    """The drafter-free proposer a ``hybrid=`` value names (``None``, ``False`` or ``"off"``: no hybrid)."""
    from .prompt_lookup import PromptLookupProposer
    from .suffix import SuffixProposer
    from .suffix_index import SuffixCache

    if value is None or value is False or (isinstance(value, str) and value == "off"):
        return None
    if isinstance(value, SuffixCache):
        return SuffixProposer(cache=value)
    if value == "suffix":
        return SuffixProposer()
    if value == "prompt_lookup":
        return PromptLookupProposer()
    raise ValueError(f"hybrid must be 'suffix', 'prompt_lookup', a hf_specdec.SuffixCache, or False / 'off' (no "
                     f"hybrid drafting), got {value!r}.")


class HybridProposer(Proposer):
    """``model`` (a model-drafter proposer) and ``lookup`` (a proposer with ``row_drafts``/``learn``: suffix or
    prompt lookup) as one proposer; see the module docstring.

    Args:
        model: the model drafter's proposer.
        lookup: the drafter-free proposer.
        prior_tokens: what a model-drafted step is taken to commit per row until measured.
    """

    def __init__(self, model: Proposer, lookup: Proposer, prior_tokens: float = 2.0):
        self.model, self.lookup = model, lookup
        self.name = f"{model.name}+{lookup.name}"
        self.max_nodes = max(model.max_nodes, lookup.max_nodes)
        self.typical_acceptance = model.typical_acceptance
        self.prior_tokens = prior_tokens

    @property
    def target_hidden_states(self):
        return self.model.target_hidden_states

    @property
    def drafter(self):
        return getattr(self.model, "drafter", None)

    def draft_modules(self) -> list:
        return self.model.draft_modules()

    def network_parts(self) -> list:
        return self.model.network_parts()  # the suffix lookup drafts from host data

    def prepare(self, model) -> None:
        self.model.prepare(model)
        self.lookup.prepare(model)

    def begin(self, state) -> None:
        self.rules = rules_of(state)
        self.model.begin(state)
        self.lookup.begin(state)
        self.model_tokens = self.prior_tokens  # tokens a model-drafted row commits per step (running)
        self.model_cost = None  # its verification + drafting cost in one-token steps (running)
        self.choice: list[str] = []
        self.lookup_steps = self.model_steps = 0

    def _model_rate(self, state) -> float:
        cost = self.model_cost
        if cost is None:
            cost = state.cost_model.relative(4) if state.cost_model is not None else 1.0
        return self.model_tokens / max(cost, 1e-6)

    def propose(self, state):
        drafts = self.lookup.row_drafts(state)
        rate = self._model_rate(state)
        cost = state.cost_model
        use = []
        for b, d in enumerate(drafts):
            ok = d is not None and state.max_drafts[b] > 0
            if ok and cost is not None and self.rules.hybrid_choice:  # off: the drafter-free draft when there is one
                ok = d.expected / cost.relative(len(d.tokens) + 1) >= rate
            use.append(ok)
        if not self.model.merges_rows and not all(u or state.max_drafts[b] == 0 for b, u in enumerate(use)):
            use = [False] * len(use)  # a drafter whose trees take no other rows (LayerSkip): the model for all rows
        self.lookup.pending = [d if u else None for d, u in zip(drafts, use)]
        self.choice = ["lookup" if u else ("model" if state.max_drafts[b] > 0 else "") for b, u in enumerate(use)]
        if all(u or state.max_drafts[b] == 0 for b, u in enumerate(use)):
            self.lookup_steps += 1
            self._model_seconds = None
            return _merge(state, None, self.lookup.pending)
        view = state
        if any(use):  # the model drafts only for the rows that take its drafts
            view = copy.copy(state)
            view.max_drafts = [0 if u else m for u, m in zip(use, state.max_drafts)]
        t0 = time.perf_counter()
        tree = self.model.propose(view)
        self._model_seconds = time.perf_counter() - t0
        self.model_steps += 1
        return _merge(state, tree, self.lookup.pending)

    def commit(self, state, tree, result) -> None:
        self.model.commit(state, tree, result)
        self.lookup.commit(state, tree, result)
        rows = [b for b, c in enumerate(self.choice) if c == "model" and result.paths[b]]
        if rows and getattr(self, "_model_seconds", None) is not None and state.cost_model is not None:
            tokens = sum(len(result.new_tokens[b]) for b in rows) / len(rows)
            step = state.cost_model.step_seconds()
            drafting = self._model_seconds / step if step else 0.0
            cost = state.cost_model.relative(tree.num_nodes) + drafting
            self.model_tokens = 0.8 * self.model_tokens + 0.2 * tokens
            self.model_cost = cost if self.model_cost is None else 0.8 * self.model_cost + 0.2 * cost
        self.choice = []

    def on_compact(self, state, index) -> None:
        self.model.on_compact(state, index)
        self.lookup.on_compact(state, index)

    def can_continue(self, carried) -> bool:
        return self.model.can_continue(carried) and self.lookup.can_continue(None)

    def hand_back(self, state, index):
        self.lookup.hand_back(state, index)
        return self.model.hand_back(state, index)

    def end(self, state) -> None:
        self.model.end(state)
        self.lookup.end(state)


def _merge(state, tree: DraftTree | None, drafts: list[RowDraft | None]) -> DraftTree | None:
    """One tree: the rows with a drafter-free draft in ``drafts`` take it, the others their row of ``tree``. Rows are
    chosen on the device (``torch.where`` over both trees padded to one width): nothing is read back."""
    if not any(d is not None for d in drafts):
        return tree
    lookup = DraftTree.from_rows(state.roots(), [list(d.tokens) if d is not None else [] for d in drafts],
                                 [list(d.parents) if d is not None else [] for d in drafts])
    if tree is None or lookup is None:
        return tree if lookup is None else lookup
    width = max(tree.num_nodes, lookup.num_nodes)
    use = to_device([d is not None for d in drafts], state.device, dtype=torch.bool)[:, None]

    def pad(t, value=0):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    chain = tree.is_chain and lookup.is_chain
    tokens = torch.where(use, pad(lookup.tokens), pad(tree.tokens))
    valid = torch.where(use, pad(lookup.valid, False), pad(tree.valid, False))
    if chain:
        parents = (torch.arange(width, device=state.device) - 1).expand(state.batch_size, width)
    else:
        parents = torch.where(use, pad(lookup.parents), pad(tree.parents))
    depths = [t.host_depth for t in (tree, lookup)]
    merged = DraftTree(tokens=tokens, parents=parents, valid=valid, is_chain=chain,
                       host_depth=None if None in depths else max(depths))
    if tree.draft_probs is not None:  # a deterministic draft is a point mass
        vocab = tree.draft_probs.shape[-1]
        probs = torch.nn.functional.pad(tree.draft_probs, (0, 0, 0, width - tree.num_nodes))
        point = torch.nn.functional.one_hot(tokens, vocab).to(probs.dtype) * valid[:, :, None]
        point[:, 0] = 0
        merged.draft_probs = torch.where(use[:, :, None], point, probs)
    return merged


def wrap(proposer: Proposer, hybrid) -> Proposer:
    """``proposer`` wrapped with the drafter-free source ``hybrid`` names (unchanged when ``None``)."""
    lookup = lookup_proposer(hybrid)
    return proposer if lookup is None else HybridProposer(proposer, lookup)
