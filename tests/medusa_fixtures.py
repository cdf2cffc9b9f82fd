"""Synthetic Medusa checkpoints in the published layouts: FasterDecoding's Medusa-1 heads (``medusa_lm_head.pt`` /
``.safetensors``, the uploaded config with its wrong head count), vLLM's Medusa and Medusa-2 full models (base model
+ ``medusa_head.*``, sharded)."""

from __future__ import annotations

import io
import json

import torch
from safetensors.torch import save as save_safetensors

H, V = 32, 96  # the hidden size and vocabulary of tiny.tiny_model("llama", hidden=32)
RAN = []  # set if a pickled payload ever runs


def random_heads(num_heads=5, layers=1, seed=0, scale=0.3, hidden=H, vocab=V):
    """``[(blocks, U)]`` per head: ``blocks`` = ``[(W [H, H], b [H])] * layers`` (all different), ``U [V, H]``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * scale

    return [([(r(hidden, hidden), r(hidden)) for _ in range(layers)], r(vocab, hidden) * 3) for _ in range(num_heads)]


def shared_copies(heads):
    """What the reference saves for ``[ResBlock] * L``: every block of a head is the same (W, b)."""
    return [(blocks[-1:] * len(blocks), u) for blocks, u in heads]


def reference_state(heads) -> dict[str, torch.Tensor]:
    """The state dict of the reference's ``medusa_head`` ModuleList: ``{i}.{j}.linear.*``, ``{i}.{L}.weight``."""
    state = {}
    for i, (blocks, u) in enumerate(heads):
        for j, (w, b) in enumerate(blocks):
            state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"] = w.clone(), b.clone()
        state[f"{i}.{len(blocks)}.weight"] = u.clone()
    return state


def _bf16(state):
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def medusa_files(heads, fmt="pt", config_heads=2):
    """FasterDecoding/medusa-vicuna-7b-v1.3: the uploaded config (2 heads for 5) + bf16 ``medusa_lm_head.{pt,
    safetensors}`` (the .safetensors variant is Narsil's refs/pr/1 and the legacy trainer's output)."""
    cfg = {"base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "medusa_num_heads": config_heads,
           "medusa_num_layers": len(heads[0][0]), "transformers_version": "4.31.0"}
    state = _bf16(reference_state(heads))
    weights = pickled(state) if fmt == "pt" else save_safetensors(state)
    return {"config.json": json.dumps(cfg).encode(), f"medusa_lm_head.{fmt}": weights, "README.md": b"medusa"}


def _mark(message):
    RAN.append(message)


class Payload:
    """A pickled object that would run code (``_mark``) when unpickled without weights_only."""

    def __reduce__(self):
        return (_mark, ("payload ran",))


def vllm_files(heads, fc_bias=False, original_lm_head=False, token_map=None, fmt="safetensors", **cfg_extra):
    """vLLM's Medusa format (abhigoyal/vllm-medusa-*): MedusaConfig fields, ``blocks.{i}.layers.{j}.*``,
    ``lm_heads.{i}.weight``, optional ``token_map``; biases stored only with ``fc_bias``."""
    vocab, hidden = heads[0][1].shape
    cfg = {"architectures": ["MedusaModel"], "hidden_size": hidden, "max_paths": 64, "max_seq_len": 1048576,
           "model_type": "medusa", "num_heads": len(heads), "num_hidden_layers": len(heads[0][0]), "topk": 10,
           "transformers_version": "4.41.2", "truncated_vocab_size": vocab if token_map is None else len(token_map),
           "vocab_size": vocab}
    if fc_bias:
        cfg["medusa_fc_bias"] = True
    if original_lm_head:
        cfg["original_lm_head"] = True
    cfg.update(cfg_extra)
    state = {}
    for i, (blocks, u) in enumerate(heads):
        for j, (w, b) in enumerate(blocks):
            state[f"blocks.{i}.layers.{j}.weight"] = w.clone()
            if fc_bias:
                state[f"blocks.{i}.layers.{j}.bias"] = b.clone()
        if not original_lm_head or i == 0:
            state[f"lm_heads.{i}.weight"] = u.clone()
    if token_map is not None:
        state["token_map"] = torch.as_tensor(token_map, dtype=torch.long)
    weights = save_safetensors(state) if fmt == "safetensors" else pickled(state)
    name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    return {"config.json": json.dumps(cfg).encode(), name: weights}


def medusa2_files(base, heads, fmt="bin", shards=2, heads_last=False):
    """A Medusa-2 model (FasterDecoding/medusa-1.0-*): the base's config + medusa fields, its weights + the heads as
    ``medusa_head.*``, in ``shards`` ``pytorch_model-0000x-of-0000N.bin`` (or ``model-*.safetensors``) + an index
    (``heads_last``: every head tensor in the last shard, as a save that appends the heads after the base puts them)."""
    cfg = json.loads(base.config.to_json_string(use_diff=False))
    cfg.update(medusa_num_heads=len(heads), medusa_num_layers=len(heads[0][0]), architectures=["LlamaForCausalLM"])
    state = {k: v.clone() for k, v in base.state_dict().items()}
    state.update({"medusa_head." + k: v for k, v in reference_state(heads).items()})
    keys = sorted(state)
    files, weight_map = {}, {}
    for s in range(shards):
        part = {k: state[k] for k in keys[s::shards]}
        if heads_last:
            base_keys = [k for k in keys if not k.startswith("medusa_head.")]
            part = {k: state[k] for k in base_keys[s::shards]}
            if s == shards - 1:
                part.update({k: state[k] for k in keys if k.startswith("medusa_head.")})
        name = (f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin" if fmt == "bin"
                else f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
        files[name] = pickled(part) if fmt == "bin" else save_safetensors(part)
        weight_map.update({k: name for k in part})
    index = "pytorch_model.bin.index.json" if fmt == "bin" else "model.safetensors.index.json"
    files[index] = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()
    files["config.json"] = json.dumps(cfg).encode()
    files["generation_config.json"] = json.dumps({"bos_token_id": 2, "eos_token_id": 1}).encode()
    return files
