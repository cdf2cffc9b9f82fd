"""A decoder-only target's layer stack driven in pieces, through transformers' own modules.

LayerSkip-style self-speculation runs the target's first ``E`` layers alone (drafting) and later layers ``E..N-1``
alone (verifying drafted tokens whose early layers already ran). transformers' ``forward`` only runs the whole
stack, so :class:`DecoderStack` calls the model's own submodules in the order its ``forward`` does: the token
embedding, the rotary embedding, the decoder layers (each with its layer type's mask), the final norm and the LM
head (with the final logit soft-capping where the family has one). No modeling code is copied or patched: if a
family's ``forward`` does anything else between those calls, it is not in :data:`DRIVABLE`, and
:meth:`DecoderStack.check` refuses it with a message naming the architecture.

Example::

    stack = DecoderStack(model)                                   # raises for a family it cannot drive
    h = stack.embed(input_ids)                                    # [B, q, H]
    rope = stack.rotary(h, position_ids)
    h = stack.run(h, 0, 8, mask, rope, position_ids, cache)       # layers 0..7; their KV goes into `cache`
    logits = stack.logits(h)                                      # final norm + LM head, [B, q, V] fp32
"""

from __future__ import annotations

import inspect

import torch

from .attention import mask_rows

# model types whose base model's forward is exactly: embed_tokens -> rotary_emb -> layers (per-type masks) -> norm,
# and whose CausalLM applies lm_head (+ final_logit_softcapping) to the result (transformers 5.x modeling files)
DRIVABLE = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
})


class UndrivableModelError(ValueError):
    pass


class DecoderStack:
    """The embedding, layers, final norm and LM head of a decoder-only ``model`` (see the module doc)."""

    def __init__(self, model):
        self.check(model)
        self.model = model
        self.base = model.base_model
        self.config = model.config.get_text_config()
        self.layers = self.base.layers
        self.num_layers = len(self.layers)
        self.layer_types = list(getattr(self.config, "layer_types", None) or [])
        self.head = model.get_output_embeddings()
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self._typed_rope = "layer_type" in inspect.signature(self.base.rotary_emb.forward).parameters

    @staticmethod
    def check(model) -> None:
        """Raise :class:`UndrivableModelError` unless ``model``'s layers can be run in pieces."""
        config = model.config.get_text_config()
        kind = getattr(config, "model_type", None)
        arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
        base = getattr(model, "base_model", None)
        missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, name)]
        if kind not in DRIVABLE or missing or model.get_output_embeddings() is None:
            why = f"its base model lacks {missing}" if missing else f"model type {kind!r} is not one it drives"
            raise UndrivableModelError(
                f"LayerSkip cannot drive the layers of {arch} ({why}): it runs a target's first layers alone and "
                f"the rest alone through transformers' own modules, for the decoder-only families whose forward "
                f"is embed -> rotary -> layers -> norm -> head: {', '.join(sorted(DRIVABLE))}. Use another method "
                "(prompt_lookup, assisted, eagle3) for this model.")

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return self.base.embed_tokens(input_ids)

    def rotary(self, hidden: torch.Tensor, position_ids: torch.LongTensor) -> dict:
        """``{layer type: (cos, sin)}`` for ``position_ids`` (one entry, ``None``, for families with one rope)."""
        if self._typed_rope:
            return {t: self.base.rotary_emb(hidden, position_ids, t) for t in set(self.layer_types)}
        return {None: self.base.rotary_emb(hidden, position_ids)}

    def run(self, hidden: torch.Tensor, start: int, stop: int, mask, rope: dict, position_ids, cache) -> torch.Tensor:
        """Layers ``start..stop-1`` over ``hidden [B, q, H]``; each appends its keys/values for the ``q`` tokens to
        its own layer of ``cache``. ``mask``: a 4D additive mask or a ``{layer type: mask}`` mapping
        (:func:`hf_specdec.tree.build_attention_mask`)."""
        for i in range(start, stop):
            kind = self.layer_types[i] if self.layer_types else None
            layer_mask = mask[kind or "full_attention"] if isinstance(mask, dict) else mask
            hidden = self.layers[i](hidden, attention_mask=layer_mask,
                                    position_embeddings=rope[kind] if self._typed_rope else rope[None],
                                    position_ids=position_ids, cache=cache, use_cache=True)
        return hidden

    def resume(self, tokens: torch.LongTensor, resumed: torch.Tensor, mask, positions, cache, pieces) -> tuple:
        """The forward of ``tokens [B, N]`` whose first ``D`` already went through layers ``0..E-1`` (their outputs
        ``resumed [B, D, H]``, their keys and values in ``cache``): layers ``0..E-1`` for the other tokens, then
        layers ``E..`` for all, in ``pieces`` (``[(E, a), (a, b), ..., (., num_layers)]``: where hidden states are
        kept). Returns ``(logits [B, N, V] fp32 on the tokens' device, {layer index: hidden states [B, N, H]})``
        (index ``num_layers``: the final norm's output, as transformers' ``hidden_states[-1]`` is)."""
        exit_layer, done = pieces[0][0], resumed.shape[1]
        hidden = self.embed(tokens[:, done:])
        if hidden.shape[1]:
            rest = positions[:, done:]
            hidden = self.run(hidden, 0, exit_layer, mask_rows(mask, done), self.rotary(hidden, rest), rest, cache)
        hidden = torch.cat([resumed.to(hidden.device, hidden.dtype), hidden], dim=1)
        logits, captured = self.finish(hidden, mask, positions, cache, pieces)
        # on the tokens' device, as the model's own forward returns them (Accelerate: the LM head's may differ)
        return logits.to(tokens.device), captured

    def finish(self, hidden: torch.Tensor, mask, positions, cache, pieces) -> tuple:
        """Layers ``E..`` over ``hidden [B, N, H]`` (every token's output of layer ``E - 1``) in ``pieces``, the final
        norm and the LM head: ``(logits [B, N, V] fp32, {layer index: hidden states})`` as :meth:`resume` returns
        them."""
        captured = {pieces[0][0]: hidden}
        rope = self.rotary(hidden, positions)
        for start, stop in pieces:
            hidden = self.run(hidden, start, stop, mask, rope, positions, cache)
            captured[stop] = hidden
        normed = self.norm(hidden)
        captured[self.num_layers] = normed
        return self.logits(normed, normed=True), captured

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base.norm(hidden)

    def logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """The LM head's logits (fp32) for pre-norm ``hidden`` (``normed=True``: already normed)."""
        logits = self.head(hidden if normed else self.norm(hidden)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
