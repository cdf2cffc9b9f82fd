"""Which attention implementations can verify a draft tree, and the mask each one is given.

The loop verifies a draft tree in one target forward whose mask says which cached columns and which tree nodes each
node sees (:func:`hf_specdec.tree.build_attention_mask`). transformers runs the attention named by
``config._attn_implementation`` and builds a model's masks with the builder registered for that name
(``AttentionMaskInterface``); a 4D mask the caller passes goes to the attention as it is. So the name's registered
builder says what the implementation takes, and that is the one rule here (checked: transformers 5.24.0, 5.25.0):

==========================================  ===========================================================================
builder registered for the name             how a tree is verified
==========================================  ===========================================================================
``sdpa_mask``, ``eager_mask``               the 4D additive float mask (``sdpa``, ``eager``, names registered with them)
``flex_attention_mask``                     a ``BlockMask`` whose ``mask_mod`` reads the same boolean matrix
                                            (``flex_attention``; given a float mask, transformers would add it as a
                                            score modification, which torch's CPU flex kernel cannot index)
``flash_attention_mask``                    none taken: these see padding only and are causal over the new tokens, so
                                            siblings would see each other. For the call the configs are switched to
                                            ``sdpa`` (``eager`` for a model without it): the same attention, over a
                                            mask it honours (``flash_attention_2/3/4``, hub flash kernels)
none (or a ``paged|`` name)                 refused (:class:`UnsupportedAttentionError`): transformers gives such an
                                            attention no mask, what it computes is its own, and ``paged|eager`` reads
                                            continuous batching's paged cache
==========================================  ===========================================================================

A switch lasts one ``generate`` call (:func:`verifiable_attention`, entered by every
:class:`~hf_specdec.runners.TargetSession`) and edits the model's configs: a plain ``generate()`` of the same model
in another thread meanwhile runs on the switched attention too.
"""

from __future__ import annotations

import contextlib

import torch

from ._transformers import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    attention_implementation,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    sdpa_mask,
    supports_sdpa,
    switch_attention,
)

TENSOR = "tensor"  # a [B, 1, n, kv] additive float mask
BLOCK = "block"  # a torch.nn.attention.flex_attention.BlockMask
_PAD = 128  # the tree matrix a BlockMask reads is padded to a multiple of this past its sizes (block_mask)


class UnsupportedAttentionError(ValueError):
    """The model's attention implementation cannot verify a draft tree and cannot be replaced without changing what
    the model computes."""


def mask_format(config) -> str | None:
    """What a model with ``config`` takes as a draft tree's mask: :data:`TENSOR`, :data:`BLOCK`, or ``None`` (only
    padding: a tree mask would not be honoured)."""
    name = attention_implementation(config)
    if name is None:  # a config never loaded: transformers runs eager
        return TENSOR
    builder = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else None
    if name.startswith("paged|") or builder is None:
        return None
    if builder is flex_attention_mask:
        return BLOCK
    return TENSOR if builder in (sdpa_mask, eager_mask) else None


def _switchable(name: str) -> bool:
    """Whether ``name`` computes exact attention over padding only (transformers' flash builder is registered for
    it), so that sdpa over the tree mask computes what it would."""
    builder = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else None
    return builder is flash_attention_mask and not name.startswith("paged|")


def _refused(name: str, owner: str) -> UnsupportedAttentionError:
    why = ("it is transformers' continuous-batching attention: it reads a paged cache, and over the loop's cache it "
           "applies no causal mask" if name.startswith("paged|") else
           "transformers registers no mask builder for it (AttentionMaskInterface), so it is given no attention mask "
           "and what it computes over a draft tree is unknown")
    return UnsupportedAttentionError(
        f"The attention implementation {name!r} of {owner} cannot verify a draft tree: {why}. Load the model with "
        "attn_implementation='sdpa' (or 'eager', 'flex_attention'), or call model.set_attn_implementation('sdpa') "
        "before generate(); an attention that honours any 4D additive mask can be registered for it with "
        "transformers.AttentionMaskInterface.register(name, transformers.masking_utils.sdpa_mask).")


