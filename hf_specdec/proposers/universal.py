"""Universal assisted decoding: a small causal LM with ANOTHER tokenizer drafts text; its text, re-tokenized with the
target's tokenizer, is verified by the target.

Per row, the proposer keeps the committed text (decoded incrementally from the target's committed ids), the
drafter's own token ids for that text and a KV cache of the drafter over them. A step:

1. **re-align** the drafter: the text the target committed since the last step is decoded and the drafter's ids are
   re-encoded from a lookbehind window of its last tokens (so that a token boundary that moves when more text
   follows re-merges as the drafter's tokenizer would merge it); the drafter's cache is cut to the longest common
   prefix of what it holds (context and the drafts it fed last step) and the new ids;
2. **draft** ``k`` drafter tokens greedily (stopping at a special token of the drafter's);
3. **translate**: the drafts' text is appended to a lookbehind window of the committed text and encoded with the
   target's tokenizer; the tokens after the window are the target drafts when the window re-encodes to exactly the
   committed ids (else the draft would not continue the committed tokens: no draft for the row this step); the
   last one is dropped unless the draft text is complete (it may still merge with the text that follows);
4. the target verifies the chain: greedy output is ``generate(do_sample=False)``'s whatever the drafts (every token
   is the target's), under coupled sampling the greedy walk on perturbed scores (exact for any drafts), under
   rejection sampling the rule for deterministic drafts (``draft_probs=None``, as prompt lookup).

Example:
    >>> out = model.generate(**inputs, assistant_model=drafter, max_new_tokens=64,
    ...                      custom_generate=hf_specdec.decoding_method("universal", tokenizer=tok,
    ...                                                                 assistant_tokenizer=drafter_tok))
"""

from __future__ import annotations

import math
import time
import weakref

import torch
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from ..costs import AcceptanceEstimator, RecentMinimum
from ..registry import SCHEDULE, DrafterSpec, Method, Option
from .base import BackOff, Proposer, RowDraft, rules_of, tree_from_row_drafts
from .draft_model import restricted_head

CONSTANT_TOKENS = 5  # drafter tokens per step of draft_length_schedule="constant" without num_speculative_tokens
MAX_TOKENS = 10  # the most drafter tokens the adaptive length drafts per step
TARGET_LOOKBEHIND = 10  # committed target tokens re-encoded with the draft text (transformers' target_lookbehind)
ASSISTANT_LOOKBEHIND = 10  # drafter tokens re-encoded as the committed text grows (transformers: assistant_lookbehind)
DECODE_LOOKBEHIND = 6  # tokens decoded before a new one, so that its text is the difference of two decodes
BACKLOG = 16  # drafter tokens fed at once past which a proposal's time is not the typical one
HOPELESS_EXPLORE = 128  # steps between proposals of a drafter that would not pay even with every draft accepted


