"""Drafter networks as transformers ``PreTrainedModel``s (installed as ``hf_specdec.modeling``).

Importing this package registers the configs and models with transformers' Auto classes.
"""

from .dflash import DFlashConfig, DFlashDrafter
from .eagle3 import Eagle3Config, Eagle3Drafter
from .layerskip import ExitAdapter, ExitAdapterConfig
from .medusa import MedusaConfig, MedusaHeads
from .mtp import MTPConfig, MTPModule, ParallelMTPConfig, ParallelMTPHeads

__all__ = ["DFlashConfig", "DFlashDrafter", "Eagle3Config", "Eagle3Drafter", "ExitAdapter", "ExitAdapterConfig",
           "MedusaConfig", "MedusaHeads", "MTPConfig", "MTPModule", "ParallelMTPConfig",
           "ParallelMTPHeads"]
