"""Multi-token prediction (MTP) proposers: sequential MTP modules (DeepSeek-V3 style) and parallel heads (Gloeckle).

**Sequential modules** (:class:`~hf_specdec.modeling.mtp.MTPModule`). The module row at column ``t`` pairs the
target's post-norm hidden state ``h_t`` with the *next* token ``x_{t+1}`` and scores ``x_{t+2}``, as the reference
shifts its inputs (transformers' ``MtpModel``: "if the main model processed positions [N-1, N], the MTP inputs are
the ids of [N, N+1] with the main model's hidden states of [N-1, N]"). Every target cache column therefore has one
module row, and the module's own KV cache holds the rows of the accepted tokens, mirroring the target cache's column
layout (holes included) exactly as the EAGLE-3 drafter's does: the loop (drafter context feeding, chain and tree
drafting, the cache kept in step with compactions) is :class:`~hf_specdec.proposers.eagle3.Eagle3Proposer`'s. A
chain of ``k`` drafts applies the module again to its own output and the token just drafted (DeepSeek and vLLM's
use of a one-module checkpoint); the rows of those drafts are thrown away after the proposal. The default chain has
3 drafts, each verified only while its chance of acceptance pays for its measured cost; a dynamic tree
(EAGLE-2's) is one option away (``tree_top_k`` / ``tree_depth`` / ``tree_total_tokens``).

**Parallel heads** (:class:`~hf_specdec.modeling.mtp.ParallelMTPHeads`). Every head reads the target's trunk state
(the input of its last layer) of every column, with its own KV cache of the accepted columns; head ``i`` at the last
accepted column scores the token ``i + 1`` places after the root, so one forward over the new columns drafts the
whole chain (self-speculation, Gloeckle et al.). Heads are independent of the drafts before them: their
distributions are what the exact sampling rule uses.

Greedy output equals ``generate(do_sample=False)``; sampling is exact speculative sampling (the drafts are sampled
from the module's distributions, which the verifier is given).
"""

from __future__ import annotations

import logging
import time

import torch
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from ..default_model import MODEL_ID as SMOLLM2
from ..modeling.mtp import LAYOUTS, MTPModule, ParallelMTPHeads
from ..placement import drafter_device
from ..registry import SCHEDULE, DrafterSpec, Method, Option, Shorthand
from ..tree import DraftTree
from .eagle3 import Eagle3Proposer, default_tree
from .base import draft_vocab_ids
from .features import FeatureDrafterProposer
from .hybrid import HYBRID

DEFAULT_TOKENS = 3  # the chain's length: the speed target's chain of 3
logger = logging.getLogger("hf_specdec")


class MTPProposer(Eagle3Proposer):
    """Args:
        drafter: an :class:`MTPModule` for the target (bound to the target in ``prepare``); with several stored
            modules the first drafts at every depth (a warning says so).
        num_speculative_tokens: the chain's length (``None`` with a tree).
        top_k, depth, total_tokens: a dynamic draft tree instead of the chain (EAGLE-2's expansion).
        adaptive: verify only the drafts that pay for their measured cost, back off when none does.
    """

    name = "mtp"

    def __init__(self, drafter: MTPModule, num_speculative_tokens: int | None = DEFAULT_TOKENS,
                 adaptive: bool = True, **tree):
        if drafter.num_modules > 1:
            logger.warning(
                f"hf_specdec: this MTP checkpoint has {drafter.num_modules} modules; mtp drafts with the first one "
                "applied again for every draft (as DeepSeek-V3 and vLLM use a one-module checkpoint). Modules 2.. "
                "would each read a causal context of the previous module's outputs, which the method does not keep, "
                "so they are not used (the output is the target's either way).")
        super().__init__(drafter, num_speculative_tokens=num_speculative_tokens, adaptive=adaptive, **tree)

    def _kv_shape(self) -> tuple[int, int] | None:
        """The first module's block (a decoder layer of the target's family, layer index 0: what drafts at every
        depth) over a :class:`~hf_specdec.cache.FixedDraftCache` under ``compile=True``, as EAGLE-3's layer."""
        if not isinstance(self.drafter, MTPModule):
            return None
        return cache_ops.kv_shape(self.drafter.config.block_text_config())

    def _fixed_cache_for(self, state) -> None:
        self.drafter.rotary_on(self.device)  # made outside the compiled regions
        super()._fixed_cache_for(state)

    def _draft_forward(self, tokens, hidden, positions, mask, step: int, logits_to_keep: int = 0):
        # the first module, at every depth
        return self.drafter(tokens, hidden, positions, mask, self.cache, step=0, logits_to_keep=logits_to_keep)


