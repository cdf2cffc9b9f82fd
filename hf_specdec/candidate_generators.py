"""hf_specdec proposers as transformers ``CandidateGenerator``s, run inside transformers' own assisted loop.

transformers' loop verifies one chain per step at batch size 1; hf_specdec's own loop (``custom_generate=``) adds
trees, batches and exact stop handling. These adapters are for users who want to keep transformers' loop and swap
the drafting only.

Example:
    >>> from hf_specdec.candidate_generators import in_transformers_loop
    >>> out = model.generate(**inputs, max_new_tokens=64, do_sample=False,
    ...                      custom_generate=in_transformers_loop("prompt_lookup"))

or, building the generator yourself (e.g. inside a subclass's ``_get_candidate_generator``):

    >>> gen = PromptLookupCandidateGenerator(model, logits_processor=processors, max_length=128)
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList

from ._transformers import run_assisted_decoding
from .attention import needs_switch, verifiable_attention
from .cache import CacheLayout
from .costs import ForwardCostModel
from .placement import drafter_device
from .proposers import DraftModelProposer, PromptLookupProposer
from .proposers.prompt_lookup import MAX_NGRAM, NUM_TOKENS
from .proposers.build import build_proposer
from .proposers.hybrid import alone
from .state import DecodingState
from .tree import DraftTree
from .verify import AcceptResult


class ProposerCandidateGenerator(CandidateGenerator):
    """Adapts any chain :class:`~hf_specdec.proposers.Proposer` to transformers' ``CandidateGenerator`` (batch 1).

    Args:
        proposer: the proposer (its trees must be chains).
        model: the target model.
        logits_processor: the call's processors (applied to draft distributions, as in hf_specdec's loop).
        max_length: the call's ``max_length``; no drafts are proposed past it.
        do_sample: whether the call samples (drafts are then sampled and their probabilities returned as logits).
    """

    def __init__(self, proposer, model, logits_processor: LogitsProcessorList | None = None, max_length: int = 20,
                 do_sample: bool = False):
        self.proposer = proposer
        self.model = model
        self.logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.max_length = max_length
        self.do_sample = do_sample
        self.cost_model = ForwardCostModel(drafter_device(model).type)
        self.state: DecodingState | None = None
        self._tree = None  # the drafts of the step in flight
        self._matches = None  # how many of them transformers accepted
        self._t_sent = None
        proposer.prepare(model)
        self._switch = needs_switch(*proposer.draft_modules())
        # proposers fed with target hidden states (EAGLE-3) get them from transformers' previous forward
        self.requires_model_outputs = proposer.target_hidden_states is not None
        if self.requires_model_outputs:
            self.model_kwargs_overrides = {"output_hidden_states": list(proposer.target_hidden_states)}

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one step drafts (transformers >= 5.25 reads it to size the rollback history of recurrent
        cache layers): the call's ``max_length``, a bound for every proposer (their chains vary per step)."""
        return self.max_length

    def _sync(self, input_ids: torch.LongTensor, hidden_states=None) -> DecodingState:
        """The loop state for ``input_ids`` (all committed tokens; the last one is not in the target cache)."""
        if input_ids.shape[0] != 1:
            raise ValueError("transformers' assisted loop runs batch size 1; use custom_generate='hf_specdec/...' "
                             "for batches.")
        length = input_ids.shape[1]
        first = self.state is None
        if first:
            self.state = DecodingState(self.model, input_ids, torch.ones_like(input_ids), self.max_length,
                                       self.logits_processor, self.do_sample, self.cost_model)
        state = self.state
        state.tokens[:, :length] = input_ids
        state.host_tokens = input_ids.tolist()  # transformers' own loop: its syncs are its own
        state.lengths = [length]
        state.layout = CacheLayout(valid=torch.ones(1, length - 1, dtype=torch.bool, device=input_ids.device),
                                   positions=torch.arange(length - 1, device=input_ids.device)[None],
                                   tokens=input_ids[:, :-1])
        state.root_positions = input_ids.new_tensor([length - 1])
        state.max_drafts = [max(self.max_length - length - 1, 0)]
        state.hidden_states = hidden_states
        if first:
            self.proposer.begin(state)
        return state

    def get_candidates(self, input_ids: torch.LongTensor, model_outputs=None, n_last_matches=None, **kwargs):
        if self.requires_model_outputs and model_outputs is None:
            return input_ids, None  # the first forward is a plain prefill that yields the prompt's hidden states
        hidden = model_outputs.hidden_states if self.requires_model_outputs else None
        first = self.state is None
        state = self._sync(input_ids, hidden)
        # a drafter's forwards take 4D masks: a FlashAttention drafter drafts on sdpa (hf_specdec.attention)
        with verifiable_attention(*self.proposer.draft_modules()) if self._switch else nullcontext():
            if not first:
                # the previous step's outcome: transformers kept its root and the accepted drafts
                n = int(n_last_matches) if n_last_matches is not None else int(self._matches or 0)
                tree = self._tree if self._tree is not None else DraftTree.chain(input_ids[:, -(n + 2):-(n + 1)][:, 0])
                result = AcceptResult(paths=[list(range(n + 1))], new_tokens=[input_ids[0, -(n + 1):].tolist()])
                self.proposer.commit(state, tree, result)
            tree = self.proposer.propose(state) if state.max_drafts[0] > 0 else None
        self._tree, self._matches = tree, None
        self._t_sent = time.perf_counter()
        if tree is None:
            return input_ids, None
        if not tree.is_chain:
            raise ValueError(f"{type(self.proposer).__name__} proposed a tree; transformers' loop verifies chains only.")
        k = int(tree.valid[0].sum()) - 1
        candidates = torch.cat([input_ids, tree.tokens[:, 1:k + 1].to(input_ids.device)], dim=1)
        logits = None
        if tree.draft_probs is not None:
            logits = tree.draft_probs[:, 1:k + 1].clamp_min(1e-30).log()
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self._matches = int(num_matches)
        if self._tree is not None and self._t_sent is not None:
            self.cost_model.record(int(self._tree.valid[0].sum()), time.perf_counter() - self._t_sent)


