"""Proposers: how each method drafts (one module per method, each with its registry record ``METHOD``)."""

from .base import BackOff, Proposer
from .draft_model import DraftModelProposer
from .features import FeatureDrafterProposer
from .prompt_lookup import PromptLookupProposer

__all__ = ["BackOff", "DraftModelProposer", "FeatureDrafterProposer", "PromptLookupProposer", "Proposer"]
