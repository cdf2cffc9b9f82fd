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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.logits_process import (
    LogitsProcessorList,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from . import cache as cache_ops
from .costs import ForwardCostModel
from .kernels import VerifyKernels
from .proposers.base import Proposer
from .tree import DraftTree, build_attention_mask
from .verify import AcceptResult, accept


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

    @property
    def acceptance_length(self) -> float:
        return self.committed_tokens / self.verify_row_steps if self.verify_row_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
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
        }


class DecodingState:
    """What the loop knows about the batch; proposers read it (and must not modify it)."""

    def __init__(self, model, input_ids: torch.LongTensor, attention_mask: torch.LongTensor, max_length: int,
                 logits_processor: LogitsProcessorList, do_sample: bool, cost_model: ForwardCostModel):
        self.model = model
        self.config = model.config
        self.device = input_ids.device
        self.batch_size, self.prompt_length = input_ids.shape
        self.max_length = max_length
        self.do_sample = do_sample
        self.cost_model = cost_model
        self.tokens = input_ids.new_zeros((self.batch_size, max_length + 1))
        self.tokens[:, : self.prompt_length] = input_ids
        self.lengths = [self.prompt_length] * self.batch_size
        self.pad_lengths = (attention_mask == 0).sum(1).tolist()
        self.active = [True] * self.batch_size
        self.eos_token_ids: list[int] = []  # drafting past one of these is wasted work
        self.max_drafts = [0] * self.batch_size
        self.root_positions: torch.LongTensor | None = None
        self.layout: cache_ops.CacheLayout | None = None
        self.cache = None
        self.hidden_states = None  # target hidden states of the last forward (indices asked by the proposer)
        self.last_tree: DraftTree | None = None
        self._processors = logits_processor
        self._row_independent = all(_is_row_independent(p) for p in logits_processor)

    # ---- reading the sequences
    def prefix(self, b: int) -> torch.LongTensor:
        """Committed ids of row ``b`` in plain ``generate()`` layout (left padding included, root last)."""
        return self.tokens[b, : self.lengths[b]]

    def row_tokens(self, b: int) -> torch.LongTensor:
        """Real (unpadded) committed ids of row ``b``."""
        return self.tokens[b, self.pad_lengths[b]: self.lengths[b]]

    def roots(self) -> torch.LongTensor:
        idx = torch.tensor([n - 1 for n in self.lengths], device=self.device)
        return self.tokens.gather(1, idx[:, None])[:, 0]

    # ---- logits processors with each position's own prefix
    @property
    def has_processors(self) -> bool:
        return len(self._processors) > 0

    def process(self, b: int, input_ids: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
        """Apply the call's logits processors/warpers to ``logits [1, V]`` of row ``b`` with prefix ``input_ids [1, L]``.

        Rows of a batch are at different lengths, so rows are processed one at a time. Some processors keep
        per-row state indexed by batch position (``prefix_allowed_tokens_fn``'s batch id, the repetition penalty's
        per-row prompt length), so the row is placed at its own index of a full-batch tensor (the other rows are
        copies whose results are dropped).
        """
        if not self._processors:
            return logits
        if self.batch_size == 1 or self._row_independent:
            return self._processors(input_ids, logits)
        ids = input_ids.expand(self.batch_size, -1)
        scores = logits.expand(self.batch_size, -1).clone()
        return self._processors(ids, scores)[b:b + 1]

    def process_fn(self):
        return self.process if self._processors else None


_ROW_INDEPENDENT = {
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty",
    "LogitNormalization", "TopHLogitsWarper",
}


def _is_row_independent(proc) -> bool:
    """Known processors whose output for a row depends on that row only (not on its batch index)."""
    name = type(proc).__name__
    if name == "RepetitionPenaltyLogitsProcessor":
        return not isinstance(getattr(proc, "prompt_ignore_length", None), torch.Tensor)
    return name in _ROW_INDEPENDENT


class _Stopper:
    """Stopping criteria, evaluated token by token inside an accepted block."""

    def __init__(self, stopping_criteria: StoppingCriteriaList, max_length: int, eos: torch.Tensor | None):
        self.max_length = max_length
        self.eos = set()
        self.others = []
        for crit in stopping_criteria:
            if isinstance(crit, MaxLengthCriteria):
                self.max_length = min(self.max_length, crit.max_length)
            elif isinstance(crit, EosTokenCriteria):
                self.eos |= set(crit.eos_token_id.view(-1).tolist())
            else:
                self.others.append(crit)
        # plain generate() pads finished rows only when some criterion knows an EOS token
        self.pads_finished_rows = any(hasattr(crit, "eos_token_id") for crit in stopping_criteria)

    def first_stop(self, tokens: torch.LongTensor, b: int, start: int, count: int) -> int | None:
        """Index ``j`` (1-based) of the first of ``count`` new tokens after ``start`` at which row ``b`` stops."""
        row = tokens[b, start:start + count].tolist()
        for j, tok in enumerate(row, start=1):
            length = start + j
            if length >= self.max_length or tok in self.eos:
                return j
            if self.others:
                ids = tokens[b:b + 1, :length]
                if any(bool(crit(ids, None).view(-1)[0]) for crit in self.others):
                    return j
        return None


def _check_inputs(model, input_ids, attention_mask, generation_config, logits_processor, max_length):
    if model.config.is_encoder_decoder:
        raise ValueError("hf_specdec speculative decoding supports decoder-only models; this model is encoder-decoder.")
    if generation_config.num_beams is not None and generation_config.num_beams > 1:
        raise ValueError(
            f"Speculative decoding does not combine with beam search (num_beams={generation_config.num_beams}). "
            "Set num_beams=1, or drop custom_generate to run beam search."
        )
    if generation_config.num_return_sequences is not None and generation_config.num_return_sequences > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences} is not supported with speculative "
            "decoding. Repeat the prompt in the batch instead (input_ids.repeat(n, 1)) and sample with do_sample=True."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not returned by speculative decoding (the target runs on "
            "draft trees, not one token at a time). Drop them, or run plain generate() for those outputs."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: speculative decoding needs at least one prompt token.")
    if any(isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in logits_processor):
        raise ValueError("Classifier-free guidance (guidance_scale with a negative prompt) is not supported with "
                         "speculative decoding.")
    if attention_mask is not None:
        mask = attention_mask.bool()
        if not mask.any(1).all():
            raise ValueError("A row of the batch is all padding (attention_mask is all zeros).")
        # left padding only: once a row has a real token, every later token is real
        if (mask.int().cummax(1).values.bool() & ~mask).any():
            raise ValueError(
                "Right padding (or holes) detected in attention_mask. Decoder-only models need left padding: "
                "set tokenizer.padding_side = 'left'."
            )
    window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if window is not None:
        real = int(attention_mask.sum(1).max()) if attention_mask is not None else input_ids.shape[1]
        if real >= window:
            raise ValueError(f"The prompt has {real} tokens, past the model's context window of {window} "
                             "(config.max_position_embeddings). Shorten the prompt.")
        pads = input_ids.shape[1] - real if attention_mask is None else int((attention_mask == 0).sum(1).min())
        if max_length - pads > window:
            raise ValueError(
                f"max_length={max_length} (prompt + max_new_tokens) runs past the model's context window of {window}"
                f" tokens. Lower max_new_tokens to at most {window - (input_ids.shape[1] - pads)}."
            )


def speculative_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    proposer: Proposer,
    streamer=None,
    **model_kwargs,
):
    """Run speculative decoding with ``proposer`` (a ``GenerationMixin._sample``-compatible decoding method).

    Returns a ``LongTensor`` of sequences, or a :class:`SpeculativeDecoderOnlyOutput` when
    ``generation_config.return_dict_in_generate`` is set. On the CPU the verification forwards use
    :class:`~hf_specdec.kernels.VerifyKernels`, and so do all forwards of the proposer's drafter and every
    product inside a proposal (``HF_SPECDEC_VERIFY_KERNELS=0`` turns them off).
    """
    with VerifyKernels(model, drafters=proposer.draft_modules()) as kernels:
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, streamer,
                       kernels, **model_kwargs)


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer: Proposer, streamer,
            kernels: VerifyKernels, **model_kwargs):
    t_start = time.perf_counter()
    logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
    stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    max_length = generation_config.max_length
    attention_mask = model_kwargs.get("attention_mask")
    _check_inputs(model, input_ids, attention_mask, generation_config, logits_processor, max_length)
    proposer.prepare(model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    want_scores = return_dict and bool(generation_config.output_scores)
    want_logits = return_dict and bool(generation_config.output_logits)
    pad_id = generation_config._pad_token_tensor
    pad_id = int(pad_id) if pad_id is not None else 0
    stopper = _Stopper(stopping_criteria, max_length, generation_config._eos_token_tensor)
    max_length = stopper.max_length

    device_type = input_ids.device.type
    state = DecodingState(model, input_ids, attention_mask, max_length, logits_processor, do_sample,
                          ForwardCostModel.for_model(model, device_type, input_ids.shape[0]))
    state.eos_token_ids = sorted(stopper.eos)
    stats = SpeculativeStats(method=proposer.name)
    bsz = state.batch_size
    dtype = model.dtype
    text_config = model.config.get_text_config()
    hidden_idx = proposer.target_hidden_states
    forward_kwargs = {"output_hidden_states": hidden_idx} if hidden_idx else {}

    cache = cache_ops.new_cache_like(model, model_kwargs.get("cache"), capacity=max_length + proposer.max_nodes + 64)
    static = cache_ops.is_static(cache)
    state.cache = cache

    # ---- prefill (the same inputs plain generate() feeds) and the first token
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    prefill_kwargs = dict(forward_kwargs)
    if model._supports_logits_to_keep():
        prefill_kwargs["logits_to_keep"] = 1
    if static:
        prefill_mask = build_attention_mask(
            text_config, attention_mask.new_zeros((bsz, 0), dtype=torch.bool), positions[:, :0], positions,
            torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool, device=input_ids.device).tril()[None]
            & attention_mask.bool()[:, None, :], dtype, kv_width=cache.get_max_length(),
        )
    else:
        prefill_mask = None if bool((attention_mask == 1).all()) else attention_mask
    t0 = time.perf_counter()
    out = model(input_ids=input_ids, attention_mask=prefill_mask, position_ids=positions, cache=cache,
                use_cache=True, return_dict=True, **prefill_kwargs)
    stats.target_forward_passes += 1
    first_logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
    first_scores = logits_processor(input_ids, first_logits)
    if do_sample:
        first = torch.multinomial(torch.softmax(first_scores, dim=-1), 1)[:, 0]
    else:
        first = first_scores.argmax(-1)
    stats.verify_seconds += time.perf_counter() - t0
    state.hidden_states = getattr(out, "hidden_states", None) if hidden_idx else None
    del out
    state.layout = cache_ops.CacheLayout(valid=attention_mask.bool(), positions=positions, tokens=input_ids.clone())
    state.root_positions = positions[:, -1] + 1

    scores_rows: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
    logits_rows: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
    stop_len: list[int | None] = [None] * bsz
    ignore_stop = [False] * bsz

    if streamer is not None:
        streamer.put(input_ids.cpu())
    streamed = [state.prompt_length]  # columns already handed to a batched streamer

    def commit_tokens(b: int, toks: list[int], row_scores, row_logits) -> None:
        """Append ``toks`` to row ``b``, cut at a stop, stream them."""
        start = state.lengths[b]
        state.tokens[b, start:start + len(toks)] = torch.tensor(toks, device=state.device)
        count = len(toks)
        if not ignore_stop[b]:
            j = stopper.first_stop(state.tokens, b, start, count)
            if j is not None:
                stop_len[b] = start + j
                if stopper.pads_finished_rows:
                    count = j
        state.lengths[b] = start + count
        if want_scores:
            scores_rows[b].extend(row_scores[:count])
        if want_logits:
            logits_rows[b].extend(row_logits[:count])
        if streamer is not None and bsz == 1 and count:
            streamer.put(state.tokens[b:b + 1, start:start + count].cpu())

    for b, tok in enumerate(first.tolist()):
        commit_tokens(b, [tok], [first_scores[b]], [first_logits[b]])
    _update_activity(state, stop_len, ignore_stop, stopper)
    _stream_columns(streamer, state, stop_len, stopper, streamed, pad_id, final=False)

    proposer.begin(state)
    process = state.process_fn()
    if proposer.max_nodes > 1 and any(state.active):
        _calibrate(model, cache, state, proposer.max_nodes, text_config, dtype, static, kernels)

    while any(state.active):
        # ---- room in the cache: rows of a batch leave holes; move real columns together when they waste too much
        if bsz > 1 and (
            (static and state.layout.length + proposer.max_nodes > cache.get_max_length())
            or (not static and _wasteful(state.layout))
        ):
            index = state.layout.compaction_index()
            cache_ops.gather_columns(cache, index)
            state.layout = state.layout.gather(index)
            proposer.on_compact(state, index)
            stats.compactions += 1

        # ---- propose
        state.max_drafts = [
            max(min(max_length, _target_len(b, stop_len, ignore_stop, max_length)) - state.lengths[b] - 1, 0)
            if state.active[b] else 0
            for b in range(bsz)
        ]
        t0 = time.perf_counter()
        with kernels.drafting():
            tree = proposer.propose(state) if any(state.max_drafts) else None
        if tree is None:
            tree = DraftTree.chain(state.roots())
        stats.draft_seconds += time.perf_counter() - t0
        n_nodes = tree.num_nodes

        if static and state.layout.length + n_nodes > cache.get_max_length():
            raise RuntimeError("The static cache is too small for this draft tree.")  # pragma: no cover

        # ---- verify: one target forward over every node
        t0 = time.perf_counter()
        past = state.layout.length
        node_pos = state.root_positions[:, None] + tree.depths
        mask = build_attention_mask(
            text_config, state.layout.valid, state.layout.positions, node_pos, tree.ancestors, dtype,
            kv_width=cache.get_max_length() if static else None,
        )
        with kernels.verifying(n_nodes):
            out = model(input_ids=tree.tokens, attention_mask=mask, position_ids=node_pos, cache=cache,
                        use_cache=True, return_dict=True, **forward_kwargs)
        logits = out.logits.float()
        state.hidden_states = getattr(out, "hidden_states", None) if hidden_idx else None
        del out
        prefixes = [state.prefix(b) for b in range(bsz)]
        result = accept(tree, logits, prefixes, state.active, process, do_sample, want_scores, want_logits)
        elapsed = time.perf_counter() - t0
        stats.verify_seconds += elapsed
        stats.target_forward_passes += 1
        state.cost_model.record(n_nodes, elapsed)

        # ---- commit: cut the cache back to the accepted paths, append tokens, check stops
        kept = [len(p) for p in result.paths]
        width = max(kept)
        path_nodes = torch.tensor([p + [0] * (width - len(p)) for p in result.paths], device=state.device)
        if result.is_prefix_paths():
            cache_ops.crop(cache, past + width)
        else:
            cache_ops.keep_columns(cache, past, path_nodes)
        keep = torch.tensor(kept, device=state.device)[:, None] > torch.arange(width, device=state.device)[None]
        state.layout.append(keep, state.root_positions[:, None] + tree.depths.gather(1, path_nodes),
                            tree.tokens.gather(1, path_nodes))
        state.last_tree = tree
        for b in range(bsz):
            if not state.active[b]:
                continue
            n_acc = kept[b] - 1
            stats.verify_row_steps += 1
            stats.proposed_drafts += int(tree.valid[b].sum()) - 1
            stats.accepted_drafts += n_acc
            stats.committed_tokens += len(result.new_tokens[b])
            stats.accept_histogram[n_acc] = stats.accept_histogram.get(n_acc, 0) + 1
            state.root_positions[b] += kept[b]
            commit_tokens(b, result.new_tokens[b],
                          result.scores[b] if want_scores else None, result.logits[b] if want_logits else None)
        proposer.commit(state, tree, result)
        _update_activity(state, stop_len, ignore_stop, stopper)
        _stream_columns(streamer, state, stop_len, stopper, streamed, pad_id, final=False)

    proposer.end(state)
    # ---- assemble the output exactly as plain generate() would
    final_len = max(stop_len) if all(s is not None for s in stop_len) else max(state.lengths)
    sequences = state.tokens[:, :final_len].clone()
    for b in range(bsz):
        if state.lengths[b] < final_len:
            sequences[b, state.lengths[b]:] = pad_id
    _stream_columns(streamer, state, stop_len, stopper, streamed, pad_id, final=True, sequences=sequences)
    if streamer is not None:
        streamer.end()
    stats.total_seconds = time.perf_counter() - t_start
    if not return_dict:
        return sequences
    n_new = final_len - state.prompt_length

    def stack(rows):
        """One ``[B, V]`` tensor per generated column; a row that had finished gets zeros there (plain
        ``generate()`` scored a padding step that speculative decoding never runs)."""
        filler = torch.zeros_like(next(r[0] for r in rows if r))
        return tuple(torch.stack([r[t] if t < len(r) else filler for r in rows]) for t in range(n_new))

    return SpeculativeDecoderOnlyOutput(
        sequences=sequences,
        scores=stack(scores_rows) if want_scores else None,
        logits=stack(logits_rows) if want_logits else None,
        cache=cache,
        speculative_stats=stats.as_dict(),
    )


