"""The decoding loop: propose -> verify (one target forward) -> accept -> commit. One loop for every method.

:func:`speculative_decode` has the signature of a transformers decoding method (``GenerationMixin._sample``):
``generate()`` prepares the inputs, the generation config, the logits processors and the stopping criteria, and
calls it through ``custom_generate=``. The entry points in :mod:`hf_specdec.entry` bind a proposer to it.

Invariants of the loop (per row ``b`` of the batch):

* ``state.tokens[b, :lengths[b]]`` is what plain ``generate()`` would hold for that row: left padding, prompt,
  generated tokens. Its last token is the *root*: committed, not yet in the target's cache.
* the target's cache holds one column per token before the root; ``state.layout`` says which columns are real for
  the row (``valid``), their position ids and token ids.
* a step feeds the tree (root + drafts) at positions ``root_position + depth`` with a mask built from the layout;
  the accepted path's columns are kept, the row commits the accepted drafts and the target's own next token.

The loop runs the target only through a :class:`~hf_specdec.runners.TargetSession` (prefill, verify a tree, a
bracket around each proposal); backend tricks live in the runner the entry point chose. The state
proposers read is :class:`~hf_specdec.state.DecodingState`; the per-row bookkeeping of the output (stops, scores,
streaming) is :class:`~hf_specdec.rows.RowBook`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.logits_process import (
    LogitsProcessorList,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import StoppingCriteriaList

from . import cache as cache_ops
from ._transformers import dropped_mask_length, pad_token_tensor, user_defined_cache
from .adaptive import Rules
from .coupling import CoupledNoise, apply_warpers, call_seed, seeded
from .dtypes import HALF
from .proposers.base import Proposer
from .rows import RowBook, Stopper
from .runners import TargetRunner, call_lock
from .state import DecodingState
from .launches import step_range
from .syncs import to_device
from .timing import StepTimer
from .tree import DraftTree
from .verify import AcceptResult, accept

# One line per call (method, tokens, acceptance length, target forwards, seconds) at INFO: a server's log shows what
# speculation does (``HF_SPECDEC_LOG_CALLS=1`` prints them on stderr, e.g. under ``transformers serve``: set up in
# hf_specdec/__init__.py).
CALLS = logging.getLogger("hf_specdec.calls")


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``speculative_stats`` (see :class:`SpeculativeStats`)."""

    speculative_stats: dict | None = None


@dataclass
class SpeculativeStats:
    """Counters of one generate call.

    ``acceptance_length`` is the mean number of tokens a row commits per verification forward, the target's own
    token included (1.0 = no draft ever accepted); the prefill is not a verification step.
    """

    method: str = ""
    acceptance: str = "exact"  # "typical (lossy)": outputs are not distributed as the target's
    sampling: str = "greedy"  # "coupled", "rejection", "typical" (hf_specdec.coupling, hf_specdec.verify)
    seed: int | None = None  # the call's seed when it samples: seed=<it> repeats the call
    noise_seconds: float = 0.0  # coupled sampling: time making Gumbel noise (included in the draft/verify times)
    noise_positions: int = 0  # coupled sampling: positions whose noise was made
    target_forward_passes: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    committed_tokens: int = 0
    verify_row_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    compactions: int = 0
    accept_histogram: dict[int, int] = field(default_factory=dict)
    exact_bits: bool | None = None  # half precision: verification rounds as the one-token steps (probed; see below)
    cached_tokens: int = 0  # a continued conversation: input tokens per row the given cache held (not prefilled)

    @property
    def acceptance_length(self) -> float:
        return self.committed_tokens / self.verify_row_steps if self.verify_row_steps else 0.0

    def count_row(self, result: AcceptResult, b: int) -> None:
        """Count row ``b`` of one verification step (host data only)."""
        n_acc = len(result.paths[b]) - 1
        self.verify_row_steps += 1
        self.proposed_drafts += result.proposed[b]
        self.accepted_drafts += n_acc
        self.committed_tokens += len(result.new_tokens[b])
        self.accept_histogram[n_acc] = self.accept_histogram.get(n_acc, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "acceptance": self.acceptance,
            "sampling": self.sampling,
            "seed": self.seed,
            "noise_seconds": self.noise_seconds,
            "noise_positions": self.noise_positions,
            "target_forward_passes": self.target_forward_passes,
            "proposed_drafts": self.proposed_drafts,
            "accepted_drafts": self.accepted_drafts,
            "acceptance_length": self.acceptance_length,
            "committed_tokens": self.committed_tokens,
            "verify_row_steps": self.verify_row_steps,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "compactions": self.compactions,
            "accept_histogram": dict(sorted(self.accept_histogram.items())),
            "exact_bits": self.exact_bits,
            "cached_tokens": self.cached_tokens,
        }


