"""Quantized models: which weights the library may multiply or read itself, and the quantizations the bench names.

A target or drafter loaded with a ``quantization_config`` (torchao, optimum-quanto, bitsandbytes, GPTQ, AWQ ...) keeps
its linear weights in forms that only its own layers know how to multiply: tensor subclasses (torchao's
``Int8Tensor``, quanto's ``WeightQBytesTensor``, bitsandbytes' ``Int8Params`` / ``Params4bit``), packed integer
buffers (GPTQ's and AWQ's ``qweight``), or layer classes of their own. The library therefore

* multiplies a weight itself only when it is a *plain dense* tensor (:func:`plain_dense`): the CPU kernel runner takes
  a target only when :func:`not_dense` finds nothing quantized in it (else the model's own forward runs every
  verification, :class:`hf_specdec.kernels.CpuKernelRunner`), and its products take only the ``nn.Linear`` layers of
  a drafter whose weights are plain dense;
* reads a quantized weight's values, where a drafter needs them (the target's LM head rows of an EAGLE-3 drafter, a
  draft model sharing the target's embeddings), through the layer itself (:func:`dense_weight`): a linear layer's
  weight is its output for the identity matrix, less its bias; an embedding's is its output for every id;
* says once per model (:func:`say_once`, from :func:`hf_specdec.runner_choice.runner_for`) where a quantization
  computes a token depending on the other tokens of its forward (:func:`rows_interact`: bitsandbytes' LLM.int8()),
  so that the output equals the model's own greedy decoding only up to rounding.

Which backends were run and measured, and what is untested: docs/quantization.md.

Example::

    from transformers import AutoModelForCausalLM
    from hf_specdec.quantization import not_dense, quantization_config

    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization_config("torchao-int8"))
    not_dense(model)   # 'it is quantized (torchao)': verification runs the model's own forward
"""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger("hf_specdec")
_SAID: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> the notes logged for it (say_once)

# the quantizations `hf-specdec bench --quantize` (and the tests) load a target with: name -> what it is
QUANTIZATIONS = {
    "torchao-int8": "torchao Int8WeightOnlyConfig (int8 weights, one scale per output channel)",
    "torchao-int4": "torchao IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)) (int4 weights; "
                    "torchao's Int4WeightOnlyConfig needs CUDA)",
    "quanto-int8": "optimum-quanto QuantoConfig(weights='int8')",
    "bnb-int8": "bitsandbytes BitsAndBytesConfig(load_in_8bit=True)",
    "bnb-nf4": "bitsandbytes BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')",
}
_PACKAGES = {"torchao": "torchao", "quanto": "optimum-quanto", "bnb": "bitsandbytes"}


def quantization_config(name: str):
    """The transformers ``quantization_config`` of the quantization ``name`` (a key of :data:`QUANTIZATIONS`), to
    pass to ``from_pretrained``; its package must be installed (a clear error names it otherwise).

    Example::

        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization_config("torchao-int8"))
    """
    if name not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {name!r}: the quantizations are {', '.join(QUANTIZATIONS)}.")
    package = _PACKAGES[name.partition("-")[0]]
    try:
        if name.startswith("torchao"):
            from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
            from torchao.quantization.granularity import PerGroup
            from transformers import TorchAoConfig

            if name == "torchao-int8":
                return TorchAoConfig(Int8WeightOnlyConfig())
            return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
        if name == "quanto-int8":
            import optimum.quanto  # noqa: F401  (transformers' QuantoConfig checks it only when loading)
            from transformers import QuantoConfig

            return QuantoConfig(weights="int8")
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig

        if name == "bnb-int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    except ImportError as err:
        raise ImportError(f"The quantization {name!r} needs the package {package!r}: pip install {package} "
                          f"({err}).") from None


