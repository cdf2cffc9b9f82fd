"""What the drafters share: the fit check against a target, the read-out through the target's LM head, loading."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from hf_specdec._transformers import from_pretrained_options
from hf_specdec.placement import execution_device, materialized


def target_fit_problems(config, target_config, what: str, ids_for: Callable[[int], list[int]],
                        hidden_state_ids: bool = False) -> list[str]:
    """Why a drafter ``config`` (``vocab_size``, ``target_hidden_size``, ``num_target_layers``) does not fit
    ``target_config``: vocabulary, hidden size and layer count must match, and the feature ids ``ids_for(n)`` must be
    layer indices ``0..n-1`` (or HF ``hidden_states`` indices ``0..n`` with ``hidden_state_ids``)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    problems = []
    if text.vocab_size != config.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} vs the target's {text.vocab_size}")
    if text.hidden_size != config.target_hidden_size:
        problems.append(f"target hidden size {config.target_hidden_size} vs the target's {text.hidden_size}")
    n = text.num_hidden_layers
    if config.num_target_layers is not None and config.num_target_layers != n:
        problems.append(f"{config.num_target_layers} target layers vs the target's {n}")
    ids = ids_for(n)
    top = n if hidden_state_ids else n - 1
    if any(not 0 <= i <= top for i in ids):
        problems.append(f"{what} {ids} out of range for a {n}-layer target (0..{top})")
    return problems


def kept_rows(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The rows of ``hidden [B, T, H]`` whose logits a drafter's forward returns: as transformers' models, the last
    ``logits_to_keep`` (``0``: every row); a ``[B]`` tensor: that one row of each batch row (a context fed with holes
    or padding, whose root rows differ)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden.gather(1, logits_to_keep[:, None, None].expand(-1, 1, hidden.shape[-1]))
    return hidden[:, -logits_to_keep:] if logits_to_keep else hidden


class LoadsWithoutKernelsMixin:
    """``from_pretrained`` (and ``AutoModel.from_pretrained``) of a drafter on every transformers in the tested range,
    with or without the ``kernels`` package (transformers 5.25 needs it for its default ``use_kernels=True``):
    :func:`hf_specdec._transformers.from_pretrained_options`. First among the bases, before ``PreTrainedModel``."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return super().from_pretrained(*args, **from_pretrained_options(kwargs))


class DraftVocabularyMixin:
    """A drafter that scores ``config.draft_vocab_size`` of the target's ``config.vocab_size`` tokens: the buffer
    ``token_map`` holds the target id of every draft id."""

    def draft_to_target(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        if self.config.draft_vocab_size == self.config.vocab_size:
            return draft_ids
        return self.token_map.to(draft_ids.device)[draft_ids]

    def set_draft_vocabulary(self, draft_ids) -> torch.LongTensor:
        """Set ``token_map`` to ``draft_ids`` (the target ids kept, one per draft id); returns them as a tensor."""
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if draft_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft_ids has {draft_ids.numel()} ids for draft_vocab_size "
                             f"{self.config.draft_vocab_size}.")
        with torch.no_grad():
            self.token_map.copy_(draft_ids.to(self.token_map.device))
        return draft_ids


class TargetHeadMixin(DraftVocabularyMixin):
    """For a drafter that reads out through its target's LM head over a draft vocabulary (a ``token_map`` buffer of
    target ids): what it takes from the target when bound (never stored: out of the module tree) -- the LM head's rows
    of ``token_map``, the embedding, the logit soft-cap, a weak reference to the target -- and the read-out.
    The class needs ``config.check_target``, ``config.vocab_size`` and ``config.draft_vocab_size``."""

    def bind_target(self, target):
        """Check the module fits ``target`` and take its embedding and LM head rows (frozen, not saved); returns
        the module."""
        self.config.check_target(target.config)
        head = target.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{type(self).__name__} reads out with the target's linear LM head; got "
                             f"{type(head).__name__}.")
        # the rows on the head's execution device (an LM head offloaded by Accelerate: its stored weights, read once)
        weight, bias = materialized(head, "weight"), materialized(head, "bias")
        rows = self.token_map.to(weight.device)
        # built uninitialised (its rows are copied in): an init would draw from torch's global generator at every call
        sub = nn.Linear(head.in_features, rows.numel(), bias=bias is not None, device="meta",
                        dtype=weight.dtype).to_empty(device=execution_device(head))
        with torch.no_grad():
            sub.weight.copy_(weight[rows])
            if bias is not None:
                sub.bias.copy_(bias[rows])
        self.__dict__["head"] = sub.requires_grad_(False)  # out of the module tree: never saved or trained
        self.__dict__["embed"] = target.get_input_embeddings()
        self.__dict__["_bound"] = weakref.ref(target)
        self.softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        return self

    def bound_to(self):
        """The target :meth:`bind_target` took the embedding and head from (``None`` if none, or gone)."""
        ref = self.__dict__.get("_bound")
        return ref() if ref is not None else None

    def _require_bound(self) -> None:
        if self.__dict__.get("head") is None:
            raise ValueError(f"Bind the {type(self).__name__} to its target first: module.bind_target(target).")

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (fp32) of normed states, read out with the target's head rows."""
        self._require_bound()
        logits = self.head(normed.to(self.head.weight.device, self.head.weight.dtype)).float()
        if getattr(self, "softcap", None):
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