def unsupported_mode(generation_config) -> str | None:
    """Why ``generation_config`` asks for what speculative decoding does not do (beam search, several sequences per
    prompt, contrastive search, DoLa, continuous batching, per-step attentions), with the fix; ``None`` when it can
    speculate. A model folder with a method attached (:mod:`hf_specdec.attach`) runs such a call with transformers'
    own ``generate``."""
    c = generation_config
    if c.num_beams is not None and c.num_beams > 1:
        return (f"Speculative decoding does not combine with beam search (num_beams={c.num_beams}). Set num_beams=1, "
                "or drop custom_generate to run beam search.")
    if c.num_return_sequences is not None and c.num_return_sequences > 1:
        return (f"num_return_sequences={c.num_return_sequences} is not supported with speculative decoding. Repeat the "
                "prompt in the batch instead (input_ids.repeat(n, 1)) and sample with do_sample=True.")
    if c.penalty_alpha is not None and c.penalty_alpha > 0 and c.top_k is not None and c.top_k > 1:
        return (f"Speculative decoding does not run contrastive search (penalty_alpha={c.penalty_alpha}). Drop "
                "penalty_alpha, or drop custom_generate to run it.")
    if getattr(c, "dola_layers", None) is not None:
        return "Speculative decoding does not run DoLa decoding (dola_layers=...). Drop dola_layers, or drop " \
               "custom_generate to run it."
    if c.cache_implementation == "paged":
        return ("cache_implementation='paged' is transformers' continuous batching (generate_batch), which speculative "
                "decoding does not run. Drop it, or drop custom_generate to batch continuously.")
    if c.output_attentions or c.output_hidden_states:
        return ("output_attentions / output_hidden_states are not returned by speculative decoding (the target runs "
                "on draft trees, not one token at a time). Drop them, or run plain generate() for those outputs.")
    return None


def _check_inputs(model, input_ids, attention_mask, generation_config, logits_processor, max_length):
    if model.config.is_encoder_decoder:
        raise ValueError("hf_specdec speculative decoding supports decoder-only models; this model is encoder-decoder.")
    reason = unsupported_mode(generation_config)
    if reason is not None:
        raise ValueError(reason)
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: speculative decoding needs at least one prompt token.")
    mask_width = attention_mask.shape[1] if attention_mask is not None else dropped_mask_length(generation_config)
    if mask_width is not None and mask_width != input_ids.shape[1]:
        raise ValueError(
            f"attention_mask covers {mask_width} tokens but input_ids has {input_ids.shape[1]}: pass both for the same "
            "tokens. A conversation continued from its cache takes the whole conversation as input_ids (the cached "
            "tokens followed by the new ones, e.g. torch.cat([out.sequences, new_ids], dim=1)) with its mask.")
    if any(isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in logits_processor):
        raise ValueError("Classifier-free guidance (guidance_scale with a negative prompt) is not supported with "
                         "speculative decoding.")
    host = _host_inputs(input_ids, attention_mask)
    if not all(host.real):
        raise ValueError("A row of the batch is all padding (attention_mask is all zeros).")
    if host.holes:  # left padding only: once a row has a real token, every later token is real
        raise ValueError(
            "Right padding (or holes) detected in attention_mask. Decoder-only models need left padding: "
            "set tokenizer.padding_side = 'left'. (A conversation continued from its cache: mark every generated "
            "token 1, the padding after a row's end-of-sequence token included, as generate() marks them.)"
        )
    window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if window is not None:
        real = max(host.real)
        if real >= window:
            raise ValueError(f"The prompt has {real} tokens, past the model's context window of {window} "
                             "(config.max_position_embeddings). Shorten the prompt.")
        pads = min(host.pads)
        if max_length - pads > window:
            raise ValueError(
                f"max_length={max_length} (prompt + max_new_tokens) runs past the model's context window of {window}"
                f" tokens. Lower max_new_tokens to at most {window - (input_ids.shape[1] - pads)}."
            )
    return host