def _leading_specials(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text (a BOS), read off how it encodes a probe."""
    with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    if not plain or plain[0] not in with_specials:
        return []
    return list(with_specials[:with_specials.index(plain[0])])


def _encode(tokenizer, text: str) -> tuple[list[int], list[int] | None]:
    """``text``'s ids without special tokens added, and each token's end in characters (``None`` where the tokenizer
    gives no offsets)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _new_text(tokenizer, before: list[int], new: list[int]) -> str | None:
    """The text ``new`` adds after ``before`` (decoded together, so a leading space or a character split over
    tokens comes out right); ``None`` when the decoder does not extend ``before``'s text."""
    ctx = before[-DECODE_LOOKBEHIND:]
    head, full = _decode(tokenizer, ctx), _decode(tokenizer, ctx + new)
    return full[len(head):] if full.startswith(head) else None


def _compute_params(model, head_rows: int | None = None) -> int:
    """Parameters a one-token forward multiplies by: all but the input embedding's, the output layer's counted (a
    tied one too), with ``head_rows`` rows where the head is restricted."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())
    if inp is not None and getattr(inp, "weight", None) is not None:
        total -= inp.weight.numel()
    if out is not None and getattr(out, "weight", None) is not None:
        tied = inp is not None and out.weight is getattr(inp, "weight", None)
        rows = out.weight.shape[0] if head_rows is None else head_rows
        total += rows * out.weight.shape[1] - (0 if tied else out.weight.numel())
    return max(total, 1)


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for every byte (GPT-2's: printable Latin-1 bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {assistant tokenizer: ids}


def _word_sign(tokenizer) -> str | None:
    """The character a tokenizer's pieces spell a leading space with (``Ġ``, ``▁``), if it has one."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer(" a", add_special_tokens=False)["input_ids"])
    return pieces[0][0] if len(pieces) == 1 and len(pieces[0]) == 2 and pieces[0][1] == "a" else None


def shared_vocabulary(tokenizer, assistant_tokenizer) -> list[int]:
    """The drafter's ids whose text is one target token (its pieces read with their word-start sign as a space and
    byte-fallback pieces ``<0x0A>`` as their byte, looked up as the target spells text: with its own sign, or in
    byte-level BPE's alphabet), and its special tokens: the draft vocabulary of ``draft_vocab="shared"``. Computed
    once per pair of tokenizers."""
    try:
        return _SHARED[tokenizer][assistant_tokenizer]
    except (KeyError, TypeError):
        pass
    target = tokenizer.get_vocab()
    t_sign, a_sign = _word_sign(tokenizer), _word_sign(assistant_tokenizer)
    alphabet = _byte_alphabet()
    keep = set(assistant_tokenizer.all_special_ids)
    for piece, idx in assistant_tokenizer.get_vocab().items():
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                raw = bytes([int(piece[3:5], 16)])
            except ValueError:
                raw = piece.encode("utf-8")
        else:
            raw = (piece.replace(a_sign, " ") if a_sign else piece).encode("utf-8")
        text = raw.decode("utf-8", errors="ignore")
        spelt = (text.replace(" ", t_sign) if t_sign else text, "".join(alphabet[b] for b in raw), piece)
        if any(s in target for s in spelt):
            keep.add(idx)
    ids = sorted(keep)
    try:
        _SHARED.setdefault(tokenizer, weakref.WeakKeyDictionary())[assistant_tokenizer] = ids
    except TypeError:  # pragma: no cover - a tokenizer that takes no weak reference
        pass
    return ids


_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # drafter -> {(tokenizers): (head, vocab)}


def _shared_head(drafter, tokenizer, assistant_tokenizer):
    """The drafter's output layer cut to :func:`shared_vocabulary` (``(None, None)`` where it cannot be cut: logits
    that are not its head's output), made once per drafter and pair of tokenizers (while the drafter's head is the
    same tensor)."""
    key = (id(tokenizer), id(assistant_tokenizer))
    weight = drafter.get_output_embeddings().weight if drafter.get_output_embeddings() is not None else None
    cached = _HEADS.get(drafter, {}).get(key)
    if cached is not None and cached[0] is weight and cached[1] is tokenizer and cached[2] is assistant_tokenizer:
        return cached[3]
    try:
        made = restricted_head(drafter, shared_vocabulary(tokenizer, assistant_tokenizer))
    except ValueError:
        made = (None, None)
    try:
        _HEADS.setdefault(drafter, {})[key] = (weight, tokenizer, assistant_tokenizer, made)
    except TypeError:  # pragma: no cover
        pass
    return made


class _Row:
    """One row's text bookkeeping (host data only)."""

    def __init__(self, d_prefix: list[int]):
        self.t_ids: list[int] = []  # target ids whose text is in ``text``
        self.t_ends: list[int] = []  # their ends in ``text`` (characters)
        self.pending: list[int] = []  # target ids whose text is not complete yet (a character split over tokens)
        self.text = ""
        self.d_ids: list[int] = list(d_prefix)  # the drafter's ids of ``text`` (its BOS first)
        self.d_ends: list[int | None] = [0] * len(d_prefix)  # their ends in ``text``
        self.d_fixed = len(d_prefix)  # the drafter ids that are never re-encoded
        self.fed: list[int] = []  # the drafter ids whose keys/values its cache holds, in order
        self.cache = DynamicCache()
        self.ok = True  # False once the target's decoder did not extend the text (no drafts for the row)
        self.synced_text = -1  # len(text) the drafter ids were last aligned to


class UniversalProposer(Proposer):
    """Drafts with a causal LM of another vocabulary through text (universal assisted decoding).

    Args:
        drafter: a causal LM (any tokenizer).
        tokenizer: the target's tokenizer.
        assistant_tokenizer: the drafter's tokenizer.
        num_tokens: fixed number of drafter tokens per step; ``None`` chooses it per step from the measured costs of
            drafter and target, the acceptance rate and the target tokens a drafter token makes, and backs off when
            drafting does not pay (:class:`~hf_specdec.proposers.base.BackOff`).
        draft_vocab: ``"shared"`` drafts only drafter tokens that are also target tokens (the drafter's output
            layer is cut to those rows: a large-vocabulary drafter costs less); ``"full"``: its whole vocabulary.
    """

    name = "universal"

    def __init__(self, drafter, tokenizer, assistant_tokenizer, num_tokens: int | None = None,
                 max_tokens: int = MAX_TOKENS, draft_vocab: str = "shared"):
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}.")
        if draft_vocab not in ("shared", "full"):
            raise ValueError(f"draft_vocab must be 'shared' or 'full', got {draft_vocab!r}.")
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.assistant_tokenizer = assistant_tokenizer
        self.num_tokens = num_tokens
        self.adaptive = num_tokens is None
        self.max_tokens = num_tokens if num_tokens is not None else max_tokens
        self.max_drafts = 2 * self.max_tokens + 2  # target tokens a step proposes at most
        self.max_nodes = self.max_drafts + 1
        self.t_prefix = _leading_specials(tokenizer)
        self.d_prefix = _leading_specials(assistant_tokenizer)
        self.d_specials = set(assistant_tokenizer.all_special_ids)
        self.head = self.vocab = None
        if draft_vocab == "shared":
            self.head, self.vocab = _shared_head(drafter, tokenizer, assistant_tokenizer)

    def draft_modules(self) -> list:
        return [self.drafter] + ([self.head] if self.head is not None else [])

    def network_parts(self) -> list:
        return []  # each proposal re-tokenizes text on the host between the drafter's forwards

    def prepare(self, model) -> None:
        for what, tok, m in (("tokenizer", self.tokenizer, model), ("assistant_tokenizer", self.assistant_tokenizer,
                                                                    self.drafter)):
            size = m.config.get_text_config().vocab_size
            if len(tok) > size:
                raise ValueError(f"{what} has {len(tok)} tokens but its model's vocabulary has {size} entries: pass "
                                 f"the {'target' if what == 'tokenizer' else 'drafter'}'s own tokenizer as {what}=.")

    # ---- life cycle
    def begin(self, state) -> None:
        self.rules = rules_of(state)
        self.device = self.drafter.device
        config = self.drafter.config
        self.window = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                              "max_position_embeddings", None)
        if self.vocab is not None:
            self.vocab = self.vocab.to(self.device)
        self.rows = [_Row(self.d_prefix) for _ in range(state.batch_size)]
        self.starts = []
        for b, row in enumerate(self.rows):  # the target's own BOS is not text
            ids = state.row_list(b)
            skip = len(self.t_prefix) if self.t_prefix and ids[:len(self.t_prefix)] == self.t_prefix else 0
            self.starts.append(skip)
        self.estimator = AcceptanceEstimator(prior_alpha=0.6, prior_weight=3.0, decay=0.9)
        self.token_seconds = RecentMinimum(window=16 if self.rules.recent_minimum else 1)  # one-token drafter forwards
        self.ratio = 1.0  # target tokens per drafter token of the drafts (running)
        self.backoff = BackOff(rules=self.rules)
        self.quiet = 0  # steps since the last proposal
        self.measured = False  # the proposal that measures the drafter's cost was made
        head_rows = self.vocab.numel() if self.vocab is not None else None
        self.prior_cost = 0.05 + _compute_params(self.drafter, head_rows) / _compute_params(state.model)
        self.pending: list = [None] * state.batch_size

    def propose(self, state):
        if self.adaptive and self.backoff.skipping():
            return None
        start = time.perf_counter()
        k = self._length(state)
        if k <= 0:
            return None
        self.backlog = False  # a row's drafter fed a backlog of text (the prompt): an untypical proposal time
        drafts = []
        for b in range(state.batch_size):
            budget = min(state.max_drafts[b], self.max_drafts)
            tokens = self._row_drafts(state, b, k, budget) if budget > 0 else []
            if tokens and state.eos_token_ids:  # a draft past an end-of-sequence token is never used
                stop = next((i for i, tok in enumerate(tokens) if tok in state.eos_token_ids), None)
                tokens = tokens[:stop]
            if not tokens:
                drafts.append(None)
                continue
            alpha = self.estimator.alpha("all")
            drafts.append(RowDraft(tokens, list(range(len(tokens))), [alpha ** (i + 1) for i in range(len(tokens))]))
        self.pending = drafts
        tree = tree_from_row_drafts(state, drafts)
        if self.adaptive and state.cost_model is not None:
            kept = [d for d in drafts if d is not None]
            worth = None
            if kept:
                widest = max(len(d.tokens) for d in kept)
                rows = max(1, sum(1 for a in state.active if a))
                expected = 1.0 + sum(sum(d.reach) for d in kept) / rows
                worth = (expected, state.cost_model.relative(widest + 1))
            seconds = None if self.backlog else time.perf_counter() - start
            self.backoff.judge(state, seconds, *(worth or (None, None)))
        return tree

    def commit(self, state, tree, result) -> None:
        if self.adaptive and any(d is not None for d in self.pending):
            self._draft_cost(state)  # remembers the drafter's measured cost for the next calls
        for b, n_acc in enumerate(result.num_accepted):
            d = self.pending[b]
            if d is not None and result.paths[b]:
                self.estimator.update("all", len(d.tokens), n_acc)
        self.pending = [None] * state.batch_size

    def end(self, state) -> None:
        self.rows = []  # the drafter caches

    # ---- the draft length
    def _draft_cost(self, state) -> float:
        """One drafter token in one-token target steps: measured in this call, else in an earlier call with this
        drafter, else (and with the rule measured_costs off) from the parameter counts."""
        if not self.rules.measured_costs:
            return self.prior_cost
        step = state.cost_model.step_seconds() if state.cost_model is not None else None
        seconds = self.token_seconds.value()
        if seconds is not None and step:
            state.cost_model.drafter_steps[self.drafter] = seconds / step  # kept by the target's runner
            return seconds / step
        earlier = self._earlier_cost(state)
        return earlier if earlier is not None else self.prior_cost

    def _earlier_cost(self, state) -> float | None:
        """This drafter's cost as an earlier call with this target and batch size measured it (the target runner's
        kept cost model holds it), or None."""
        return state.cost_model.drafter_steps.get(self.drafter) if state.cost_model is not None else None

    def _length(self, state) -> int:
        """Drafter tokens to draft this step (0: none): the count maximising expected target tokens per unit of time,
        ``n`` target drafts needing ``ceil((n + 1) / ratio)`` drafter forwards (the last target token is dropped).

        A drafter that would not pay even if every draft were accepted (one that costs about a target step per token,
        as Gemma-3-270M for SmolLM2-135M on a CPU) is not explored for acceptance every few steps, only now and then
        (:data:`HOPELESS_EXPLORE` steps) to measure its cost again; the first proposal of a drafter whose cost was
        never measured drafts once to measure it."""
        if not self.adaptive:
            return self.max_tokens
        cost = state.cost_model
        if cost is None:
            return self.max_tokens
        self.quiet += 1
        if not self.measured and self.token_seconds.value() is None and self._earlier_cost(state) is None:
            self.measured = True
            return 2  # measure the drafter's one-token cost once
        c_d = self._draft_cost(state)
        best_k, best_rate = self._best(cost, min(max(self.estimator.alpha("all"), 0.0), 0.999), c_d)
        if best_k:
            self.quiet = 0
            return best_k
        # a hopeless drafter is retried rarely (the rule universal_hopeless; off: explored as any other)
        hopeless = self.rules.universal_hopeless and self._best(cost, 0.999, c_d)[0] == 0
        if self.quiet >= (HOPELESS_EXPLORE if hopeless else cost.EXPLORE_EVERY) and (
                (hopeless and self.rules.exploration) or cost.explore_due()):
            self.quiet = 0
            return 2
        return 0

    def _best(self, cost, alpha: float, c_d: float) -> tuple[int, float]:
        best_k, best_rate, total, term = 0, 1.0, 1.0, 1.0
        for n in range(1, self.max_drafts + 1):
            term *= alpha
            total += term
            k = math.ceil((n + 1) / max(self.ratio, 0.25))
            if k > self.max_tokens:
                break
            rate = total / (cost.relative(n + 1) + k * c_d)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    # ---- one row
    def _sync_text(self, state, b: int) -> bool:
        """Decode the target ids committed since the last step into the row's text; False when it cannot draft (a
        character still split over tokens, or a decoder whose text does not extend)."""
        row = self.rows[b]
        if not row.ok:
            return False
        ids = state.row_list(b)[self.starts[b]:]
        new = row.pending + ids[len(row.t_ids) + len(row.pending):]
        row.pending = []
        while new:
            for i in range(len(new)):
                piece = _new_text(self.tokenizer, row.t_ids, new[:i + 1])
                if piece is None:
                    row.ok = False
                    return False
                if piece.endswith("\ufffd") and i < 3:  # a character split over tokens: wait for the rest
                    continue
                for j in range(i + 1):  # ids new[:i] add no text of their own
                    row.t_ids.append(new[j])
                    row.t_ends.append(len(row.text) + (len(piece) if j == i else 0))
                row.text += piece
                new = new[i + 1:]
                break
            else:
                row.pending = new
                return False
        return True

    def _align_drafter(self, row: _Row) -> None:
        """Re-encode the drafter's ids of the text from a lookbehind window; cut its cache to what still holds."""
        if row.synced_text == len(row.text):
            return
        j = max(row.d_fixed, len(row.d_ids) - ASSISTANT_LOOKBEHIND)
        while j > row.d_fixed and row.d_ends[j - 1] is None:
            j -= 1
        anchor = row.d_ends[j - 1] if j > row.d_fixed else 0
        ids, ends = _encode(self.assistant_tokenizer, row.text[anchor:])
        if ends is None:  # no offsets: the whole text, every time
            j, anchor = row.d_fixed, 0
            ids, ends = _encode(self.assistant_tokenizer, row.text)
            ends = [None] * len(ids)
        row.d_ids = row.d_ids[:j] + ids
        row.d_ends = row.d_ends[:j] + [anchor + e if e is not None else None for e in ends]
        row.synced_text = len(row.text)

    def _forward(self, row: _Row, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` after the row's cache; the drafter's choice of next token (its id)."""
        past = len(row.fed)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(past, past + len(tokens), device=self.device)[None]
        kw = dict(input_ids=ids, position_ids=positions, cache=row.cache, use_cache=True, return_dict=True)
        if self.head is None:
            logits = self.drafter(**kw, logits_to_keep=1).logits[:, -1]
            nxt = int(logits.argmax(-1))
        else:
            hidden = self.drafter.base_model(**kw).last_hidden_state[:, -1]
            nxt = int(self.vocab[self.head(hidden).argmax(-1)])
        row.fed.extend(tokens)
        return nxt

    def _draft_drafter(self, row: _Row, k: int) -> tuple[list[int], bool]:
        """``k`` greedy drafter tokens after the row's drafter ids (fewer when one is a special token: then the
        draft text is complete, the second value)."""
        keep = 0
        for a, c in zip(row.fed, row.d_ids):
            if a != c:
                break
            keep += 1
        keep = min(keep, len(row.d_ids) - 1)  # the last id is fed again: its logits are the first draft's
        if keep < len(row.fed):
            cache_ops.crop(row.cache, keep)
            del row.fed[keep:]
        out: list[int] = []
        self.backlog |= len(row.d_ids) - keep > BACKLOG
        nxt = self._forward(row, row.d_ids[keep:])
        while True:
            if nxt in self.d_specials:
                return out, True
            out.append(nxt)
            if len(out) >= k:
                return out, False
            t0 = time.perf_counter()
            nxt = self._forward(row, [nxt])
            self.token_seconds.add(time.perf_counter() - t0)

    def _to_target(self, row: _Row, text: str, complete: bool) -> list[int]:
        """Target ids of ``text`` continuing the committed ids (see the module docstring, step 3)."""
        for lookbehind in (TARGET_LOOKBEHIND, 2):
            n = min(lookbehind, len(row.t_ids))
            if n == 0:
                return []
            start = len(row.t_ids) - n
            anchor = row.t_ends[start - 1] if start > 0 else 0
            window = row.t_ids[start:]
            ids, _ = _encode(self.tokenizer, row.text[anchor:] + text)
            if ids[:n] == window:
                new = ids[n:]
                return new if complete else new[:-1]
        return []

    def _row_drafts(self, state, b: int, k: int, budget: int) -> list[int]:
        row = self.rows[b]
        if not self._sync_text(state, b) or not row.t_ids:
            return []
        with torch.no_grad():
            self._align_drafter(row)
            if not row.d_ids or (self.window is not None and len(row.d_ids) + k > self.window):
                return []  # no drafter ids (no BOS, no text), or past the drafter's positions
            drafted, complete = self._draft_drafter(row, k)
        if not drafted:
            return []
        text = _new_text(self.assistant_tokenizer, row.d_ids[row.d_fixed:], drafted)
        if text is None:
            return []
        if "\ufffd" in text:  # an incomplete character: the text up to it
            text, complete = text[:text.index("\ufffd")], False
        if not text:
            return []
        tokens = self._to_target(row, text, complete)
        made = len(tokens) + (0 if complete else 1)
        self.ratio = 0.8 * self.ratio + 0.2 * max(made / len(drafted), 0.25)
        return tokens[:budget]


def _tokenizer(value, what: str):
    if isinstance(value, str) or hasattr(value, "__fspath__"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(value)
    return value


def _build(target, opts) -> UniversalProposer:
    missing = [k for k in ("tokenizer", "assistant_tokenizer") if opts[k] is None]
    if missing:
        raise ValueError(
            f"The 'universal' method needs both tokenizer=<the target's tokenizer> and assistant_tokenizer=<the "
            f"drafter's tokenizer> (missing: {', '.join(missing)}), as transformers' universal assisted decoding. "
            "A drafter with the target's own tokenizer drafts faster with custom_generate='hf_specdec/assisted'.")
    num = opts["num_speculative_tokens"]
    if num is None and opts["draft_length_schedule"] == "constant":
        num = CONSTANT_TOKENS
    return UniversalProposer(opts["drafter"], _tokenizer(opts["tokenizer"], "tokenizer"),
                             _tokenizer(opts["assistant_tokenizer"], "assistant_tokenizer"), num_tokens=num,
                             draft_vocab=opts["draft_vocab"])


def _load(source, target):
    """A drafter given as a folder or Hub id: any causal LM, on the target's drafter device and dtype."""
    from transformers import AutoModelForCausalLM

    from .._transformers import load_pretrained
    from ..placement import drafter_device
    from ..registry import drafter_source

    model = load_pretrained(AutoModelForCausalLM, drafter_source(source), dtype=target.dtype)
    return model.to(drafter_device(target)).eval()


METHOD = Method(
    name="universal",
    summary="a small causal LM with another tokenizer (universal assisted decoding): its drafts reach the target "
            "through text",
    description="Lossless universal assisted decoding: a small causal LM with ANOTHER tokenizer than the target's "
                "drafts tokens greedily in its own vocabulary (with its own KV cache); their text, appended to a "
                "lookbehind window of the committed text and re-encoded with the target's tokenizer, gives the "
                "target's drafts, which the target verifies in one forward pass. The committed tokens are carried "
                "back into the drafter's tokens through text the same way. Every output token is the target's: "
                "greedy output equals `generate(do_sample=False)`, sampling is exact (coupled or rejection "
                "sampling). The draft length follows the measured costs, and drafting backs off when a drafter "
                "costs more than it saves. Pass the drafter as `assistant_model=` with `tokenizer=` and "
                "`assistant_tokenizer=`.",
    build=_build,
    options=(
        Option("tokenizer", object, None, "the target's tokenizer (required; a tokenizer or a path)"),
        Option("assistant_tokenizer", object, None, "the drafter's tokenizer (required; a tokenizer or a path)"),
        Option("num_speculative_tokens", int, None,
               f"fixed number of drafter tokens per step (default: chosen per step from measured costs, up to "
               f"{MAX_TOKENS}; {CONSTANT_TOKENS} with draft_length_schedule='constant')"),
        SCHEDULE,
        Option("draft_vocab", str, "shared",
               "'shared': the drafter drafts only its tokens that are also target tokens (its output layer cut to "
               "them: cheaper for a large vocabulary); 'full': its whole vocabulary",
               choices=("shared", "full")),
    ),
    drafter=DrafterSpec(
        doc="a small causal LM with its own tokenizer",
        hint="pass assistant_model=<small causal LM> with tokenizer=<the target's tokenizer> and "
             "assistant_tokenizer=<the drafter's tokenizer>",
        load=_load,
        example="assistant_model=drafter, tokenizer=tokenizer, assistant_tokenizer=drafter_tokenizer)",
    ),
)
