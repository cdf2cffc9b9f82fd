"""The benchmark harness (``hf-specdec bench``): :mod:`~hf_specdec.bench.run` runs the methods and the baselines
side by side (schema of its result there), :mod:`~hf_specdec.bench.methods` builds what it runs,
:mod:`~hf_specdec.bench.probes` measures, :mod:`~hf_specdec.bench.summary` and :mod:`~hf_specdec.bench.report` turn
the runs into figures and tables, :mod:`~hf_specdec.bench.sweeps` runs a batch-size sweep; the prompt sets are in
:mod:`~hf_specdec.bench.data`, the synthetic background load in :mod:`~hf_specdec.bench.load`."""

from .load import background_load
from .methods import build_methods, check_method_name, fp32_baseline
from .report import markdown
from .run import BACKGROUND_LOAD_MODES, run_bench
from .summary import mismatches
from .sweeps import batch_markdown, batch_sweep

__all__ = ["BACKGROUND_LOAD_MODES", "background_load", "batch_markdown", "batch_sweep", "build_methods",
           "check_method_name", "fp32_baseline", "markdown", "mismatches", "run_bench"]