class PromptLookupCandidateGenerator(ProposerCandidateGenerator):
    """hf_specdec's adaptive prompt lookup (longest n-gram first, most recent match) for transformers' loop."""

    def __init__(self, model, num_output_tokens: int = NUM_TOKENS.default, max_matching_ngram_size: int = MAX_NGRAM.default,
                 adaptive: bool = True,
                 logits_processor: LogitsProcessorList | None = None, max_length: int = 20, do_sample: bool = False):
        super().__init__(PromptLookupProposer(num_output_tokens, max_matching_ngram_size, adaptive=adaptive), model,
                         logits_processor, max_length, do_sample)


class DraftModelCandidateGenerator(ProposerCandidateGenerator):
    """hf_specdec's draft-model proposer (drafter cache kept to the last accepted token) for transformers' loop."""

    def __init__(self, model, drafter, num_speculative_tokens: int | None = None,
                 logits_processor: LogitsProcessorList | None = None, max_length: int = 20, do_sample: bool = False):
        super().__init__(DraftModelProposer(drafter, num_tokens=num_speculative_tokens), model, logits_processor,
                         max_length, do_sample)


def in_transformers_loop(method: str, **opts):
    """A ``custom_generate`` callable that runs ``method``'s proposer inside transformers' own assisted loop.

    The generator is handed to transformers for the duration of the call only
    (:func:`hf_specdec._transformers.run_assisted_decoding`). Hybrid drafting is off unless ``hybrid=`` is given:
    its default source, suffix decoding, drafts trees, and transformers' loop verifies chains.
    """

    def run(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, drafter=None,
            **model_kwargs):
        options = alone(method, dict(opts))
        if drafter is not None:
            options["drafter"] = drafter
        proposer = build_proposer(method, model, **options)
        generator = ProposerCandidateGenerator(proposer, model, logits_processor, generation_config.max_length,
                                               bool(generation_config.do_sample))
        return run_assisted_decoding(model, generator, input_ids, logits_processor, stopping_criteria,
                                     generation_config, **model_kwargs)

    run.__name__ = f"hf_specdec_{method}_in_transformers_loop"
    return run