def _calibrate(model, cache, state: DecodingState, max_nodes: int, text_config, dtype, static: bool,
               kernels: VerifyKernels) -> None:
    """Time one forward per draft size the proposer may use, once per model, device and batch size.

    The draft-length rules pick lengths from these costs (:mod:`hf_specdec.costs`); measuring them up front avoids
    never trying a size whose cost was guessed wrong. The forwards are undone by cropping the cache.
    """
    sizes = state.cost_model.calibration_sizes(max_nodes)
    if not sizes:
        return
    past = state.layout.length
    roots = state.roots()
    for i, q in enumerate([1] + sizes):  # the first one-token forward only warms up
        tokens = roots[:, None].expand(-1, q)
        pos = state.root_positions[:, None] + torch.arange(q, device=state.device)
        causal = torch.ones(q, q, dtype=torch.bool, device=state.device).tril().expand(state.batch_size, q, q)
        mask = build_attention_mask(text_config, state.layout.valid, state.layout.positions, pos, causal, dtype,
                                    kv_width=cache.get_max_length() if static else None)
        t0 = time.perf_counter()
        with kernels.verifying(q):
            model(input_ids=tokens, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                  return_dict=True)
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
        if i > 0:
            state.cost_model.record(q, time.perf_counter() - t0)
        cache_ops.crop(cache, past)


