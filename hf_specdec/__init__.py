"""hf_specdec: lossless speculative decoding for Hugging Face transformers.

Change one argument of ``model.generate()``:

    >>> out = model.generate(**inputs, max_new_tokens=64, do_sample=False,
    ...                      custom_generate="hf_specdec/prompt_lookup", trust_remote_code=True)

See README.md for every entry point.
"""

__version__ = "0.1.0"

from .engine import SpeculativeDecoderOnlyOutput, SpeculativeStats, speculative_decode
from .draft_models import load_draft_model, save_draft_model
from .entry import available_methods, build_proposer, custom_generate_path, decoding_method, generate_with_method
from .tree import DraftTree

__all__ = [
    "DraftTree",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeStats",
    "available_methods",
    "build_proposer",
    "custom_generate_path",
    "decoding_method",
    "generate_with_method",
    "load_draft_model",
    "save_draft_model",
    "speculative_decode",
]
