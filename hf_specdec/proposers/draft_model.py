"""Draft-model speculative decoding: a small causal LM with the target's tokenizer drafts a chain."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from .. import identity
from ..attention import additive
from ..compiled import FEED_BUCKETS_UP_TO, FEED_SIZES, bucket_size, feed_rows
from ..costs import AcceptanceEstimator, RecentMinimum, best_draft_length
from ..default_model import MODEL_ID as SMOLLM2
from ..draft_models import VOCAB_KEY, load_draft_model
from ..placement import materialized
from ..registry import SCHEDULE, DrafterSpec, Method, Option
from ..coupling import apply_warpers
from ..graphs import value_key
from ..tree import DraftTree, additive_mask, build_attention_mask
from ..syncs import to_device
from .base import Carried, Proposer, next_draft, rules_of
from .hybrid import HYBRID

CONSTANT_TOKENS = 5  # the draft length of draft_length_schedule="constant" when num_speculative_tokens is not given
MAX_TOKENS = 12  # the longest draft the adaptive length may choose


def check_same_vocabulary(target, drafter, what: str = "drafter") -> None:
    """A drafter must speak the target's token ids: same (text) vocabulary size, and nothing it carries (special
    token ids, a saved tokenizer) saying they are another tokenizer's (:func:`hf_specdec.identity.check_same_tokenizer`)."""
    t_vocab = target.config.get_text_config().vocab_size
    d_cfg = drafter.config.get_text_config() if hasattr(drafter.config, "get_text_config") else drafter.config
    d_vocab = getattr(d_cfg, "vocab_size", None)
    if d_vocab != t_vocab:
        raise ValueError(
            f"The {what} has a vocabulary of {d_vocab} tokens but the target has {t_vocab}: it was made for another "
            "tokenizer. Use a drafter trained with the target's tokenizer (e.g. `hf-specdec train draft`), or "
            "transformers' universal assisted decoding (assistant_model= with tokenizer= and assistant_tokenizer=, "
            "without custom_generate)."
        )
    identity.check_same_tokenizer(target, drafter, what)


def restricted_head(drafter, vocab) -> tuple[torch.nn.Linear, torch.Tensor]:
    """The drafter's LM head over the target token ids ``vocab`` only, and those ids (sorted, unique).

    A draft vocabulary of the most frequent tokens (as EAGLE-3's, or FR-Spec's for draft models) cuts the drafter's
    cost where its head over the whole vocabulary is most of it; drafts can only be tokens of ``vocab``, and the
    target still decides every token, so the output is unchanged (greedy and sampled alike)."""
    cfg = drafter.config.get_text_config()
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) is not None:
        raise ValueError("draft_vocab needs a drafter whose logits are its LM head's output; this one scales or "
                         "soft-caps them. Pass draft_vocab='full'.")
    head = drafter.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"draft_vocab needs a drafter with a linear LM head, got {type(head).__name__}.")
    vocab = torch.as_tensor(vocab, dtype=torch.long).flatten().unique()
    if vocab.numel() == 0 or int(vocab[0]) < 0 or int(vocab[-1]) >= head.out_features:
        raise ValueError(f"draft_vocab must be non-empty token ids in [0, {head.out_features}) (the drafter's "
                         f"vocabulary), got {vocab.tolist()[:3]}...{vocab.tolist()[-3:]}.")
    weight, bias = materialized(head, "weight"), materialized(head, "bias")  # a quantized head: its values
    sub = torch.nn.Linear(head.in_features, vocab.numel(), bias=bias is not None, device="meta",
                          dtype=weight.dtype).to_empty(device=weight.device)  # no init: rows copied in
    with torch.no_grad():
        sub.weight.copy_(weight[vocab.to(weight.device)])
        if bias is not None:
            sub.bias.copy_(bias[vocab.to(weight.device)])
    return sub.requires_grad_(False), vocab


