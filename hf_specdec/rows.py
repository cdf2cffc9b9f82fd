"""The loop's per-row bookkeeping: where each row stops, which rows still take tokens, their score rows, streaming.

:class:`RowBook` is owned by the decoding loop (:mod:`hf_specdec.engine`); proposers never see it. It writes the
committed tokens into the :class:`~hf_specdec.state.DecodingState` and keeps what plain ``generate()`` would report
for each row: the output is cut exactly where plain decoding stops, finished rows are padded (or resumed) as plain
decoding does it, and streamers receive the same tensors.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .state import DecodingState


class Stopper:
    """Stopping criteria, evaluated token by token inside an accepted block."""

    def __init__(self, stopping_criteria: StoppingCriteriaList, max_length: int):
        self.max_length = max_length
        self.eos: set[int] = set()
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


class RowBook:
    """Per-row state of one call.

    Attributes (one entry per row):
        stop_len: the length at which the row stopped (``None``: still going).
        ignore_stop: the row stopped but keeps generating unchecked tokens up to the common final length (plain
            ``generate()`` does so when no criterion knows an EOS token).
        scores, logits: one ``[V]`` row per committed token, when the call asked for them.
        streamed: columns already handed to a batched streamer (for all rows).
    """

    def __init__(self, state: DecodingState, stopper: Stopper, streamer=None, want_scores: bool = False,
                 want_logits: bool = False, pad_id: int = 0, prompt_streamed: bool = False):
        bsz = state.batch_size
        self.state = state
        self.stopper = stopper
        self.streamer = streamer
        self.want_scores, self.want_logits = want_scores, want_logits
        self.pad_id = pad_id
        self.stop_len: list[int | None] = [None] * bsz
        self.ignore_stop = [False] * bsz
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
        self.streamed = state.prompt_length
        state.eos_token_ids = sorted(stopper.eos)
        if streamer is not None and not prompt_streamed:  # (generate() itself streams it before a callable runs)
            streamer.put(state.tokens[:, : state.prompt_length].cpu())

    # ---- one step
    def commit(self, b: int, tokens: list[int], scores=None, logits=None) -> None:
        """Append ``tokens`` to row ``b``, cut at its first stop, stream them (batch size 1)."""
        state = self.state
        start = state.lengths[b]
        state.tokens[b, start:start + len(tokens)] = torch.tensor(tokens, device=state.device)
        count = len(tokens)
        if not self.ignore_stop[b]:
            j = self.stopper.first_stop(state.tokens, b, start, count)
            if j is not None:
                self.stop_len[b] = start + j
                if self.stopper.pads_finished_rows:
                    count = j
        state.lengths[b] = start + count
        if self.want_scores:
            self.scores[b].extend(scores[:count])
        if self.want_logits:
            self.logits[b].extend(logits[:count])
        if self.streamer is not None and state.batch_size == 1 and count:
            self.streamer.put(state.tokens[b:b + 1, start:start + count].cpu())

    def settle(self) -> None:
        """After a step's commits: decide which rows still take tokens, stream the columns every row has."""
        self._update_activity()
        self._stream_ready()

    def budgets(self) -> list[int]:
        """The most drafts each row may take in the next step (the target's own token always follows them)."""
        state = self.state
        limit = self.stopper.max_length
        return [max(min(limit, self._target_len(b)) - state.lengths[b] - 1, 0) if state.active[b] else 0
                for b in range(state.batch_size)]

    # ---- the end
    def finish(self) -> torch.LongTensor:
        """The sequences exactly as plain ``generate()`` returns them; ends the streamer."""
        state = self.state
        done = all(s is not None for s in self.stop_len)
        final_len = max(self.stop_len) if done else max(state.lengths)
        sequences = state.tokens[:, :final_len].clone()
        for b in range(state.batch_size):
            if state.lengths[b] < final_len:
                sequences[b, state.lengths[b]:] = self.pad_id
        if self.streamer is not None:
            if state.batch_size > 1:
                self._put_columns(sequences, sequences.shape[1])
            self.streamer.end()
        return sequences

    def stacked(self, rows: list[list[torch.Tensor]], n_new: int) -> tuple[torch.Tensor, ...]:
        """One ``[B, V]`` tensor per generated column; a row that had finished gets zeros there (plain
        ``generate()`` scored a padding step that speculative decoding never runs)."""
        filler = torch.zeros_like(next(r[0] for r in rows if r))
        return tuple(torch.stack([r[t] if t < len(r) else filler for r in rows]) for t in range(n_new))

    # ---- helpers
    def _target_len(self, b: int) -> int:
        """Length row ``b`` is generating towards (the common final length once a finished row has to catch up)."""
        if self.ignore_stop[b]:
            return max(s for s in self.stop_len if s is not None)
        return self.stopper.max_length

    def _update_activity(self) -> None:
        """A row stops at its first stop. When no criterion knows an EOS token, plain ``generate()`` keeps
        generating real tokens for finished rows until every row is finished; such rows are resumed (without stop
        checks) until they reach the common final length."""
        state = self.state
        for b in range(state.batch_size):
            state.active[b] = self.stop_len[b] is None
        if all(s is not None for s in self.stop_len) and not self.stopper.pads_finished_rows:
            final = max(self.stop_len)
            for b in range(state.batch_size):
                if state.lengths[b] < final:
                    self.ignore_stop[b] = True
                    state.active[b] = True

    def _finished_and_padded(self, b: int) -> bool:
        return self.stop_len[b] is not None and self.stopper.pads_finished_rows

    def _stream_ready(self) -> None:
        """Batched streamers get one ``[B]`` tensor per generated column, as plain ``generate()`` sends them."""
        state = self.state
        if self.streamer is None or state.batch_size == 1:
            return
        going = [state.lengths[b] for b in range(state.batch_size) if not self._finished_and_padded(b)]
        if not going:
            return
        source = state.tokens.clone()
        for b in range(state.batch_size):
            if self._finished_and_padded(b):
                source[b, state.lengths[b]:] = self.pad_id
        self._put_columns(source, min(going))

    def _put_columns(self, source: torch.LongTensor, upto: int) -> None:
        for col in range(self.streamed, upto):
            self.streamer.put(source[:, col].cpu())
        self.streamed = max(self.streamed, upto)
