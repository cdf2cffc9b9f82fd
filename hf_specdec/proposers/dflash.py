"""DFlash proposer: one drafter forward fills a block of mask tokens after the last committed token.

The drafter's cache holds the keys/values of the *context* only: the projected target features of committed tokens
(one per target cache column, so its layout mirrors the target cache, holes included). Each step feeds the features
of the columns committed since the last step as new context together with the block ``[root, mask, ..., mask]`` at
positions ``root_position + 0..B-1``; the block's keys/values are dropped afterwards. Draft ``i`` is the prediction at
block position ``i`` (argmax, or a sample from the drafter's distribution when the call samples). The number of drafts
kept is chosen from the drafter's confidence and the measured verification costs (``adaptive``). When the adaptive rule
keeps nothing, or the best draft does not pay for the verification plus the drafter's own time, the drafter is not run
again for 1, 2, 4, ... (at most 16) steps — a drafter that cannot pay for itself then costs almost nothing — and the
skipped context is fed at the next probe.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .. import cache as cache_ops
from ..conversions.common import load_converted_or_published
from ..conversions.dflash import LAYOUTS, NATIVE_DRAFTERS, as_dflash_drafter, convert_dflash, export_dflash
from ..costs import batch_cap, best_count
from ..default_model import MODEL_ID as SMOLLM2
from ..modeling.dflash import DFlashDrafter
from ..registry import SCHEDULE, DrafterSpec, Method, Option, Shorthand
from ..tree import DraftTree
from .features import FeatureDrafterProposer
from .hybrid import HYBRID


class DFlashProposer(FeatureDrafterProposer):
    name = "dflash"
    HEAD_FIRST = 4  # block positions scored first (adaptive schedule)
    HEAD_MORE = 0.1  # ... and the rest only when a row's draft 4 is at least this likely to be accepted

    def __init__(self, drafter, block_size: int | None = None, adaptive: bool = True):
        size = block_size or drafter.config.block_size
        if not 2 <= size <= drafter.config.block_size:
            raise ValueError(f"block_size must be in 2..{drafter.config.block_size} for this drafter, got {size}.")
        super().__init__(drafter, adaptive)
        self.block_size = size
        self.max_nodes = size

    def hidden_state_ids(self, layer_ids):
        return [i + 1 for i in layer_ids]  # the drafter names layers; their outputs are hidden_states[i + 1]

    def _masks(self, state, block_pos):
        """One additive mask per drafter layer over [context columns ‖ block]."""
        cfg = self.drafter.config
        layout = state.layout
        bsz, n = block_pos.shape
        ctx_ok = layout.valid.to(self.device)[:, None, :].expand(bsz, n, layout.length)
        key_pos = torch.cat([layout.positions, block_pos], dim=1).to(self.device)
        q_pos = block_pos.to(self.device)
        minval = torch.finfo(self.dtype).min
        masks = []
        for i in range(cfg.num_hidden_layers):
            block_ok = torch.ones(n, n, dtype=torch.bool, device=self.device)
            if cfg.layer_is_causal(i):
                block_ok = block_ok.tril()
            allowed = torch.cat([ctx_ok, block_ok.expand(bsz, n, n)], dim=2)
            if cfg.layer_types[i] == "sliding_attention":
                allowed &= (q_pos[:, :, None] - key_pos[:, None, :]).abs() < cfg.sliding_window
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, minval)
            masks.append(mask[:, None])
        return masks

    def _keep(self, state, probs: torch.Tensor, budget: int) -> tuple[int, tuple[float, float] | None]:
        """Drafts worth verifying: ``k`` maximising expected committed tokens per unit of forward cost, where draft
        ``i`` is accepted with probability ~ the product of the drafter's top probabilities up to ``i``; with the
        expected tokens and the verification cost of that ``k`` (``None`` when no ``k`` beats a plain step)."""
        if not self.adaptive:
            return budget, None
        expected, total = [], 1.0
        for reach in _reaches(probs[:budget], min(self.calibration, 1.5)):  # host floats (the proposal's one read)
            total += reach
            expected.append(total)
        k = best_count(expected, state.cost_model)
        verify = state.cost_model.relative(k + 1)
        worth = (expected[k - 1], verify) if k and expected[k - 1] > verify else None
        return k, worth

    def _block_logits(self, state, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the block positions a draft may use. The target's LM head over all 15 positions costs about a
        third of a decoding step on a CPU; the adaptive rule rarely keeps more than a few drafts of a weak drafter, so
        the first :attr:`HEAD_FIRST` positions are scored first and the rest only while some row's drafts are still
        likely enough (calibrated cumulative confidence >= :attr:`HEAD_MORE`) to be kept."""
        need = min(hidden.shape[1], max(state.max_drafts))
        first = min(need, self.HEAD_FIRST) if self.adaptive else need
        logits = self.drafter.draft_logits(hidden[:, :first]).float().to(state.device)
        if first < need:
            confidence = torch.softmax(logits, dim=-1).max(-1).values * min(self.calibration, 1.5)
            if float(torch.cumprod(confidence.clamp(max=1.0), 1)[:, -1].max()) >= self.HEAD_MORE:
                rest = self.drafter.draft_logits(hidden[:, first:need]).float().to(state.device)
                logits = torch.cat([logits, rest], dim=1)
        return logits

    def propose(self, state):
        if self.backoff.skipping():
            return None
        t0 = time.perf_counter()
        layout = state.layout
        bsz, size = state.batch_size, self.block_size
        start, end = self.synced, layout.length
        context = self.drafter.project(self.features[:, start:end])
        block = torch.full((bsz, size), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = state.roots().to(self.device)
        block_pos = state.root_positions[:, None] + torch.arange(size, device=state.device)
        hidden = self.drafter(self.drafter.embed(block), context, block_pos.to(self.device),
                              layout.positions[:, start:end].to(self.device), self._masks(state, block_pos), self.cache)
        self.synced = end
        cache_ops.crop(self.cache, end)  # keep the context, drop the block
        logits = self._block_logits(state, hidden[:, 1:])  # [B, width <= size-1, V]
        width = logits.shape[1]
        logits = state.perturb(logits, range(width))  # coupled sampling: each depth under its position's noise
        process = state.draft_process_fn()
        drafts, probs_all, kept, predicted, best, confidences = [], [], [], [], None, []
        greedy = process is None and not state.do_sample
        if greedy:  # on the device; with the adaptive rule, the confidences come back in one read
            drafts = logits.argmax(-1)
            host_conf = torch.softmax(logits, -1).max(-1).values.tolist() if self.adaptive else None
        for b in range(bsz):
            budget = min(state.max_drafts[b], width)
            row_logits = logits[b]
            if greedy:
                confidence = host_conf[b] if host_conf is not None else []
                k, worth = self._keep(state, confidence, budget) if budget > 0 else (0, None)
                if worth is not None and (best is None or worth[0] / worth[1] > best[0] / best[1]):
                    best = worth
                predicted.append(_product_sum(confidence[:k]))
                kept.append(k)
                confidences.append(confidence[:k])
                continue
            if process is not None or state.do_sample:
                rows, prefix = [], state.prefix(b)
                toks = []
                for i in range(width):
                    ids = torch.cat([prefix, prefix.new_tensor(toks)])[None] if toks else prefix[None]
                    scores = process(b, ids, row_logits[i:i + 1])[0] if process is not None else row_logits[i]
                    p = torch.softmax(scores, dim=-1)
                    tok = int(torch.multinomial(p, 1)) if state.do_sample else int(scores.argmax())
                    rows.append(p)
                    toks.append(tok)
                row_probs = torch.stack(rows)
                row_tokens = torch.tensor(toks, device=state.device)
            else:
                row_probs = None
                row_tokens = row_logits.argmax(-1)
            confidence = (row_probs if row_probs is not None else torch.softmax(row_logits, -1)).max(-1).values
            confidence = confidence.tolist()
            k, worth = self._keep(state, confidence, budget) if budget > 0 else (0, None)
            if worth is not None and (best is None or worth[0] / worth[1] > best[0] / best[1]):
                best = worth
            predicted.append(_product_sum(confidence[:k]))
            drafts.append(row_tokens)
            probs_all.append(row_probs)
            kept.append(k)
            confidences.append(confidence[:k])
        if self.adaptive and bsz > 1 and state.cost_model is not None:  # the rows share one forward
            cal = min(self.calibration, 1.5)
            reaches = [_reaches(c, cal) for c in confidences]
            cap = batch_cap(reaches, state.cost_model, state.active)
            kept = [min(k, cap) for k in kept]
            predicted = [_product_sum(c[:k]) for c, k in zip(confidences, kept)]
            # what the batch expects of this proposal (the back-off's judgement): the active rows' mean
            active = [b for b in range(bsz) if state.active[b]] or list(range(bsz))
            expected = 1.0 + sum(sum(reaches[b][:kept[b]]) for b in active) / len(active)
            verify = state.cost_model.relative(max(kept) + 1)
            best = (expected, verify) if any(kept) else None
        seconds = time.perf_counter() - t0 if end - start <= self.BACKLOG else None  # a backlog: not typical
        if not any(kept):
            self._predicted = None
            if self.adaptive and all(state.max_drafts[b] > 0 for b in range(bsz)):
                self.backoff.judge(state, seconds, None, None)
                self.backoff.update(paid=False)
            return None
        if self.adaptive:
            self.backoff.judge(state, seconds, *(best or (None, None)))
        self._predicted = predicted
        tokens = drafts if greedy else torch.stack(drafts)
        draft_probs = torch.stack(probs_all) if state.do_sample else None
        return DraftTree.chain(state.roots(), tokens, kept, draft_probs)


def _product_sum(confidence: list[float]) -> float:
    """Sum of the running products of ``confidence`` (host floats): the expected accepted drafts."""
    total, run = 0.0, 1.0
    for c in confidence:
        run *= c
        total += run
    return total


def _reaches(confidence: list[float], cal: float) -> list[float]:
    """Calibrated running products, each clamped to 1 (the batch rule's estimate per draft)."""
    out, run = [], 1.0
    for c in confidence:
        run *= min(c, 1.0) * cal
        out.append(min(run, 1.0))
    return out


def _load(source, target):
    """A folder / Hub id for ``target``: one hf_specdec converted, or a published layout converted in memory for this
    target (a Muse Glimmer assistant's config has no vocabulary size: it is the target's)."""
    return load_converted_or_published(source, target, DFlashDrafter,
                                       lambda src, **kw: convert_dflash(src, target=target, **kw))


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_dflash(target, tokenizer, out, layers=args.layers or 3, block_size=args.block_size,
                                 num_anchors=args.num_anchors, **common)


METHOD = Method(
    name="dflash",
    summary="a block-diffusion drafter filling a block of mask tokens in one forward, conditioned on target "
            "features",
    description="Lossless DFlash speculative decoding (block diffusion drafter conditioned on target hidden "
                "states): one drafter forward fills a block of mask tokens after the last committed token, using "
                "the target's embeddings and LM head and fused target features injected as keys/values in every "
                "drafter layer; the target verifies the block in one forward pass. Sampling is exact (drafts "
                "sampled from the drafter's distribution, speculative rejection sampling). z-lab layouts (old "
                "5-layer/5-tap, new 6-layer/8-tap revisions) and transformers' native Muse-Glimmer assistant layout "
                "are converted in memory; `hf-specdec convert dflash <repo> <out> --revision <rev>` converts once.",
    build=lambda target, opts: DFlashProposer(as_dflash_drafter(opts["drafter"], target),
                                              block_size=opts["block_size"],
                                              adaptive=opts["draft_length_schedule"] != "constant"),
    options=(
        Option("block_size", int, None, "block positions drafted (default: the drafter's block size)"),
        SCHEDULE,
        HYBRID,
    ),
    # objects: a DFlashDrafter, or transformers' own MuseGlimmerAssistantModel (converted in memory by `build`,
    # sharing its weights); folders / Hub ids: converted for the target (a Muse Glimmer config has no vocabulary size)
    drafter=dataclasses.replace(DrafterSpec.published(
        DFlashDrafter, convert_dflash, LAYOUTS,
        export=export_dflash,
        doc="a DFlash drafter",
        shipped={SMOLLM2: "smollm2-135m-instruct-dflash"},
        train=_train,
        example="drafter=\"z-lab/Qwen3-4B-DFlash-b16\")     # published repo, converted folder, or model",
    ), load=_load, accepts=(DFlashDrafter, *NATIVE_DRAFTERS)),
    shorthands={
        "dflash": Shorthand("B", lambda arg: {"block_size": int(arg)} if arg else {}),
        "dflash_fixed": Shorthand("B", lambda arg: {"draft_length_schedule": "constant",
                                                    **({"block_size": int(arg)} if arg else {})}),
    },
)