class DraftModelProposer(Proposer):
    """Drafts a chain with a small causal LM; its KV cache is kept up to the last accepted token.

    The drafter's cache mirrors the target cache's column layout (same holes in a batch), so after a step it keeps
    every column the target kept that it has already computed, and only the tokens it has not seen (the root, and
    the last accepted draft when a whole chain was accepted) are fed at the next step.

    Args:
        drafter: a causal LM with the target's vocabulary.
        num_tokens: fixed draft length; ``None`` picks the length per step from the measured costs of drafter and
            target and the running acceptance rate (up to ``max_tokens``).
        draft_vocab: target token ids the drafter may draft (its head scores only those, see
            :func:`restricted_head`); ``None`` takes the draft vocabulary saved with the drafter
            (``save_draft_model(..., draft_vocab=)``) if it has one, ``"full"`` the whole vocabulary.
        confidence: stop a row's chain after a draft whose probability under the drafter is below this
            (transformers' ``assistant_confidence_threshold``); ``None``: the length rule alone.
    """

    name = "assisted"

    def __init__(self, drafter, num_tokens: int | None = None, max_tokens: int = MAX_TOKENS, draft_vocab=None,
                 confidence: float | None = None):
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}.")
        if confidence is not None and not 0.0 <= confidence <= 1.0:
            raise ValueError(f"confidence must be a probability in [0, 1], got {confidence}.")
        self.confidence = confidence
        self.drafter = drafter
        self.num_tokens = num_tokens
        self.max_tokens = num_tokens if num_tokens is not None else max_tokens
        self.max_nodes = self.max_tokens + 1
        if draft_vocab is None:
            draft_vocab = getattr(drafter, VOCAB_KEY, None)
        if isinstance(draft_vocab, str):
            if draft_vocab != "full":
                raise ValueError(f"draft_vocab must be token ids, None or 'full', got {draft_vocab!r}.")
            draft_vocab = None
        self.head, self.vocab = restricted_head(drafter, draft_vocab) if draft_vocab is not None else (None, None)

    def draft_modules(self) -> list:
        return [self.drafter] + ([self.head] if self.head is not None else [])

    def prepare(self, model) -> None:
        check_same_vocabulary(model, self.drafter)

    def begin(self, state) -> None:
        self.rules = rules_of(state)
        self.cache = DynamicCache()
        self.synced = 0  # target layout columns already in the drafter cache
        if state.cached and isinstance(state.carried, Carried):  # a continued conversation: this drafter's cache
            self.cache, self.synced = state.carried.cache_for(self.drafter)
        self.fed = 0  # columns the drafter added beyond `synced` in the last propose
        self.tree = None  # the tree of the last propose
        self.estimator = AcceptanceEstimator(prior_alpha=0.6, prior_weight=3.0, decay=0.9)
        # single-token drafter forwards (robust to a busy machine; the rule recent_minimum off: the latest)
        self.token_seconds = RecentMinimum(window=16 if self.rules.recent_minimum else 1)
        t_params = sum(p.numel() for p in state.model.parameters())
        d_params = sum(p.numel() for p in self.drafter.parameters())
        if self.head is not None:
            d_params += self.head.weight.numel() - self.drafter.get_output_embeddings().weight.numel()
            self.vocab = self.vocab.to(self.drafter.device)
        self.prior_cost = 0.05 + d_params / max(t_params, 1)
        self.dtype = self.drafter.dtype
        self.device = self.drafter.device

    def _draft_cost(self, state) -> float:
        step = state.cost_model.step_seconds()
        seconds = self.token_seconds.value()
        if seconds is None or not step or not self.rules.measured_costs:
            return self.prior_cost
        return seconds / step

    def _forward(self, state, tokens, positions, past_valid, past_pos, new_attends):
        mask = build_attention_mask(self.drafter.config, past_valid.to(self.device), past_pos.to(self.device),
                                    positions.to(self.device), new_attends.to(self.device), self.dtype)
        return self._logits(tokens.to(self.device), positions.to(self.device), mask, 1).to(state.device)

    def _logits(self, tokens, positions, mask, keep):
        """``[B, V]`` float32: the drafter's logits over its cache and ``tokens, positions [B, n]`` (``mask``: its
        attention mask) at the row ``keep`` picks (transformers' ``logits_to_keep``: ``1`` the last row, a ``[1]``
        tensor that row), in the target's vocabulary (a restricted head's other tokens at -inf: never drafted)."""
        kw = dict(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True,
                  return_dict=True)
        if self.head is None:
            return self.drafter(**kw, logits_to_keep=keep).logits[:, -1].float()
        hidden = self.drafter.base_model(**kw).last_hidden_state
        sub = self.head(hidden[:, -1] if isinstance(keep, int) else hidden[:, keep][:, -1]).float()
        logits = sub.new_full((sub.shape[0], self.drafter.get_output_embeddings().out_features), float("-inf"))
        logits[:, self.vocab] = sub
        return logits

    # ---- drafting at fixed shapes (compile=True: hf_specdec.graphs)

    def draft_at_fixed_shapes(self, runner) -> bool:
        """A draft model with one additive attention mask (no sliding-window layers) and no ``confidence`` rule (a
        host read per draft) drafts at fixed shapes under ``compile=True``: its cache a
        :class:`~hf_specdec.cache.FixedDraftCache` of the target's static width (its columns mirror the target's, the
        root and the chain's drafts at the columns the target verifies them in) plus a scratch column; the new context
        and the root fed at a bucket of rows (:meth:`_feed_region`), the whole chain one region per bucket of lengths
        (:meth:`_chain_region`, :meth:`_chain_length`). Drafts come from the drafter's logits through the call's
        warpers (temperature, top-k, top-p): other logits processors, which read each row's ids, are the target's rule
        alone there (exact either way)."""
        ok = runner is not None and self.confidence is None and additive_mask(self.drafter.config)
        self._fixed = runner if ok else None
        return ok

    def graph_key(self):
        """What a CUDA graph of this proposer's regions is recorded over (:mod:`hf_specdec.graphs`): its cache, the
        drafter, its restricted head and the call's buffered layout (whose buffers its feed reads)."""
        return self.cache, self.drafter, self.head, self._layout

    def _propose_fixed(self, state, k: int):
        """:meth:`propose`'s drafting at fixed shapes: ``(drafts [B, k], probs [B, k, V] or None)``."""
        if not isinstance(self.cache, cache_ops.FixedDraftCache):
            cfg = self.drafter.config.get_text_config()
            self._take_fixed_cache(state, 0, *cache_ops.kv_shape(cfg), cfg.num_hidden_layers)
        layout = state.layout
        n = layout.length + 1 - self.synced  # the new context columns and the root
        rows = feed_rows(n)
        roots, root_positions = self._on(state.roots()), self._on(state.root_positions)
        if self._hold_layout(state) and n <= FEED_BUCKETS_UP_TO:  # the inputs made inside the region, from buffers
            feed = self._fixed.fixed(type(self)._buffered_feed_region)
            feed.warm(self, "feeds", FEED_SIZES, lambda size: feed(
                self, roots, root_positions, to_device([self.synced, 0], roots.device), size))  # the scratch column
            logits, seen, root_column = feed(self, roots, root_positions, to_device([self.synced, n], roots.device),
                                             rows)
        else:
            inputs = self._fixed.fused(_fixed_feed_inputs)(
                self._on(layout.valid), self._on(layout.tokens), self._on(layout.positions), roots, root_positions,
                self.synced, rows, self.cache.width)
            if n > FEED_BUCKETS_UP_TO:
                logits = self._feed_region(*inputs)
            else:
                feed = self._fixed.fixed(type(self)._feed_region)
                feed.warm(self, "feeds", FEED_SIZES,
                          lambda size: feed(self, *self._scratch_feed(inputs, size)))
                logits = feed(self, *inputs)
            seen, root_column = inputs[3], inputs[2][n - 1:n]
        chain = self._fixed.fixed(type(self)._chain_region)
        # the call's warpers shape sampled and coupled drafts (greedy: none; other processors: the target's rule)
        warpers = tuple(state.processors) if state.do_sample or state.coupling is not None else ()

        def draft(length):
            noise = None if state.coupling is None else state.noise(length).to(self.device)
            return chain(self, logits, seen, root_column, root_positions, noise, warpers, state.do_sample, length)

        chain.warm(self, (state.coupling is None, state.do_sample, value_key(warpers)),
                   sorted({self._chain_length(m) for m in range(1, self.max_tokens + 1)}), draft)
        t0 = time.perf_counter()
        length = self._chain_length(k)
        drafts, probs = draft(length)
        if length > 1:
            self.token_seconds.add((time.perf_counter() - t0) / (length - 1))
        return drafts[:, :k], probs[:, :k] if probs is not None else None

    def _chain_length(self, k: int) -> int:
        """The chain drafted for ``k`` drafts at fixed shapes: ``k`` rounded up to a bucket (1, 2, 4, 8, 16, at most
        ``max_tokens``), the drafts past ``k`` dropped: a few graphs for every length the adaptive rule may choose."""
        return min(bucket_size(k), self.max_tokens)

    def _scratch_feed(self, inputs, rows: int):
        """Feed inputs of ``rows`` rows shaped as ``inputs`` that only write into the scratch column and see nothing
        else (to compile a bucket size before its first use)."""
        tokens, positions, columns, seen, _ = inputs
        return (tokens.new_zeros(tokens.shape[0], rows), positions.new_zeros(positions.shape[0], rows),
                columns.new_full((rows,), self.cache.width - 1), torch.zeros_like(seen), columns.new_zeros(1))

    def _buffered_feed_region(self, roots, root_positions, scalars, rows: int):
        """:meth:`_feed_region` over the call's :class:`~hf_specdec.cache.BufferedLayout` (reached through the proposer,
        whose :meth:`graph_key` holds it), its inputs made inside the region as :func:`_fixed_feed_inputs` makes them:
        ``n = scalars[1]`` rows, the layout's columns from ``scalars[0]`` then the root (``roots, root_positions [B]``),
        padded to ``rows`` (``n = 0``: every row the scratch column's, what warms a size up). Returns ``(logits [B, V],
        seen [B, width], the root's column [1])``."""
        valid, tokens, positions = self._layout.buffers
        width, (start, n) = self.cache.width, scalars
        j, at, inside = cache_ops.window(scalars, rows, valid.shape[1])
        root = start + n - 1  # the root's column: the layout's length
        context, is_root = j < n - 1, j == n - 1
        tokens = torch.where(context, tokens[:, at], torch.where(is_root, roots[:, None], 0))
        positions = torch.where(context, positions[:, at], torch.where(is_root, root_positions[:, None], 0))
        columns = torch.where(inside, start + j, width - 1)
        cols = torch.arange(width, device=valid.device)
        seen = (F.pad(valid, (0, width - valid.shape[1])) & (cols < root)) | (cols == root)
        logits = self._feed_region(tokens, positions, columns, seen, (n - 1).clamp(min=0).reshape(1))
        return logits, seen, root.reshape(1)

    def _feed_region(self, tokens, positions, columns, seen, root):
        """One drafter forward over rows ``tokens, positions [B, n]`` written at the cache ``columns [n]``, each row
        seeing the columns of ``seen [B, width]`` up to its own, and itself; the logits ``[B, V]`` of row ``root
        [1]`` (the root's)."""
        sees = cache_ops.feed_sees(columns, seen)  # [B, n, width]
        self.cache.at = columns
        return self._logits(tokens, positions, additive(sees, self.dtype)[:, None], root)

    def _chain_region(self, logits, seen, root_column, root_positions, noise, warpers, sample: bool, k: int):
        """The chain of ``k`` from the root's ``logits [B, V]``: each draft drawn (``sample``) or the argmax of the
        logits through ``warpers`` (plus coupled sampling's ``noise [B, k, V]``, drafted greedily), fed at column
        ``root_column [1] + i`` and position ``root_positions [B] + i`` over the columns ``seen [B, width]`` and the
        chain's. Returns ``(drafts [B, k], probs [B, k, V] or None)``, the distributions drafts were drawn from."""
        drafts, probs = [], []
        cols = torch.arange(seen.shape[1], device=seen.device)
        for i in range(k):
            scores = apply_warpers(warpers, logits)
            if noise is not None:
                scores = scores + noise[:, i]
            if sample and noise is None:
                p = torch.softmax(scores, dim=-1)
                token = torch.multinomial(p, 1)[:, 0]
                probs.append(p)
            else:
                token = scores.argmax(-1)
            drafts.append(token)
            if i == k - 1:
                break
            column = (root_column + 1 + i).clamp(max=seen.shape[1] - 1)  # the scratch column past the cache's end
            seen = seen | (cols == column)
            self.cache.at = column
            logits = self._logits(token[:, None], (root_positions + 1 + i)[:, None],
                                  additive(seen, self.dtype)[:, None, None], 1)
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1) if probs else None

    def propose(self, state):
        bsz = state.batch_size
        budgets, top = state.budgets(self.max_tokens), state.deepest(self.max_tokens)
        if self.num_tokens is None:
            want = best_draft_length(self.estimator.alpha("all"), top, state.cost_model,
                                     draft_cost=self._draft_cost(state))
        else:
            want = top
        k = min(want, top)
        if k <= 0:
            self.fed = 0
            return None
        roots = state.roots()
        if self._fixed is not None:
            drafts_t, draft_probs = self._propose_fixed(state, k)
            drafts_t, self.fed = drafts_t.to(state.device), k
            self.fed_tokens = torch.cat([roots[:, None], drafts_t[:, :k - 1]], dim=1)
            self.counts = [min(b, k) for b in budgets]
            self.tree = DraftTree.chain(roots, drafts_t, self.counts,
                                        draft_probs.to(state.device) if draft_probs is not None else None)
            return self.tree
        layout = state.layout
        past = self.synced
        # feed the committed columns the drafter has not seen (same holes as the target), then the root
        tokens = torch.cat([layout.tokens[:, past:], roots[:, None]], dim=1)
        positions = torch.cat([layout.positions[:, past:], state.root_positions[:, None]], dim=1)
        new_valid = torch.cat([layout.valid[:, past:], torch.ones(bsz, 1, dtype=torch.bool, device=state.device)], 1)
        n_new = tokens.shape[1]
        causal = torch.ones(n_new, n_new, dtype=torch.bool, device=state.device).tril()
        attends = causal[None] & new_valid[:, None, :]
        process = state.draft_process_fn()
        prefixes = [state.prefix(b) for b in range(bsz)]
        ones = torch.ones(bsz, k, dtype=torch.bool, device=state.device)
        drafts, probs = [], []
        lengths = torch.full((bsz,), k, dtype=torch.long, device=state.device)  # chains cut by `confidence`
        stopped = torch.zeros(bsz, dtype=torch.bool, device=state.device)
        logits = self._forward(state, tokens, positions, layout.valid[:, :past], layout.positions[:, :past], attends)
        for i in range(k):
            if i > 0:
                # the drafter cache now holds the committed columns, the root and drafts[:i-1]
                past_pos = torch.cat([layout.positions,
                                      state.root_positions[:, None] + torch.arange(i, device=state.device)], 1)
                t1 = time.perf_counter()
                logits = self._forward(state, drafts[-1][:, None], state.root_positions[:, None] + i,
                                       torch.cat([layout.valid, ones[:, :i]], 1), past_pos, ones[:, :1, None])
                self.token_seconds.add(time.perf_counter() - t1)
            nxt, p = next_draft(state, logits, prefixes, drafts, process, want_probs=self.confidence is not None)
            if state.do_sample:
                probs.append(p)
            drafts.append(nxt)
            if self.confidence is not None:  # a chain ends after its first unlikely draft (one read per draft)
                unsure = ~stopped & (p.gather(1, nxt[:, None])[:, 0] < self.confidence)
                lengths = torch.where(unsure, i + 1, lengths)
                stopped |= unsure
                if bool(stopped.all()):
                    break
        k = len(drafts)
        lengths = lengths.tolist() if self.confidence is not None else [k] * bsz
        self.fed = k  # the root and drafts[:k-1] were added beyond the committed columns
        drafts_t = torch.stack(drafts, dim=1)
        self.fed_tokens = torch.cat([roots[:, None], drafts_t[:, :k - 1]], dim=1)
        self.counts = [min(b, k, n) for b, n in zip(budgets, lengths)]
        draft_probs = torch.stack(probs, dim=1) if probs else None
        self.tree = DraftTree.chain(roots, drafts_t, self.counts, draft_probs)
        return self.tree

    def commit(self, state, tree, result) -> None:
        fed, self.fed = self.fed, 0
        if fed == 0:
            return
        layout = state.layout
        past = layout.length - max(len(p) for p in result.paths)  # columns before this step
        for b, n_acc in enumerate(result.num_accepted):
            if result.paths[b] and self.counts[b] > 0:  # rows that verified this drafter's drafts
                self.estimator.update("all", self.counts[b], n_acc)
        keep = min(fed, layout.length - past)
        # the drafter's columns hold what was committed (or a hole) only up to the first other token; when the
        # verified tree is this drafter's own, every committed column is one it fed (nothing to read back)
        if keep and tree is not self.tree:
            cols = slice(past, past + keep)
            same = ~layout.valid[:, cols] | (layout.tokens[:, cols] == self.fed_tokens[:, :keep].to(layout.tokens.device))
            differs = (~same.all(0)).nonzero()
            if differs.numel():
                keep = int(differs[0])
        self.synced = past + keep
        self.tree = None
        if not isinstance(self.cache, cache_ops.FixedDraftCache):  # a fixed cache's later columns are overwritten
            cache_ops.crop(self.cache, self.synced)

    def on_compact(self, state, index) -> None:
        self.cache = DynamicCache()
        self.synced = 0
        self.fed = 0

    def hand_back(self, state, index) -> Carried:
        """The drafter cache over the leading columns of the handed-back cache it holds (none from a fixed cache: the
        runner keeps that for later calls)."""
        if isinstance(self.cache, cache_ops.FixedDraftCache):
            return None
        return Carried.of(self.drafter, self.cache, cache_ops.kept_mirror(self.cache, self.synced, index))