def _wasteful(layout: cache_ops.CacheLayout) -> bool:
    """Holes take more than a quarter of the columns (and at least 32): attention pays for them every step."""
    waste = layout.length - int(layout.real_counts().max())
    return waste > max(32, layout.length // 4)


def _target_len(b: int, stop_len: list, ignore_stop: list, max_length: int) -> int:
    """Length row ``b`` is generating towards (the common final length once a finished row has to catch up)."""
    if ignore_stop[b]:
        return max(s for s in stop_len if s is not None)
    return max_length


def _update_activity(state: DecodingState, stop_len: list, ignore_stop: list, stopper: _Stopper) -> None:
    """Decide which rows still take tokens.

    A row stops at its first stop. When no criterion knows an EOS token, plain ``generate()`` keeps generating real
    tokens for finished rows until every row is finished; such rows are resumed (without stop checks) until they
    reach the common final length.
    """
    for b in range(state.batch_size):
        state.active[b] = stop_len[b] is None
    if all(s is not None for s in stop_len) and not stopper.pads_finished_rows:
        final = max(stop_len)
        for b in range(state.batch_size):
            if state.lengths[b] < final:
                ignore_stop[b] = True
                state.active[b] = True


def _stream_columns(streamer, state, stop_len, stopper, streamed, pad_id, final, sequences=None):
    """Batched streamers get one ``[B]`` tensor per generated column, as plain ``generate()`` sends them."""
    if streamer is None or state.batch_size == 1:
        return
    if final:
        upto = sequences.shape[1]
        source = sequences
    else:
        ready = []
        for b in range(state.batch_size):
            finished = stop_len[b] is not None and stopper.pads_finished_rows
            ready.append(float("inf") if finished else state.lengths[b])
        upto = min(ready)
        if upto == float("inf"):
            return
        upto = int(upto)
        source = state.tokens.clone()
        for b in range(state.batch_size):
            if stop_len[b] is not None and stopper.pads_finished_rows:
                source[b, state.lengths[b]:] = pad_id
    for col in range(streamed[0], upto):
        streamer.put(source[:, col].cpu())
    streamed[0] = max(streamed[0], upto)
