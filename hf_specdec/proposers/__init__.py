from .base import Proposer
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer

__all__ = ["Proposer", "DraftModelProposer", "PromptLookupProposer"]
