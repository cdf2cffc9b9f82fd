"""Which runner a call runs its target with: the one module that knows every implementation of
:class:`~hf_specdec.runners.TargetRunner` (the protocol sits below them, in :mod:`hf_specdec.runners`; each
implementation, :mod:`hf_specdec.kernels` and :mod:`hf_specdec.compiled`, imports only the protocol). The entry
points call :func:`runner_for` once per call and hand the runner down to the loop.

Example::

    from hf_specdec.runner_choice import runner_for

    runner = runner_for(model)   # CpuKernelRunner for a model on the CPU, TargetRunner elsewhere
"""

from __future__ import annotations

import os

from .compiled import CompiledRunner
from .kernels import CpuKernelRunner
from .quantization import rows_interact, say_once
from .runners import KERNELS_ENV, TargetRunner, kept_runner


def runner_for(model, kernels: bool | None = None, compile: bool = False) -> TargetRunner:
    """The runner for ``model``: :class:`~hf_specdec.kernels.CpuKernelRunner` for a model on the CPU whose weights
    are plain dense tensors (a quantized one keeps its own forward, said once in a log line, as is a quantization
    that computes a token depending on the others of its forward: :func:`~hf_specdec.quantization.rows_interact`),
    else :class:`~hf_specdec.runners.TargetRunner`; ``kernels=False`` (or ``HF_SPECDEC_VERIFY_KERNELS=0`` when
    ``kernels`` is ``None``, read here, at the entry point) takes the plain runner everywhere; ``compile=True`` (the
    ``compile`` option) takes :class:`~hf_specdec.compiled.CompiledRunner` on any device. One runner per model and
    kind is kept (:func:`~hf_specdec.runners.kept_runner`), so later calls reuse what earlier ones measured (and
    compiled)."""
    if kernels is None:
        kernels = os.environ.get(KERNELS_ENV, "1") != "0"
    if compile:
        cls = CompiledRunner
    else:
        cls = CpuKernelRunner if kernels and CpuKernelRunner.applies_to(model) else TargetRunner
    rows = rows_interact(model)  # a quantization whose tokens are not computed each on its own (docs/quantization.md)
    if rows is not None:
        say_once(model, f"hf_specdec: {rows} (docs/quantization.md).")
    return kept_runner(model, cls)
