"""The benchmark harness (``hf-specdec bench``); see :mod:`hf_specdec.bench.harness`."""

from .harness import build_methods, markdown, run_bench

__all__ = ["build_methods", "markdown", "run_bench"]