def _fixed_feed_inputs(valid, tokens, positions, roots, root_positions, start: int, rows: int, width: int):
    """The drafter rows of the layout's columns ``start..`` (``valid, tokens, positions [B, T]``) and of the root
    (``roots, root_positions [B]``, at column ``T``) as :meth:`DraftModelProposer._feed_region` takes them, padded to
    ``rows`` rows (padding rows write into the cache's last column, the scratch one): ``(tokens, positions, columns,
    seen, root)``, ``seen [B, width]`` the columns holding context and the root, ``root [1]`` the root's row."""
    length = valid.shape[1]
    n = length - start + 1
    pad = rows - n
    columns = torch.cat([torch.arange(start, length + 1, device=valid.device),
                         torch.full((pad,), width - 1, dtype=torch.long, device=valid.device)])
    seen = torch.cat([valid, valid.new_ones(valid.shape[0], 1), valid.new_zeros(valid.shape[0], width - length - 1)], 1)
    return (F.pad(torch.cat([tokens[:, start:], roots[:, None]], dim=1), (0, pad)),
            F.pad(torch.cat([positions[:, start:], root_positions[:, None]], dim=1), (0, pad)), columns, seen,
            torch.full((1,), n - 1, dtype=torch.long, device=valid.device))


def _build(target, opts) -> DraftModelProposer:
    num = opts["num_speculative_tokens"]
    if num is None and opts["draft_length_schedule"] == "constant":
        num = CONSTANT_TOKENS
    return DraftModelProposer(opts["drafter"], num_tokens=num, draft_vocab=opts["draft_vocab"],
                              confidence=opts["confidence"])


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_draft(target, tokenizer, out, layers=args.layers or 4, draft_vocab=args.draft_vocab,
                                **common)


