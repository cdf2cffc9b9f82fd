"""The benchmark harness (``hf-specdec bench``); see :mod:`hf_specdec.bench.harness`, and
:mod:`hf_specdec.bench.load` for its synthetic background load."""

from .harness import (
    BACKGROUND_LOAD_MODES,
    batch_markdown,
    batch_sweep,
    build_methods,
    check_method_name,
    fp32_baseline,
    markdown,
    mismatches,
    run_bench,
)
from .load import background_load

__all__ = ["BACKGROUND_LOAD_MODES", "background_load", "batch_markdown", "batch_sweep", "build_methods",
           "check_method_name", "fp32_baseline", "markdown", "mismatches", "run_bench"]