class ParallelHeadsProposer(FeatureDrafterProposer):
    """Args:
        drafter: :class:`ParallelMTPHeads` for the target.
        num_speculative_tokens: drafts per step (at most the number of heads; default all).
        adaptive: verify only the drafts that pay for their measured cost, back off when none does.
    """

    name = "mtp"

    def __init__(self, drafter: ParallelMTPHeads, num_speculative_tokens: int | None = None, adaptive: bool = True):
        super().__init__(drafter, adaptive)
        k = drafter.num_modules if num_speculative_tokens is None else num_speculative_tokens
        if not 1 <= k <= drafter.num_modules:
            raise ValueError(f"num_speculative_tokens must be in 1..{drafter.num_modules} (the number of parallel "
                             f"heads), got {num_speculative_tokens}.")
        self.k = k
        self.max_nodes = k + 1

    def begin(self, state) -> None:
        super().begin(state)
        self._worth = None

    def propose(self, state):
        if self.adaptive and self.backoff.skipping():
            return None
        start = time.perf_counter()
        k = state.deepest(self.k)
        if k <= 0:
            return None
        fed = state.layout.length - self.synced
        normed = self._feed(state)  # [B, n, H] at each row's last real column
        if fed > self.BACKLOG:
            start = time.perf_counter()
        logits = self.drafter.logits(normed[:, :k]).float()  # [B, k, Vd]
        logits = state.perturb(logits, range(k), draft_vocab_ids(state, self.drafter, logits.shape[-1]))
        probs = torch.softmax(logits, dim=-1)
        picks = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2]) if state.do_sample \
            else logits.argmax(-1)
        drafts = self.drafter.draft_to_target(picks).to(state.device)
        counts = state.budgets(k)
        self._worth = None
        if self.adaptive:
            reach = probs.gather(-1, picks[..., None])[..., 0].cumprod(-1).tolist()  # the proposal's one host read
            counts = self._cut_chains(state, reach, counts)
        tree = None
        if any(counts):
            draft_probs = self._target_probs(state, probs) if state.do_sample else None
            tree = DraftTree.chain(state.roots(), drafts, counts, draft_probs)
        if self.adaptive:
            self.backoff.judge(state, time.perf_counter() - start, *(self._worth or (None, None)))
        return tree

    def _feed(self, state) -> torch.Tensor:
        """Feed the heads the trunk states of the columns they have not seen; every head's output at each row's last
        real column ``[B, n, H]``."""
        layout = state.layout
        if self.synced > layout.length:
            self.cache, self.synced = DynamicCache(), 0
        start, end = self.synced, layout.length
        mask = self._context_mask(state, start, end)
        normed = self.drafter(self.features[:, start:end], layout.positions[:, start:end].to(self.device), mask,
                              self.cache)  # [B, n_new, heads, H]
        self.synced = end
        idx = (layout.last_real() - start).clamp(min=0).to(self.device)
        return normed.gather(1, idx[:, None, None, None].expand(-1, 1, *normed.shape[2:]))[:, 0]


def _build(target, opts):
    drafter = opts["drafter"]
    adaptive = opts["draft_length_schedule"] != "constant"
    if isinstance(drafter, ParallelMTPHeads):
        if any(opts[f"tree_{k}"] is not None for k in ("top_k", "depth", "total_tokens")):
            raise ValueError("Parallel MTP heads draft a chain (one token per head); the tree_* options are for "
                             "sequential MTP modules.")
        return ParallelHeadsProposer(drafter, opts["num_speculative_tokens"], adaptive=adaptive)
    given = {k: opts[f"tree_{k}"] for k in ("top_k", "depth", "total_tokens") if opts[f"tree_{k}"] is not None}
    if given:
        if opts["num_speculative_tokens"] is not None:
            raise ValueError("Pass num_speculative_tokens (a chain) or tree_* options (a tree), not both.")
        return MTPProposer(drafter, num_speculative_tokens=None, adaptive=adaptive,
                           **{**default_tree(drafter_device(target), target.dtype), **given})
    return MTPProposer(drafter, num_speculative_tokens=opts["num_speculative_tokens"] or DEFAULT_TOKENS,
                       adaptive=adaptive)