METHOD = Method(
    name="assisted",
    summary="a small causal LM with the target's tokenizer (a distilled student: `hf-specdec train draft`); "
            "`draft_vocab=` restricts its head to frequent tokens (lossless)",
    description="Lossless draft-model speculative decoding (Leviathan et al., Chen et al.): a small causal LM with "
                "the target's tokenizer drafts a chain of tokens, the target verifies them in one forward pass. "
                "Sampling uses exact speculative sampling (drafts sampled from the drafter's distribution, accepted "
                "with probability min(1, q/p), residual max(0, q - p) on rejection). The drafter's KV cache is kept "
                "up to the last accepted token. A drafter with another vocabulary is refused with an error (use "
                "transformers' universal assisted decoding for that).",
    build=_build,
    options=(
        Option("num_speculative_tokens", int, None,
               f"fixed draft length (default: chosen per step from measured costs, up to {MAX_TOKENS}; {CONSTANT_TOKENS} with "
               "draft_length_schedule='constant')"),
        SCHEDULE,
        HYBRID,
        Option("draft_vocab", object, None,
               "target token ids the drafter may draft (default: the draft vocabulary saved with it; 'full': all)"),
        Option("confidence", float, None, "stop a chain after a draft whose probability under the drafter is below "
               "this (transformers' assistant_confidence_threshold; default: the length rule alone)"),
    ),
    drafter=DrafterSpec(
        doc="a draft model",
        hint="pass assistant_model=<small causal LM with the target's tokenizer> (or drafter=<model or path>)",
        load=load_draft_model,
        check=lambda target, drafter: check_same_vocabulary(target, drafter),
        shipped={SMOLLM2: "smollm2-135m-instruct-student"},
        train=_train,
        train_name="draft",
        flag="drafter",
        example="assistant_model=draft_model)          # or drafter=\"path/or/repo-id\"",
    ),
)