def replacement(config, model) -> str:
    """The implementation a config that cannot verify a tree (:func:`mask_format` ``None``) is switched to for a
    call, or raise :class:`UnsupportedAttentionError` when no switch keeps what the model computes."""
    name = attention_implementation(config)
    if _switchable(name):
        return "sdpa" if supports_sdpa(model) else "eager"
    raise _refused(name, type(model).__name__)


def tree_mask_format(config) -> str:
    """:func:`mask_format` for a mask about to be built, raising :class:`UnsupportedAttentionError` where it is
    ``None``: outside :func:`verifiable_attention` (every target session is inside) a flash attention is not switched
    yet, and the others never are."""
    fmt = mask_format(config)
    if fmt is not None:
        return fmt
    name = attention_implementation(config)
    if not _switchable(name):
        raise _refused(name, type(config).__name__)
    raise UnsupportedAttentionError(
        f"The attention implementation {name!r} sees padding only, so a draft tree's mask would not be honoured: run "
        "the forward inside hf_specdec.attention.verifiable_attention(model) (every TargetSession is), which switches "
        "it to sdpa for the call.")


def _configs(models):
    """``(model, config)`` for every distinct transformers config of the modules of ``models``."""
    seen: set[int] = set()
    for model in models:
        if not isinstance(model, torch.nn.Module):
            continue
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and id(config) not in seen and hasattr(config, "get_text_config"):
                seen.add(id(config))
                yield model, config


def needs_switch(*models) -> bool:
    """Whether :func:`verifiable_attention` would switch (or refuse) an attention of ``models``."""
    return any(mask_format(config) is None for _, config in _configs(models))


@contextlib.contextmanager
def verifiable_attention(*models):
    """Inside, every config of ``models`` (a target, its drafters) names an attention that honours a draft tree's
    mask: those that would not (:func:`mask_format` ``None``) are switched to :func:`replacement` and restored at
    exit. Raises :class:`UnsupportedAttentionError` before switching anything where one cannot be switched."""
    switched = [(config, attention_implementation(config), replacement(config, model))  # (config, own, for the call)
                for model, config in _configs(models) if mask_format(config) is None]
    for config, _, name in switched:
        switch_attention(config, name)
    try:
        yield
    finally:
        for config, own, _ in switched:
            switch_attention(config, own)


def block_mask(allowed: torch.BoolTensor):
    """``allowed [B, n, kv]`` (True: the query may see the key) as a flex_attention ``BlockMask``. The matrix is kept
    on it (``allowed``) for :func:`mask_rows`."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, n, width = allowed.shape
    # read from a copy padded past the attention's sizes, to the next multiple of 128 beyond them (as transformers
    # pads its own flex masks): a matrix of the attention's own sizes shares their symbols once shapes vary, and
    # inductor's CPU flex kernel then confuses them with its block sizes (C++ compile error, index out of bounds)
    padded = allowed.new_zeros(bsz, (n // _PAD + 1) * _PAD, (width // _PAD + 1) * _PAD)
    padded[:, :n, :width] = allowed

    def mask_mod(b, h, q_idx, kv_idx):
        return padded[b, q_idx, kv_idx]

    mask = create_block_mask(mask_mod, bsz, None, n, width, device=allowed.device)
    mask.allowed = allowed
    return mask


def to_mask(allowed: torch.BoolTensor, fmt: str, dtype: torch.dtype):
    """``allowed [B, n, kv]`` as the mask ``fmt`` names: ``[B, 1, n, kv]`` additive float (0 = attend, finfo.min =
    masked) or a ``BlockMask``."""
    if fmt == BLOCK:
        return block_mask(allowed)
    return additive(allowed, dtype)[:, None]


def additive(allowed: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (any shape) as an additive float mask: 0 where True, ``finfo(dtype).min`` elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def mask_rows(mask, start: int):
    """The rows of queries ``start..`` of a mask :func:`to_mask` made (or a dict of them by layer type). A tensor's rows
    are copied out: a view would start ``start * keys`` elements into the mask's storage, and cuDNN's attention (sdpa
    on CUDA in half precision) reads such a misaligned mask out of bounds ("misaligned address", issue 51)."""
    if isinstance(mask, dict):
        return {kind: mask_rows(m, start) for kind, m in mask.items()}
    if isinstance(mask, torch.Tensor):
        return mask[:, :, start:].clone() if start else mask  # contiguous() would keep the offset view
    return block_mask(mask.allowed[:, start:])
