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
from .syncs import to_device


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

    def first_stop(self, row: list[int], b: int, start: int, count: int, ids=None) -> int | None:
        """Index ``j`` (1-based) of the first of ``count`` new tokens after ``start`` at which row ``b`` stops.

        ``row`` is the row's committed ids on the host (what max length and EOS tokens read); ``ids()`` gives the
        device ids ``[1, L]`` the other criteria are called with (plain ``generate()`` calls them on those)."""
        for j, tok in enumerate(row[start:start + count], start=1):
            length = start + j
            if length >= self.max_length or tok in self.eos:
                return j
            if self.others:
                prefix = ids()[:, :length]
                if any(bool(crit(prefix, None).view(-1)[0]) for crit in self.others):
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
        """Append ``tokens`` to row ``b`` (see :meth:`commit_rows`)."""
        self.commit_rows({b: tokens}, {b: scores}, {b: logits})

    def commit_rows(self, tokens: dict[int, list[int]], scores=None, logits=None) -> None:
        """Append ``tokens[b]`` (host ids) to each row ``b``, cut at its first stop, stream them (batch size 1).

        The device copy of the ids (``state.tokens``) gets every row's new ids in one write from the host; nothing
        is read back from the device."""
        state = self.state
        rows, cols, values = [], [], []
        streams = []
        for b, new in tokens.items():
            start = state.lengths[b]
            host = state.host_tokens[b]
            host.extend(new)
            count = len(new)
            if not self.ignore_stop[b]:
                j = self.stopper.first_stop(host, b, start, count, ids=lambda b=b, s=start, n=new: self._device_row(
                    b, s, n))
                if j is not None:
                    self.stop_len[b] = start + j
                    if self.stopper.pads_finished_rows:
                        count = j
                        del host[start + count:]
            state.lengths[b] = start + count
            rows += [b] * count
            cols += range(start, start + count)
            values += new[:count]
            if self.want_scores:
                self.scores[b].extend(scores[b][:count])
            if self.want_logits:
                self.logits[b].extend(logits[b][:count])
            if count:
                streams.append(new[:count])
        if values:
            index = to_device([rows, cols, values], state.device)
            state.tokens[index[0], index[1]] = index[2]
        if self.streamer is not None and state.batch_size == 1:
            for new in streams:  # one token per put, shaped as plain generate() puts it (a streamer may count puts)
                for token in new:
                    self.streamer.put(torch.tensor([token]))

    def _device_row(self, b: int, start: int, new: list[int]) -> torch.LongTensor:
        """Row ``b``'s device ids ``[1, start + len(new)]`` with ``new`` written after ``start`` (for stopping
        criteria that take the ids, which plain ``generate()`` calls on the device)."""
        state = self.state
        state.tokens[b, start:start + len(new)] = to_device(new, state.device)
        return state.tokens[b:b + 1, :start + len(new)]

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
        upto = min(going)
        if upto <= self.streamed:
            return
        columns = [[state.host_tokens[b][c] if c < state.lengths[b] else self.pad_id
                    for c in range(self.streamed, upto)] for b in range(state.batch_size)]
        self._put_columns(torch.tensor(columns), upto, offset=self.streamed)

    def _put_columns(self, source: torch.LongTensor, upto: int, offset: int = 0) -> None:
        """Hand columns ``streamed..upto`` to the streamer (``source`` holds column ``c`` at ``c - offset``; host
        tensors, as plain ``generate()`` puts ``next_tokens.cpu()``)."""
        for col in range(self.streamed, upto):
            self.streamer.put(source[:, col - offset].cpu())
        self.streamed = max(self.streamed, upto)
