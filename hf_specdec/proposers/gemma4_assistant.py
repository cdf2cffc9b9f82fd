"""Gemma 4 assistants (``Gemma4AssistantForCausalLM``, ``Gemma4UnifiedAssistantForCausalLM``): multi-token drafting
from one position over the target's shared KV, in the loop's batched tree verification.

What transformers' ``SinglePositionMultiTokenCandidateGenerator`` does (``generate(assistant_model=...)``, batch 1,
chains), here for batches and trees. A draft step's input is the target's input embedding of the last seen token
concatenated with a ``[B, H]`` state: the target's last hidden state (``hidden_states[-1]``, the final norm's output,
which the LM head reads) of the position that predicted that token, then the assistant's own projected output. Every
assistant layer attends, at the constant position of the root, to the target's *shared KV*: the keys and values of
the target's last layer of each attention type that is not itself KV-shared (transformers' ``kv_sharing_modes``
``"store"`` layers), over every committed token before the root. The assistant keeps no KV of its own.

Where the shared KV comes from: the target cache after the loop's commit. It holds one column per committed token
before the root (the accepted path's columns, rows' holes masked by the layout), and the ``"store"`` layers write
their keys and values into it at their own layer index (``cache.update(..., layer_idx)``; KV-shared layers hold a
``DummyLayer``). The loop stores sliding-window layers as full ones (:mod:`hf_specdec.cache`), so the sliding type's
keys are there for the whole sequence. The mask of each type is the layout's ``valid`` columns; for the sliding type
also the window transformers' assistant mask gives (``create_attention_masks``: a bidirectional window over the
flipped keys, ``|q - kv| <= sliding_window`` at ``q = 0``): the last ``sliding_window + 1`` tokens before the root,
i.e. ``root_position - position <= sliding_window + 1``. So compaction needs nothing here, and the masks are built by
position, not by column, for rows with holes.

The target's last hidden state is the LM head's input, captured by a forward pre-hook on the target's output
embeddings (for Gemma 4 the same tensor as ``hidden_states[-1]``; Gemma 3n's ``hidden_states[-1]`` is its AltUp stack,
its LM head's input the final state). The assistant runs through its own modules (``pre_projection``, its Gemma 4 text
model with the ``{layer type: mask}`` mapping and ``shared_kv_states``, ``post_projection``, the LM head or the
ordered-embedding head ``masked_embedding``) because its ``forward`` builds masks for one query against unpadded keys
only; the arithmetic is its own.

Chains: ``k`` single-row assistant forwards. Trees (``tree_width = w > 1``): depth 1 is the ``w`` best tokens of the
root's logits; each further depth feeds the ``w`` frontier nodes as ``w`` rows of one forward (all at the root's
position, each with its own input state) and keeps the ``w`` best children by cumulative log-probability; ``w * k``
drafts. Coupled sampling drafts from the logits through :meth:`DecodingState.perturb`; rejection sampling samples a
chain from the assistant's distribution (``draft_probs``), a tree's top-k drafts are deterministic (the verifier's
rule for those is exact).
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from ..attention import to_mask, tree_mask_format
from ..costs import AcceptanceEstimator, RecentMinimum, best_count
from ..registry import SCHEDULE, DrafterSpec, Method, Option
from ..tree import DraftTree
from .base import Proposer, next_draft, rules_of

CONSTANT_TOKENS = 4  # draft length of draft_length_schedule="constant" when neither the option nor the assistant says
MAX_TOKENS = 8  # the longest draft the adaptive length may choose
ASSISTANT_CLASSES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")
TARGET_PREFIXES = ("Gemma4", "Gemma3n")  # the class names transformers accepts as targets of these assistants


def _assistant_classes() -> tuple[type, ...]:
    from transformers import Gemma4AssistantForCausalLM, Gemma4UnifiedAssistantForCausalLM

    return Gemma4AssistantForCausalLM, Gemma4UnifiedAssistantForCausalLM


def producer_layers(config) -> dict[str, int]:
    """``{layer type: index}`` of the target layers whose KV the assistant reads: per attention type, the last layer
    that computes its own KV (transformers' ``kv_sharing_modes``: the ``"store"`` layers; without KV sharing, the
    last layer of each type)."""
    text = config.get_text_config()
    types = list(text.layer_types)
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    first_shared = len(types) - shared
    found = {}
    for i, kind in enumerate(types[:first_shared]):
        found[kind] = i
    return found


def check_pair(target, assistant) -> None:
    """Raise ``ValueError`` unless ``assistant`` can draft for ``target`` (the family transformers checks, the
    hidden size the assistant was trained on, the vocabulary, the shared KV's types and shapes)."""
    name = type(target).__name__
    if not name.startswith(TARGET_PREFIXES):
        raise ValueError(f"gemma4_assistant needs a Gemma 4 or Gemma 3n target (a class whose name starts with Gemma4 "
                         f"or Gemma3n, as transformers requires): the assistant reads the target's shared KV states, "
                         f"which only those families provide. Got {name}.")
    if type(assistant).__name__ not in ASSISTANT_CLASSES:
        raise ValueError(f"gemma4_assistant needs a {' or '.join(ASSISTANT_CLASSES)}, got {type(assistant).__name__}.")
    text, mine = target.config.get_text_config(), assistant.config.get_text_config()
    if assistant.config.backbone_hidden_size != text.hidden_size:
        raise ValueError(f"The assistant was trained for a target with hidden size "
                         f"{assistant.config.backbone_hidden_size} (backbone_hidden_size), but the target {name} has hidden_size={text.hidden_size}: use the "
                         "assistant published with this target (e.g. google/gemma-4-E2B-it-assistant for "
                         "google/gemma-4-E2B-it).")
    if mine.vocab_size != text.vocab_size:
        raise ValueError(f"The assistant has a vocabulary of {mine.vocab_size} tokens, the target {text.vocab_size}.")
    producers = producer_layers(target.config)
    missing = sorted(set(mine.layer_types) - set(producers))
    if missing:
        raise ValueError(f"The assistant has {', '.join(missing)} layers but the target has no such layer computing "
                         "its own KV to share.")
    for kind in sorted(set(mine.layer_types)):
        theirs, ours = _kv_geometry(text, producers[kind]), _kv_geometry(mine, mine.layer_types.index(kind))
        if theirs != ours:
            raise ValueError(f"The assistant's {kind} layers attend with (KV heads, head dim) = {ours}, but the "
                             f"target's shared {kind} KV (layer {producers[kind]}) has {theirs}: it was made for "
                             "another target.")


def _kv_geometry(text_config, index: int) -> tuple[int, int]:
    """``(KV heads, head dim)`` of layer ``index`` (Gemma 4's per-layer overrides: full-attention layers have their
    own head dim)."""
    per_layer = getattr(text_config, "per_layer_config", None)
    layer = per_layer[index] if per_layer is not None else text_config
    return int(layer.num_key_value_heads), int(layer.head_dim)


def load_assistant(path, target):
    """A Gemma 4 assistant from a folder or Hub id (``AutoModelForCausalLM``: the class its config names), on the
    target's drafter device and dtype, in eval mode."""
    from transformers import AutoModelForCausalLM

    from .._transformers import load_pretrained
    from ..placement import drafter_device

    model = load_pretrained(AutoModelForCausalLM, str(path), dtype=target.dtype)
    if type(model).__name__ not in ASSISTANT_CLASSES:
        raise ValueError(f"{path} holds a {type(model).__name__}, not a Gemma 4 assistant "
                         f"({' or '.join(ASSISTANT_CLASSES)}).")
    return model.to(drafter_device(target)).eval()


class Gemma4AssistantProposer(Proposer):
    """Drafts chains or top-k trees with a Gemma 4 assistant over the target's shared KV (see the module doc).

    Args:
        assistant: a ``Gemma4AssistantForCausalLM`` or ``Gemma4UnifiedAssistantForCausalLM``.
        num_tokens: fixed draft length (tree depth); ``None`` picks it per step from the measured costs and the
            running acceptance (up to ``max_tokens``).
        tree_width: ``1`` drafts a chain; ``w > 1`` a tree of ``w`` nodes per depth (top-``w`` children of the
            frontier, by cumulative log-probability).
    """

    name = "gemma4_assistant"

    def __init__(self, assistant, num_tokens: int | None = None, tree_width: int = 1, max_tokens: int = MAX_TOKENS):
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}.")
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}.")
        self.drafter = assistant
        self.num_tokens = num_tokens
        self.width = tree_width
        self.max_tokens = num_tokens if num_tokens is not None else max_tokens
        self.max_nodes = self.width * self.max_tokens + 1
        self._hook = None
        self._captured = None

    # ---- the target's last hidden state: the LM head's input
    @staticmethod
    def _capturer(proposer):
        """The LM head's forward pre-hook: keeps its input on ``proposer`` (held weakly: a hook left behind by a call
        that failed does not keep the proposer alive), for forwards of the call's own thread only (not another
        thread's ``generate()`` on the same model)."""
        ref, thread = weakref.ref(proposer), threading.get_ident()

        def capture(module, args):
            owner = ref()
            if owner is not None and threading.get_ident() == thread:
                owner._captured = args[0]
        return capture

    def prepare(self, model) -> None:
        check_pair(model, self.drafter)
        self.producers = producer_layers(model.config)
        self.embed = model.get_input_embeddings()
        self.kinds = sorted(set(self.drafter.config.get_text_config().layer_types))
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.get_output_embeddings().register_forward_pre_hook(self._capturer(self))

    def end(self, state) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._captured = None

    def begin(self, state) -> None:
        self.rules = rules_of(state)
        weight = self.drafter.pre_projection.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.hidden = self._captured[:, -1].detach()  # [B, H]: the prompt's last position predicted the root
        self.estimator = AcceptanceEstimator(prior_alpha=0.6, prior_weight=3.0, decay=0.9)
        self.forward_seconds = RecentMinimum(window=16 if self.rules.recent_minimum else 1)
        t_params = sum(p.numel() for p in state.model.parameters())
        d_params = sum(p.numel() for p in self.drafter.parameters())
        self.prior_cost = 0.05 + d_params / max(t_params, 1)
        self.counts = None
        cfg = self.drafter.config.get_text_config()
        self.window = getattr(cfg, "sliding_window", None)
        self.mask_format = tree_mask_format(cfg)

    def commit(self, state, tree, result) -> None:
        counts, self.counts = self.counts, None
        if counts is not None:
            for b, n_acc in enumerate(result.num_accepted):
                if result.paths[b] and counts[b] > 0:
                    self.estimator.update("all", counts[b], n_acc)
        # the target's last hidden state at each row's last kept node: it predicted the new root
        nodes = [p[-1] if p else 0 for p in result.paths]
        index = torch.tensor(nodes, device=self._captured.device)
        picked = self._captured[torch.arange(len(nodes), device=index.device), index].detach()
        if all(result.paths):
            self.hidden = picked
        else:  # rows that stopped keep theirs (never drafted from again)
            keep = torch.tensor([bool(p) for p in result.paths], device=picked.device)[:, None]
            self.hidden = torch.where(keep, picked, self.hidden)

    # ---- the assistant's forward
    def _shared_kv(self, state) -> dict:
        """``{layer type: (keys, values)}`` of the target's producer layers over the layout's columns."""
        length = state.layout.length
        kv = {}
        for kind in self.kinds:
            layer = state.cache.layers[self.producers[kind]]
            kv[kind] = (layer.keys[:, :, :length].to(self.device), layer.values[:, :, :length].to(self.device))
        return kv

    def _masks(self, state, n: int) -> dict:
        """``{layer type: mask}`` for ``n`` query rows per batch row, all at the root's position: full attention sees
        every real committed column; sliding attention the last ``sliding_window + 1`` positions before the root
        (transformers' assistant mask, by position so that holes do not count)."""
        layout = state.layout
        valid = layout.valid.to(self.device)
        masks = {}
        for kind in self.kinds:
            allowed = valid
            if kind == "sliding_attention" and self.window is not None:
                distance = state.root_positions.to(self.device)[:, None] - layout.positions.to(self.device)
                allowed = valid & (distance <= self.window + 1)
            masks[kind] = to_mask(allowed[:, None, :].expand(-1, n, -1), self.mask_format, self.dtype)
        return masks

    def _forward(self, state, tokens, hidden, kv, masks):
        """One assistant forward over ``tokens [B, n]`` with input states ``hidden [B, n, H]`` (at the root's
        position); returns ``(logits [B, n, V] fp32 on the loop's device, projected states [B, n, H])``."""
        d = self.drafter
        t0 = time.perf_counter()
        embeds = self.embed(tokens.to(self.embed.weight.device)).to(self.device, self.dtype)
        x = d.pre_projection(torch.cat([embeds, hidden.to(self.device, self.dtype)], dim=-1))
        n = tokens.shape[1]
        positions = state.root_positions.to(self.device)[:, None].expand(-1, n)
        # logits_to_keep as a slice: the text model then never slices its per-layer inputs, which an assistant does
        # not have (transformers 5.24 would index None for n > 1 rows)
        out = d.model(inputs_embeds=x, attention_mask=masks, position_ids=positions, shared_kv_states=kv,
                      use_cache=False, logits_to_keep=slice(None))
        last = out.last_hidden_state
        projected = d.post_projection(last)
        logits = d.masked_embedding(last, d.lm_head.weight) if d.config.use_ordered_embeddings else d.lm_head(last)
        self.forward_seconds.add(time.perf_counter() - t0)
        return logits.float().to(state.device), projected

    # ---- drafting
    def _draft_cost(self, state) -> float:
        step = state.cost_model.step_seconds() if state.cost_model is not None else None
        seconds = self.forward_seconds.value()
        if seconds is None or not step or not self.rules.measured_costs:
            return self.prior_cost
        return seconds / step

    def _length(self, state, most: int) -> int:
        if self.num_tokens is not None or state.cost_model is None:
            return most
        alpha = min(max(self.estimator.alpha("all"), 0.0), 0.999)
        expected, total, term = [], 1.0, 1.0
        for _ in range(most):
            term *= alpha
            total += term
            expected.append(total)
        if self.width == 1:
            return best_count(expected, state.cost_model, self._draft_cost(state))
        # a tree of depth d verifies w * d + 1 nodes: the depth whose expected tokens pay best for that
        cost, draft = state.cost_model, self._draft_cost(state)
        best_d, best_rate = 0, 1.0
        for depth, tokens in enumerate(expected, start=1):
            rate = tokens / (cost.relative(self.width * depth + 1) + depth * draft)
            if rate > best_rate:
                best_d, best_rate = depth, rate
        if best_d == 0 and cost.explore_due():
            return 1
        return best_d

    def propose(self, state):
        budgets, top = state.budgets(self.max_tokens), state.deepest(self.max_tokens)
        k = min(self._length(state, top), top)
        if k <= 0:
            return None
        self.counts = [min(b, k) for b in budgets]
        kv = self._shared_kv(state)
        roots = state.roots()
        if self.width == 1:
            return self._chain(state, roots, k, kv)
        return self._tree(state, roots, k, kv)

    def _chain(self, state, roots, k, kv):
        masks = self._masks(state, 1)
        process = state.draft_process_fn()
        prefixes = [state.prefix(b) for b in range(state.batch_size)] if process is not None else None
        tokens, hidden = roots[:, None], self.hidden[:, None]
        drafts, probs = [], []
        for i in range(k):
            logits, hidden = self._forward(state, tokens, hidden, kv, masks)
            nxt, p = next_draft(state, logits[:, 0], prefixes, drafts, process)
            if state.do_sample:
                probs.append(p)
            drafts.append(nxt)
            tokens = nxt[:, None]
        draft_probs = torch.stack(probs, dim=1) if probs else None
        return DraftTree.chain(roots, torch.stack(drafts, dim=1), self.counts, draft_probs)

    def _tree(self, state, roots, k, kv):
        bsz, w = state.batch_size, self.width
        rows = torch.arange(bsz, device=state.device)[:, None]
        masks = self._masks(state, 1)
        logits, projected = self._forward(state, roots[:, None], self.hidden[:, None], kv, masks)
        score, tok = torch.log_softmax(state.perturb(logits[:, 0], 0).float(), -1).topk(w, dim=-1)  # [B, w]
        hidden = projected.expand(-1, w, -1)  # every depth-1 node came from the root's row
        tokens, parents = [tok], [torch.zeros(bsz, w, dtype=torch.long, device=state.device)]
        if k > 1:
            masks = self._masks(state, w)
        for depth in range(1, k):
            logits, projected = self._forward(state, tok, hidden, kv, masks)  # [B, w, V]
            child = torch.log_softmax(state.perturb(logits, depth).float(), -1)
            child_score, child_tok = child.topk(w, dim=-1)  # [B, w, w]
            total = (score[:, :, None] + child_score).flatten(1)
            score, pick = total.topk(w, dim=-1)  # the next frontier: the best w children
            parent = pick // w  # the frontier slot of each child's parent
            tok = child_tok.flatten(1).gather(1, pick)
            hidden = projected[rows, parent]
            tokens.append(tok)
            parents.append(1 + (depth - 1) * w + parent)  # node numbers: depth d's nodes are 1 + (d-1)w ...
        host = torch.cat([torch.cat(tokens, 1), torch.cat(parents, 1)], 1).tolist()  # the proposal's one read
        n = w * k
        token_rows = [h[:w * c] for h, c in zip((r[:n] for r in host), self.counts)]
        parent_rows = [h[:w * c] for h, c in zip((r[n:] for r in host), self.counts)]
        return DraftTree.from_rows(roots, token_rows, parent_rows)


