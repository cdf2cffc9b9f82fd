"""Where things run next to a target placed by Accelerate (``device_map``, offload to CPU or disk, hooks).

A target loaded with ``from_pretrained(..., device_map=...)`` may be spread over several devices, and a module
offloaded to ``"cpu"`` or ``"disk"`` keeps its weights on the ``meta`` device: Accelerate's ``AlignDevicesHook``
loads them onto the module's *execution device* for each forward and moves the module's inputs there. So
``model.device`` and ``next(model.parameters()).device`` may say ``meta``, and reading an offloaded weight directly
reads nothing. The rules here, in one place:

* :func:`drafter_device`: a drafter sits where the target's last hidden state and LM head are computed (the
  LM head's execution device), so the features it reads and the logits it returns cross no device on the way.
  A drafter given as a folder or Hub id is loaded there; one given as a module stays where its owner put it
  (the proposers move what they feed it to its device, each target feature once).
* :func:`execution_device`: where a module computes (its hook's execution device, else its weights' device).
* :func:`materialized`: a weight's data even when Accelerate offloaded it, read once from the hook's store, or
  quantized, read through its layer (for drafters that take a table from the target, such as its token embeddings or
  LM head rows).

Example::

    target = AutoModelForCausalLM.from_pretrained(repo, device_map="auto")
    drafter = Eagle3Drafter.from_pretrained(folder).to(drafter_device(target))
"""

from __future__ import annotations

import torch

from .quantization import dense_weight

_OFFLOADED = ("cpu", "disk")  # device_map values whose modules compute on the main device (Accelerate's rule)


def _hooks(module) -> list:
    """The Accelerate hooks on ``module`` (a ``SequentialHook`` unpacked), innermost last."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def _as_device(value) -> torch.device:
    """A ``device_map`` value as a device: an index names the machine's accelerator (CUDA when there is none, as
    Accelerate's maps on a GPU machine mean), a string is a device string."""
    if isinstance(value, int):
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        return torch.device(accelerator.type if accelerator is not None else "cuda", value)
    return torch.device(value)


def _mapped_device(model, name: str) -> torch.device | None:
    """The execution device ``model.hf_device_map`` gives the submodule ``name``: the entry of its longest prefix;
    ``"cpu"`` and ``"disk"`` entries compute on the main device (the first other device of the map, else the CPU)."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict) or not device_map:
        return None
    best = None
    for key, value in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, value)
    if best is None:
        return None
    value = best[1]
    if value in _OFFLOADED:
        others = [v for v in device_map.values() if v not in _OFFLOADED]
        value = others[0] if others else "cpu"
    return _as_device(value)


def execution_device(module) -> torch.device:
    """The device ``module`` computes on: its Accelerate hook's execution device when it has one, else the device
    of its first weight not on ``meta``, else the CPU."""
    for hook in reversed(_hooks(module)):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return _as_device(device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def drafter_device(target) -> torch.device:
    """Where a drafter for ``target`` goes: the device of the target's last hidden state and LM head.

    Read from, in order: the LM head's Accelerate hook (where it computes), the ``hf_device_map`` entry of the LM
    head (``"cpu"`` / ``"disk"`` offload computes on the main device), the LM head's weights; a model without an
    output embedding: the same for the model itself."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is None:
        head = target
    hooked = [h.execution_device for h in _hooks(head) if getattr(h, "execution_device", None) is not None]
    if hooked:
        return _as_device(hooked[-1])
    if getattr(target, "hf_device_map", None):
        name = next((n for n, m in target.named_modules() if m is head), "")
        mapped = _mapped_device(target, name)
        if mapped is not None:
            return mapped
    return execution_device(head)


def input_device(model) -> torch.device:
    """Where ``model``'s input ids go: the execution device of its input embeddings (``model.device`` says
    ``meta`` when they are offloaded)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return execution_device(embed if embed is not None else model)


def materialized(module, name: str = "weight") -> torch.Tensor | None:
    """``module``'s parameter or buffer ``name`` with its data: the tensor itself, or, when Accelerate offloaded it
    (the tensor is on ``meta``), its stored copy read once from the hook's weights map (on the CPU); a quantized
    weight (torchao, quanto, bitsandbytes) as its plain values, read through the layer
    (:func:`hf_specdec.quantization.dense_weight`)."""
    tensor = getattr(module, name)
    if tensor is None or tensor.device.type != "meta":
        return dense_weight(module, name)
    for hook in _hooks(module):
        weights = getattr(hook, "weights_map", None)
        if getattr(hook, "offload", False) and weights is not None:
            return weights[name].to(tensor.dtype)
    raise ValueError(f"{type(module).__name__}.{name} is on the meta device and no Accelerate hook of the module "
                     "holds its data, so a drafter cannot read it. Load the target with its weights (from_pretrained "
                     "without a device_map that leaves this module empty), or with Accelerate's device_map offload, "
                     "whose hooks keep the data.")


def materialized_state_dict(module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor's data (those Accelerate offloaded read once from their hooks'
    stores, :func:`materialized`)."""
    state = module.state_dict()
    for key, value in state.items():
        if value.device.type == "meta":
            owner, _, leaf = key.rpartition(".")
            state[key] = materialized(module.get_submodule(owner), leaf)
    return state