@dataclass
class _HostInputs:
    """The call's inputs on the host, read once: ids per row, real and padding counts, whether the mask has holes."""

    ids: list[list[int]]
    real: list[int]
    pads: list[int]
    holes: bool


def _host_inputs(input_ids, attention_mask) -> _HostInputs:
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    rows = torch.cat([input_ids, attention_mask.long()], dim=1).tolist()  # the call's one read of its inputs
    width = input_ids.shape[1]
    ids, masks = [r[:width] for r in rows], [r[width:] for r in rows]
    real = [sum(1 for m in mask if m) for mask in masks]
    pads = [width - n for n in real]
    holes = any(any(m == 0 for m in mask[width - n:]) for mask, n in zip(masks, real))
    return _HostInputs(ids=ids, real=real, pads=pads, holes=holes)


def _one_call_at_a_time(decode):
    """``decode`` holding :func:`~hf_specdec.runners.call_lock` of its model and of its proposer for the whole call:
    calls on the same model (or with the same proposer object) from several threads run one after the other, each
    with its own correct output; calls on different models run side by side. Taken once per call, never per step."""
    signature = inspect.signature(decode)

    @functools.wraps(decode)
    def locked(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        with call_lock(given["model"]), call_lock(given["proposer"]):
            return decode(*args, **kwargs)

    return locked


@_one_call_at_a_time
def speculative_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    proposer: Proposer,
    runner: TargetRunner,
    streamer=None,
    rounding: str | None = None,
    prompt_streamed: bool = False,
    speculative_sampling: str | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    adaptive_rules: Rules | None = None,
    **model_kwargs,
):
    """Run speculative decoding with ``proposer`` (a ``GenerationMixin._sample``-compatible decoding method).

    ``runner`` runs the target (:mod:`hf_specdec.runners`; the entry point chose it once for the call,
    :func:`~hf_specdec.runner_choice.runner_for`); ``rounding`` is the ``rounding`` option (half precision;
    ``"auto"`` runs as ``"fast"`` where the probe says it would not be bit-identical,
    :meth:`~hf_specdec.runners.TargetRunner.rounding_for`); ``prompt_streamed``: ``streamer`` has the prompt
    already. When sampling, ``speculative_sampling`` is ``"coupled"`` (default: the text is a function of the seed,
    the same for every method; :mod:`hf_specdec.coupling`) or ``"rejection"`` (exact speculative sampling, the most
    accepted drafts, from torch's generator); ``seed`` / ``generator`` give the call's seed (default: one draw from
    torch's global generator; ``speculative_stats["seed"]`` reports it). ``adaptive_rules``: the
    :class:`~hf_specdec.adaptive.Rules` the call decides how much to draft by (``None``: every rule on); the output
    is the same under any of them, only the speed changes.

    Returns a ``LongTensor`` of sequences, or a :class:`SpeculativeDecoderOnlyOutput` when
    ``generation_config.return_dict_in_generate`` is set; its ``speculative_stats["exact_bits"]`` says, in half
    precision, whether a verification here gives the bits of the target's own one-token steps (probed once per model,
    dtype and rounding by :meth:`~hf_specdec.runners.TargetRunner.exact_bits`; ``False`` for a batch of several rows,
    whose verification is not made to round as one row's; ``None`` in float32, where the output is identical anyway).
    """
    t_start = time.perf_counter()
    logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
    stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    attention_mask = model_kwargs.get("attention_mask")
    host = _check_inputs(model, input_ids, attention_mask, generation_config, logits_processor,
                         generation_config.max_length)
    if adaptive_rules is not None and not isinstance(adaptive_rules, Rules):
        raise ValueError(f"adaptive_rules must be a hf_specdec.adaptive.Rules, got {type(adaptive_rules).__name__}.")
    proposer.prepare(model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return_dict = bool(generation_config.return_dict_in_generate)
    pad_id = pad_token_tensor(generation_config)
    stopper = Stopper(stopping_criteria, generation_config.max_length)
    asked, rounding = rounding, runner.rounding_for(rounding)
    state = DecodingState(model, input_ids, attention_mask, stopper.max_length, logits_processor,
                          bool(generation_config.do_sample), runner.cost_model(input_ids.shape[0], rounding),
                          host_ids=host.ids, pad_lengths=host.pads, rules=adaptive_rules)
    rows = RowBook(state, stopper, streamer, want_scores=return_dict and bool(generation_config.output_scores),
                   want_logits=return_dict and bool(generation_config.output_logits),
                   pad_id=int(pad_id) if pad_id is not None else 0, prompt_streamed=prompt_streamed)
    stats = SpeculativeStats(method=proposer.name)
    do_sample = bool(generation_config.do_sample)
    if do_sample and proposer.typical_acceptance and speculative_sampling == "coupled":
        raise ValueError("acceptance='typical' (Medusa's lossy rule) has its own acceptance; it does not combine with "
                         "speculative_sampling='coupled'. Drop one of the two.")
    if do_sample:
        stats.sampling = "typical" if proposer.typical_acceptance else speculative_sampling or "coupled"
        stats.seed = call_seed(seed, generator)
    state.do_sample = stats.sampling in ("rejection", "typical")
    if model.dtype in HALF:
        stats.exact_bits = input_ids.shape[0] == 1 and runner.exact_bits(asked)
    given = model_kwargs.get("cache")  # the caller's cache=/past_key_values=, or the one generate() made
    state.cache = runner.loop_cache(given, capacity=stopper.max_length + proposer.max_nodes + 64,
                                    batch_size=state.batch_size)
    state.cached, state.carried = _continue_from(given, state, proposer)
    stats.cached_tokens = state.cached
    # rejection sampling draws from torch's generators: seeded by the call's seed when one was given
    rng = seeded(stats.seed, state.device) if state.do_sample and (seed is not None or generator is not None) \
        else contextlib.nullcontext()
    with rng, runner.session(state.cache, proposer.target_hidden_states, proposer.draft_modules(),
                             rounding) as target:
        _decode(target, state, rows, stats, proposer, input_ids, attention_mask)
    if state.coupling is not None:
        stats.noise_seconds, stats.noise_positions = state.coupling.seconds, state.coupling.positions_made
    sequences = rows.finish()
    cache = state.cache
    if return_dict or user_defined_cache(given):  # the caller gets the cache back: aligned to the output
        cache = _hand_back(state, proposer, given, sequences.shape[1], runner)
    stats.total_seconds = time.perf_counter() - t_start
    if CALLS.isEnabledFor(logging.INFO):
        CALLS.info(f"hf_specdec {stats.method}: {sequences.shape[0]} row(s), {stats.committed_tokens} tokens, acceptance "
                   f"length {stats.acceptance_length:.2f}, {stats.target_forward_passes} target forwards, "
                   f"{stats.total_seconds:.3f} s")
    if not return_dict:
        return sequences
    n_new = sequences.shape[1] - state.prompt_length
    return SpeculativeDecoderOnlyOutput(
        sequences=sequences,
        scores=rows.stacked(rows.scores, n_new) if rows.want_scores else None,
        logits=rows.stacked(rows.logits, n_new) if rows.want_logits else None,
        cache=cache,
        speculative_stats=stats.as_dict(),
    )


def _decode(target, state: DecodingState, rows: RowBook, stats: SpeculativeStats, proposer: Proposer,
            input_ids: torch.LongTensor, attention_mask: torch.LongTensor) -> None:
    """Prefill, then propose -> verify -> accept -> commit until every row has stopped."""
    want_scores, want_logits = rows.want_scores, rows.want_logits
    typical = proposer.typical_acceptance  # Medusa's lossy rule, when asked for; None: the exact rules
    stats.acceptance = "typical (lossy)" if typical else "exact"
    # ---- prefill (the same inputs plain generate() feeds) and the first token
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # [B, P]
    t0 = time.perf_counter()
    padded = any(state.pad_lengths)
    # a continued conversation: the columns the cache holds are not fed again (their hidden states are not returned)
    first_logits, state.hidden_states = target.prefill(input_ids, attention_mask, positions, padded,
                                                       state.cached)  # [B, V]
    stats.target_forward_passes += 1
    first_scores = state.processors(input_ids, first_logits)
    if stats.sampling == "coupled":
        state.coupling = CoupledNoise(stats.seed, state.batch_size, first_logits.shape[-1], state.device,
                                      make=target.runner.noise_maker())
        first = (first_scores + state.noise(1)[:, 0]).argmax(-1)
    elif state.do_sample:
        first = torch.multinomial(torch.softmax(first_scores, dim=-1), 1)[:, 0]
    else:
        first = first_scores.argmax(-1)
    stats.verify_seconds += time.perf_counter() - t0
    state.layout = cache_ops.CacheLayout(valid=attention_mask.bool(), positions=positions, tokens=input_ids.clone(),
                                         counts=[state.prompt_length - p for p in state.pad_lengths])
    state.layout = target.hold(state.layout, proposer)
    state.root_positions = positions[:, -1] + 1
    firsts = first.tolist()  # the prefill's one read
    rows.commit_rows({b: [tok] for b, tok in enumerate(firsts)}, {b: [first_scores[b]] for b in range(len(firsts))},
                     {b: [first_logits[b]] for b in range(len(firsts))})
    rows.settle()

    proposer.begin(state)
    process = state.process_fn()
    # coupled sampling with warpers only: verified on the device, the warpers applied to a depth's nodes at once
    coupled_warp = functools.partial(apply_warpers, state.processors) if state.warpers_only else None
    deepest = proposer.longest_path() - 1  # the deepest tree a step may verify
    timer = StepTimer(state.device)

    while any(state.active):
        with step_range():  # a profiler range while one runs (launch counts: hf_specdec.launches)
            _make_room(state, target, proposer, stats)

            # ---- propose
            state.max_drafts = rows.budgets()
            t0 = time.perf_counter()
            # a batch whose speculation did not pay decodes plainly for a while (costs.SpeculationGate); a constant
            # schedule (the user's choice) and a single row (the proposers' own rules and back-off) are not gated
            gated = state.batch_size > 1 and getattr(proposer, "adaptive", True) and state.rules.gate
            gate = state.cost_model.gate_for(proposer.name) if gated else None
            with target.drafting():
                drafting = any(state.max_drafts) and (gate is None or gate.open())
                tree = target.propose(proposer, state) if drafting else None
            if tree is None:
                tree = DraftTree.chain(state.roots())
            draft_seconds = time.perf_counter() - t0
            stats.draft_seconds += draft_seconds
            if target.static and state.layout.length + tree.num_nodes > target.kv_width:
                raise RuntimeError("The static cache is too small for this draft tree.")  # pragma: no cover

            # ---- verify: one target forward over every node
            t0 = time.perf_counter()
            past = state.layout.length
            timer.start()
            logits, state.hidden_states = target.verify(state, tree)  # [B, N, V]
            # the forward's cost (a resumed one, LayerSkip, is cheaper than the full one the model measures); on CUDA
            # read from events once they completed, a step or so later, never waiting for them
            timer.stop(tree.num_nodes if tree.resume is None else None)
            state.tree_logits = logits
            noise = state.noise(tree.max_depth() + 1) if state.coupling is not None else None
            warp = coupled_warp if noise is not None else None
            # the rule on the device, without the prefixes: greedy without processors, coupled with warpers only
            on_device = (not state.do_sample and process is None) or warp is not None
            prefixes = None if on_device else [state.prefix(b) for b in range(state.batch_size)]
            rule_tree, rule_logits, fused = target.rule_inputs(tree, logits, on_device)  # (compiled: padded)
            result = accept(rule_tree, rule_logits, prefixes, state.active, process, state.do_sample, want_scores,
                            want_logits, typical=typical, noise=noise, warp=warp, fused=fused, deepest=deepest)
            elapsed = time.perf_counter() - t0
            stats.verify_seconds += elapsed
            stats.target_forward_passes += 1
            for nodes, seconds in timer.ready():
                if nodes is not None:
                    state.cost_model.record(nodes, seconds)
            unit = state.cost_model.step_seconds() if gate is not None and drafting else None
            if unit:  # what asking for drafts realised, for the speculation gate (batches only)
                active = [b for b in range(state.batch_size) if state.active[b]]
                tokens = sum(len(result.new_tokens[b]) for b in active) / max(len(active), 1)
                verify = state.cost_model.relative(tree.num_nodes) if tree.resume is None else elapsed / unit
                gate.record(tokens, verify, draft_seconds / unit, state.rules)

            # ---- commit: cut the cache back to the accepted paths, append tokens, check stops
            target.keep_accepted(state, tree, result, past)
            going = [b for b in range(state.batch_size) if state.active[b]]
            for b in going:
                stats.count_row(result, b)
            state.root_positions = state.root_positions + to_device([len(p) for p in result.paths], state.device)
            rows.commit_rows({b: result.new_tokens[b] for b in going}, result.scores, result.logits)
            proposer.commit(state, tree, result)
            rows.settle()
    for nodes, seconds in timer.flush():
        if nodes is not None:
            state.cost_model.record(nodes, seconds)
    proposer.end(state)


def _make_room(state: DecodingState, target, proposer: Proposer, stats: SpeculativeStats) -> None:
    """Rows of a batch leave holes in the cache: move real columns together when they waste too much room (or a
    static cache could not take the next tree)."""
    layout = state.layout
    if state.batch_size == 1:
        return
    if target.static:
        full = layout.length + proposer.max_nodes > target.kv_width
    else:  # holes take more than a quarter of the columns (and at least 32): attention pays for them every step
        real = max(layout.counts) if layout.counts is not None else int(layout.real_counts().max())
        full = layout.length - real > max(32, layout.length // 4)
    if not full:
        return
    index = layout.compaction_index()  # [B, T']
    cache_ops.gather_columns(state.cache, index)
    state.layout = layout.gather(index)
    proposer.on_compact(state, index)
    stats.compactions += 1


def _continue_from(given, state: DecodingState, proposer: Proposer) -> tuple[int, object]:
    """A call given a filled cache (a conversation's next turn, the input the whole conversation): the leading input
    columns the loop keeps from it (the prefill runs over the rest) and what the proposer handed back with it
    (:class:`~hf_specdec.cache.Continuation`). None are kept (everything is prefilled again: the same output, a
    longer prefill) when the cache's layers lack some of them (plain ``generate()``'s sliding-window layers keep their
    window only) or the proposer cannot continue from them (:meth:`~hf_specdec.proposers.Proposer.can_continue`: a
    feature drafter given a cache without the target features of its columns)."""
    held = cache_ops.held_columns(given, state.batch_size, state.prompt_length)
    if not held:
        return 0, None
    record = cache_ops.continuation_of(given, held, state.batch_size)
    carried = record.carried if record is not None else None
    if not cache_ops.holds_every_column(given, held) or not proposer.can_continue(carried):
        return 0, None
    if cache_ops.continues_in_place(given, state.cache):
        state.cache = given
    else:
        cache_ops.copy_columns(given, state.cache, held)
    return held, carried


def _hand_back(state: DecodingState, proposer: Proposer, given, width: int, runner):
    """The call's cache as the caller gets it back (``out.cache``; the cache object it passed, filled as
    ``generate()`` fills it): column ``j`` holds token ``j`` of every row of the ``width``-wide output, for the first
    ``min(lengths) - 1`` tokens (``generate()`` holds all but the last; a row that stopped early has no columns for its
    padding here: a next call prefills them), and the :class:`~hf_specdec.cache.Continuation` a next call continues
    with (what the proposer hands back: :meth:`~hf_specdec.proposers.Proposer.hand_back`)."""
    length = min(min(state.lengths), width) - 1
    if state.batch_size == 1:  # one row has no holes: its columns are its tokens already
        index = torch.arange(length, device=state.device)[None]
        cache_ops.crop(state.cache, length)
    else:  # each row's real columns, in order, after its left padding (whose columns hold any real one: masked)
        order = torch.argsort((~state.layout.valid).to(torch.int8), dim=1, stable=True)  # [B, T] real columns first
        pads = to_device(state.pad_lengths, state.device)
        index = order.gather(1, (torch.arange(length, device=state.device)[None] - pads[:, None]).clamp(min=0))
        cache_ops.gather_columns(state.cache, index)
    carried = proposer.hand_back(state, index)
    cache = runner.hand_out(state.cache)  # not the cache a runner keeps for later calls: they would write into it
    if given is not None and given is not cache:
        cache_ops.hand_over(cache, given)
        cache = given
    setattr(cache, cache_ops.RECORD, cache_ops.Continuation(length, state.batch_size, carried))
    return cache