def _convert(source, out=None, **kwargs):
    from ..conversions.mtp import convert_mtp

    return convert_mtp(source, out, **kwargs)


def _export(drafter, out, **kwargs):
    from ..conversions.mtp import export_mtp

    return export_mtp(drafter, out, **kwargs)


def _load(source, target):
    """A folder hf_specdec wrote (sequential module or parallel heads) loads with ``from_pretrained``; a published
    checkpoint (DeepSeek-V3, GLM-4.x, Qwen3-Next / Qwen3.5, MiMo) is converted in memory, fetching only its MTP
    shard."""
    from ..conversions.common import load_converted_or_published, read_config, resolve_source

    folder = resolve_source(source, allow_patterns=["config.json"])
    cls = ParallelMTPHeads if read_config(folder).get("model_type") == ParallelMTPHeads.config_class.model_type \
        else MTPModule
    return load_converted_or_published(source, target, model_cls=cls, convert=_convert)


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_mtp(target, tokenizer, out, depths=args.depths,
                              draft_vocab=args.draft_vocab, **common)


def _train_parallel(target, tokenizer, out, args, common):
    from .. import training

    return training.train_parallel_mtp(target, tokenizer, out, heads=args.heads or 3, draft_vocab=args.draft_vocab,
                                       **common)


METHOD = Method(
    name="mtp",
    summary="multi-token prediction: a DeepSeek-V3-style MTP module on the target's final hidden state and the next "
            "token (published or trained here), or parallel heads (Gloeckle); a chain",
    description="Multi-token prediction drafting: an MTP module (one decoder layer of the target's own family "
                "between the target's embedding and LM head) reads the target's final hidden state h_t with the "
                "embedding of x_{t+1} and scores x_{t+2}; applied again to its own output it drafts a chain (3 by "
                "default, verified only as far as pays), or a dynamic tree with the tree_* options. The module keeps "
                "its own KV cache of the accepted tokens. Published MTP layers (DeepSeek-V3/R1, GLM-4.5/4.6/4.7, "
                "Qwen3-Next, Qwen3.5/3.6, MiMo) are converted in memory, fetching only the checkpoint shard that "
                "holds them; `hf-specdec convert mtp <repo> <out>` converts once; `hf-specdec train mtp` trains a "
                "module for any frozen target. Parallel heads (Gloeckle et al.: extra decoder layers on the trunk, "
                "head i scoring x_{t+2+i}) draft the whole chain in one forward. Lossless: greedy output identical, "
                "exact speculative sampling.",
    build=_build,
    options=(
        Option("num_speculative_tokens", int, None, f"the chain's length (default {DEFAULT_TOKENS}; parallel heads: "
               "the number of heads)"),
        Option("tree_top_k", int, None, "a dynamic tree instead of the chain: children per expanded node"),
        Option("tree_depth", int, None, "a dynamic tree: its depth (default by device as eagle3's)"),
        Option("tree_total_tokens", int, None, "a dynamic tree: its size, root included"),
        SCHEDULE,
        HYBRID,
    ),
    drafter=DrafterSpec(
        doc="an MTP module",
        hint="pass drafter=<MTPModule / ParallelMTPHeads, converted folder, or a published repo id / folder with "
             "MTP layers>",
        load=_load,
        accepts=(MTPModule, ParallelMTPHeads),
        convert=_convert,
        layouts=LAYOUTS,
        export=_export,
        shipped={SMOLLM2: "smollm2-135m-instruct-mtp"},
        train=_train,
        more_training={"mtp-parallel": ("parallel MTP heads (Gloeckle et al.) on the target's trunk",
                                        _train_parallel)},
        example="drafter=\"deepseek-ai/DeepSeek-V3\")   # published repo (MTP shard only), converted folder, or model",
    ),
    shorthands={
        "mtp": Shorthand("K", lambda arg: {"num_speculative_tokens": int(arg)} if arg else {}),
    },
)
