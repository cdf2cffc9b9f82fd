"""Proposers: how each method drafts (one module per method, each with its registry record ``METHOD``)."""

from .base import BackOff, Proposer, RowDraft
from .draft_model import DraftModelProposer
from .features import FeatureDrafterProposer
from .hybrid import HybridProposer
from .prompt_lookup import PromptLookupProposer
from .suffix import SuffixProposer
from .suffix_index import SuffixCache, SuffixIndex

__all__ = ["BackOff", "DraftModelProposer", "FeatureDrafterProposer", "HybridProposer", "PromptLookupProposer", "Proposer",
           "RowDraft", "SuffixCache", "SuffixIndex", "SuffixProposer"]
