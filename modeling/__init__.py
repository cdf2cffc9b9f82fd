"""Drafter networks as transformers ``PreTrainedModel``s (installed as ``hf_specdec.modeling``)."""
