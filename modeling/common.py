"""Checks shared by the drafters that read target features (EAGLE-3, DFlash)."""

from __future__ import annotations

from typing import Callable


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