def plain_dense(tensor) -> bool:
    """Whether ``tensor`` is a plain dense floating tensor (``torch.Tensor`` or ``nn.Parameter`` itself, strided):
    one that ``torch.mm`` and indexing take as it is stored. A tensor subclass (torchao's ``Int8Tensor``, quanto's
    ``QTensor``, bitsandbytes' ``Int8Params``), a sparse or an integer tensor is not."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
            and tensor.is_floating_point())


def not_dense(model) -> str | None:
    """Why ``model``'s weights are not all plain dense tensors that the library could multiply itself, in words
    (``None``: they are): a ``quantization_config`` in its config (transformers' loader, a GPTQ / AWQ checkpoint), a
    parameter that is not :func:`plain_dense` (torchao's ``quantize_``, quanto's ``freeze``, bitsandbytes' layers), or
    a layer with packed ``qweight`` (GPTQ, AWQ). (quanto's ``quantize()`` without ``freeze()`` keeps float weights that
    its ``QLinear`` layers quantize in each forward: not found here, and the kernels, which take exact ``nn.Linear``
    layers only, leave those layers to their own forward.)

    Example::

        >>> not_dense(torch.nn.Linear(4, 4)) is None
        True
    """
    layer = _first_quantized_layer(model)
    quantized = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantized is None:
        return layer
    method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    method = getattr(method, "value", method) or type(quantized).__name__
    return f"it is quantized ({method}" + (f"; {layer}" if layer else "") + ")"


def rows_interact(model) -> str | None:
    """Why ``model``'s quantized layers may compute a token depending on the other tokens of the same forward, in
    words (``None``: not that we know of). bitsandbytes' LLM.int8() (``load_in_8bit`` with ``llm_int8_threshold > 0``,
    6.0 by default) computes in float16 the input columns where *any* row has an outlier, so a verification over
    several tokens can round a token otherwise than its one-token step: the output equals the model's own greedy
    decoding only up to that rounding. ``llm_int8_threshold=0.0`` computes every row on its own.

    Example::

        >>> rows_interact(torch.nn.Linear(4, 4)) is None
        True
    """
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if isinstance(config, dict):
        eight_bit, threshold = config.get("load_in_8bit"), config.get("llm_int8_threshold", 6.0)
    else:
        eight_bit, threshold = getattr(config, "load_in_8bit", False), getattr(config, "llm_int8_threshold", 6.0)
    if eight_bit and (threshold or 0) > 0:
        return (f"bitsandbytes' LLM.int8() (llm_int8_threshold={threshold}) computes the columns where any token of a "
                "forward has an outlier in float16, so a verification of several tokens can round a token otherwise "
                "than the model's one-token step: the output equals its own greedy decoding up to that rounding; "
                "BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) computes every token on its own")
    return None


def say_once(model, note: str) -> None:
    """Log ``note`` (a warning of the ``hf_specdec`` logger) the first time it is said of ``model``."""
    try:
        said = _SAID.setdefault(model, set())
    except TypeError:  # not weak-referenceable: nothing kept, said each time
        said = set()
    if note not in said:
        said.add(note)
        logger.warning(note)


def _first_quantized_layer(model) -> str | None:
    """The first weight or layer of ``model`` that is not plain dense, in words (``None``: none). Read from the
    modules' own dictionaries: once per call, about a millisecond for a 30-layer model."""
    for module in model.modules():
        params = [p for p in module._parameters.values() if p is not None and not plain_dense(p)]
        if params or module._buffers.get("qweight") is not None:
            where = next(n for n, m in model.named_modules() if m is module) or type(model).__name__
            if not params:
                return f"its {where} ({type(module).__name__}) holds packed quantized weights (qweight)"
            key = next(k for k, p in module._parameters.items() if p is params[0])
            return f"its {where}.{key} is a {_kind(params[0])}"
    return None


def _kind(tensor) -> str:
    cls = type(tensor)
    if cls in (torch.Tensor, torch.nn.Parameter):
        return f"{tensor.dtype} tensor" if tensor.layout == torch.strided else f"{tensor.layout} tensor"
    return f"{cls.__module__.partition('.')[0]} {cls.__name__}"


def dense_weight(module, name: str = "weight"):
    """``module``'s tensor ``name`` as a plain tensor: the tensor itself where it is a ``torch.Tensor`` (or ``None``);
    a quantized weight (a tensor subclass) of a linear layer (any ``nn.Linear`` subclass: torchao, quanto,
    bitsandbytes) or of an ``nn.Embedding`` read through the layer itself -- a linear layer's weight is its output for
    the identity matrix less its bias, an embedding's its output for every id -- so that no backend's storage has to
    be known (bitsandbytes' ``Int8Params.dequantize()``, for one, returns the raw int8 values). The values are the
    layer's own dequantized weights (up to the rounding of its product, for a backend that quantizes its input too):
    what a drafter reading a target's LM head or embedding needs.

    Example::

        head = dense_weight(target.get_output_embeddings())   # [vocab, hidden], float, whatever the quantization
    """
    tensor = getattr(module, name)
    if tensor is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor
    with torch.no_grad():
        if name == "weight" and isinstance(module, torch.nn.Linear):
            bias = getattr(module, "bias", None)
            bias = bias if bias is not None and plain_dense(bias) else None
            dtype = bias.dtype if bias is not None else tensor.dtype if tensor.is_floating_point() else torch.float32
            out = module(torch.eye(module.in_features, dtype=dtype, device=tensor.device))  # [in, out]: W.T + b
            return (out if bias is None else out - bias).t().contiguous()
        if name == "weight" and type(module) is torch.nn.Embedding:
            return module(torch.arange(module.num_embeddings, device=tensor.device)).contiguous()
    raise ValueError(f"{type(module).__name__}.{name} is a {_kind(tensor)} that the library cannot read as plain "
                     "values (only quantized nn.Linear and nn.Embedding layers are read through the layer). Load the "
                     "model with this layer unquantized (transformers' quantization configs name the modules to leave "
                     "as they are, e.g. modules_to_not_convert).")
