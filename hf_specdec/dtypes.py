"""The dtype a target runs in: ``--dtype`` of ``demo``, ``generate`` and ``bench``, and ``run_demo(dtype=...)``.

On a CPU, half precision is kept only where the processor has fast kernels for it: bfloat16 needs AVX512-BF16 or
AMX-BF16, float16 needs AVX512-FP16 or AMX-FP16. Elsewhere it is emulated, slower than float32, so
:func:`resolve_dtype` warns and returns float32. On other devices (CUDA) the dtype is returned as asked.

Example::

    from hf_specdec.dtypes import resolve_dtype

    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype("bfloat16"))  # float32 on an old CPU
"""

from __future__ import annotations

import functools
import warnings

import torch

DTYPES = ("float32", "float16", "bfloat16")  # the names --dtype takes
HALF = (torch.float16, torch.bfloat16)
CPU_FEATURES = {  # dtype: the /proc/cpuinfo flags of the processor features with fast kernels for it
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
FEATURE_NAMES = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "avx512_fp16": "AVX512-FP16",
                 "amx_fp16": "AMX-FP16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str] | None:
    """The processor's feature flags (the ``flags`` line of /proc/cpuinfo), or ``None`` where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The processor's name and its half-precision features, for the record of a measurement (``"AMD EPYC,
    avx512_bf16, no AMX"``): /proc/cpuinfo's ``model name`` and :func:`_cpu_flags`; ``platform.processor()`` where
    there is no /proc/cpuinfo."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        return name
    flags = _cpu_flags() or frozenset()
    return f"{name}, {'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16'}, " \
           f"{'amx_bf16' if 'amx_bf16' in flags else 'no AMX'}"


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU has fast kernels for half-precision ``dtype`` (:data:`CPU_FEATURES`), from /proc/cpuinfo;
    where that cannot be read (not Linux, not x86), torch's own oneDNN check.

    Example:
        >>> cpu_supports(torch.bfloat16)  # doctest: +SKIP
        True
    """
    flags = _cpu_flags()
    if flags is None:
        # (weaker on x86: oneDNN accepts any AVX512 processor, with or without the bf16 / fp16 instructions)
        check = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                 else torch.ops.mkldnn._is_mkldnn_fp16_supported)
        return bool(check())
    return any(flag in flags for flag in CPU_FEATURES[dtype])


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = "cpu") -> torch.dtype:
    """The dtype to load a target in: ``dtype`` (a name of :data:`DTYPES` or a torch dtype; ``None``: float32) on
    ``device``, except half precision on a CPU without fast kernels for it (:func:`cpu_supports`): a warning naming
    the missing processor feature, and float32. ``device="auto"`` is CUDA where one is available.

    Example:
        >>> resolve_dtype("bfloat16", "cuda"), resolve_dtype(None)
        (torch.bfloat16, torch.float32)
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}: the dtypes are {', '.join(DTYPES)}.")
        dtype = getattr(torch, dtype)
    if dtype not in (torch.float32, *HALF):
        raise ValueError(f"Unsupported dtype {dtype_name(dtype)}: the dtypes are {', '.join(DTYPES)}.")
    kind = str(device or "cpu").partition(":")[0]
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind != "cpu" or dtype == torch.float32 or cpu_supports(dtype):
        return dtype
    features = " or ".join(FEATURE_NAMES[f] for f in CPU_FEATURES[dtype])
    warnings.warn(f"{dtype_name(dtype)} needs a CPU with {features} for fast kernels, and this one has neither: "
                  "using float32 instead.", stacklevel=2)
    return torch.float32
