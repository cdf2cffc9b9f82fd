"""What the ``hf-specdec`` commands share: the texts of their ``--dtype`` help, :class:`CommandError`, the argument
types of comma-separated method lists and counts, the drafter flags, and the loading of a target model and its
tokenizer."""

from __future__ import annotations

import argparse

from .. import registry
from .._transformers import load_pretrained


HALF_HELP = "in half precision an output differing from plain decoding is reported as the match rate, not an error"
CPU_HELP = ("float32 instead, with a warning, on a CPU without AVX512-BF16 or AMX-BF16 (bfloat16), AVX512-FP16 or "
            "AMX-FP16 (float16)")


class CommandError(SystemExit):
    """Exit status 2 after a user error was printed as ``hf-specdec: error: <message>``; ``str()`` is the message
    (so that ``pytest.raises(SystemExit, match=...)`` reads it)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _drafter_methods():
    """``(flag, method)`` of every registered method with a drafter."""
    return [(m.drafter_flag, m) for m in registry.methods() if m.drafter is not None]


def _split_methods(values) -> list[str]:
    """Method names from comma-separated text (``"a,b"``), or from several such texts."""
    values = [values] if isinstance(values, str) else values
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


def _method_list(text: str) -> list[str]:
    """``--methods`` of demo / install-hub-cache / publish-hub: registered method names, comma-separated."""
    names = _split_methods(text)
    if not names:
        raise argparse.ArgumentTypeError("give one or more method names, comma-separated "
                                         f"({', '.join(registry.available_methods())})")
    for name in names:
        try:
            registry.get(name)
        except registry.UnknownMethodError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return names


def _method_list_help() -> str:
    """The help of a ``--methods`` option read by :func:`_method_list`: the registered methods."""
    return f"comma-separated, of {', '.join(registry.available_methods())}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _load_model(path, dtype, device, quantize: str | None = None):
    """``(model in eval mode, tokenizer)`` of ``path`` (``None``: the embedded SmolLM2) in ``dtype`` on ``device``;
    ``quantize``: a name of :data:`hf_specdec.quantization.QUANTIZATIONS`, loaded through ``from_pretrained``'s
    ``quantization_config`` and placed by its ``device_map`` (a quantized model is not moved afterwards)."""
    import torch

    from ..dtypes import resolve_dtype

    dtype = resolve_dtype(dtype, device)
    kwargs = {}
    if quantize is not None:
        from ..quantization import quantization_config

        kwargs = {"quantization_config": quantization_config(quantize), "device_map": device}
    if path is None:
        from ..default_model import load_smollm2

        model, tok = load_smollm2(dtype=dtype, device=None if device == "auto" or kwargs else device, **kwargs)
        if device == "auto" and torch.cuda.is_available() and not kwargs:
            model = model.to("cuda")
        return model, tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = kwargs or ({"device_map": "auto"} if device == "auto" else {})
    model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, **kwargs)
    if "device_map" not in kwargs:
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return model.eval(), tok
