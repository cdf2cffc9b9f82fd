"""hf_specdec: lossless speculative decoding for Hugging Face transformers.

Change one argument of ``model.generate()``:

    >>> out = model.generate(**inputs, max_new_tokens=64, do_sample=False,
    ...                      custom_generate="hf_specdec/prompt_lookup", trust_remote_code=True)

Importing the package registers its drafters with transformers' Auto classes (``AutoConfig`` / ``AutoModel``), so a
drafter saved or converted by hf_specdec loads with ``AutoModel.from_pretrained(folder)``. See README.md for every
entry point.
"""

__version__ = "0.1.0"

import logging as _logging
import os as _os

if _os.environ.get("HF_SPECDEC_LOG_CALLS", "") not in ("", "0"):  # one line per call on stderr (hf_specdec.engine.CALLS)
    _calls = _logging.getLogger("hf_specdec.calls")
    if not _calls.handlers:
        _calls.addHandler(_logging.StreamHandler())
        _calls.setLevel(_logging.INFO)

from . import modeling  # noqa: F401  (registers the drafters' configs and models with the Auto classes)
from .attach import attach, attached, detach
from .draft_models import load_draft_model, save_draft_model
from .engine import SpeculativeDecoderOnlyOutput, SpeculativeStats, speculative_decode
from .entry import available_methods, build_proposer, custom_generate_path, decoding_method, generate_with_method
from .proposers.suffix_index import SuffixCache
from .registry import Method, Option, register, shipped_drafter, unregister
from .tree import DraftTree

__all__ = [
    "DraftTree",
    "Method",
    "Option",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeStats",
    "SuffixCache",
    "attach",
    "attached",
    "available_methods",
    "build_proposer",
    "custom_generate_path",
    "decoding_method",
    "detach",
    "generate_with_method",
    "load_draft_model",
    "register",
    "save_draft_model",
    "shipped_drafter",
    "speculative_decode",
    "unregister",
]