def _build(target, opts) -> Gemma4AssistantProposer:
    assistant = opts["drafter"]
    num = opts["num_speculative_tokens"]
    if num is None:
        num = getattr(getattr(assistant, "generation_config", None), "num_assistant_tokens", None)
    if num is None and opts["draft_length_schedule"] == "constant":
        num = CONSTANT_TOKENS
    return Gemma4AssistantProposer(assistant, num_tokens=num, tree_width=opts["tree_width"])


METHOD = Method(
    name="gemma4_assistant",
    summary="a Gemma 4 assistant (`google/gemma-4-*-it-assistant`) drafting from one position over the target's "
            "shared KV; chains or top-k trees",
    description="Lossless speculative decoding with the Gemma 4 assistants transformers runs with "
                "`SinglePositionMultiTokenCandidateGenerator`: the assistant reads the KV of the target's last "
                "non-shared layer of each attention type and the target's last hidden state, and drafts several tokens "
                "from the root's position. Here in the batched tree-verifying loop: padded batches, chains or top-k "
                "trees (`tree_width`), exact sampling. Gemma 4 and Gemma 3n targets.",
    build=_build,
    options=(
        Option("num_speculative_tokens", int, None,
               "draft length (tree depth); default: the assistant's generation_config.num_assistant_tokens when set, "
               f"else chosen per step from measured costs and acceptance, up to {MAX_TOKENS} ({CONSTANT_TOKENS} with "
               "draft_length_schedule='constant')"),
        Option("tree_width", int, 1,
               "1: a chain; w > 1: a tree of w nodes per depth (the w best children of the frontier), each depth "
               "one assistant forward with w rows"),
        SCHEDULE,
    ),
    drafter=DrafterSpec(
        doc="a Gemma 4 assistant (Gemma4AssistantForCausalLM or Gemma4UnifiedAssistantForCausalLM)",
        hint="pass assistant_model=<Gemma 4 assistant> (or drafter=<folder or Hub id such as "
             "google/gemma-4-E2B-it-assistant>)",
        load=load_assistant,
        accepts=_assistant_classes(),
        check=check_pair,
        example="assistant_model=assistant)          # or drafter=\"google/gemma-4-E2B-it-assistant\"",
    ),
)
