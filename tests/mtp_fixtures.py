"""Synthetic checkpoints with MTP layers, stored the way their publishers store them: ``config.json`` with the
published field names, the main model in ``model-0000{1,2}-of-00003.safetensors``, the MTP layers alone in
``model-00003-of-00003.safetensors``, and ``model.safetensors.index.json``.

* DeepSeek-V3 (``deepseek_v3``, ``model.layers.{N}.*``, MLA + MoE block; optionally FP8 with block scales) and GLM-4 MoE
  (``glm4_moe``, the same names at its own ``N``);
* Qwen3-Next (``qwen3_next``, linear/full attention main layers, ``mtp.*`` with a full-attention MoE layer) and
  Qwen3.5 dense (``qwen3_5``, a vision-language config nesting ``text_config`` with ``mtp_num_hidden_layers``);
* MiMo-7B (``mimo``, a Qwen2-shaped main model, ``model.mtp_layers.{k}.*`` written by hand with its names).

The main weights come from a real transformers model of the family (saved as ``save_pretrained`` saves them: MoE
experts per expert), so a test can load the target with ``from_pretrained``; the MTP blocks from a transformers model
of the family whose layers are the MTP blocks (the ``donor``), saved the same way and renamed to the published
prefix. Every fixture also returns the plain weights (``Published.modules``) a reference implementation needs.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save as save_safetensors
from transformers import AutoConfig, AutoModelForCausalLM

H, V = 32, 96
INDEX = "model.safetensors.index.json"
FP8 = torch.float8_e4m3fn


@dataclass
class Published:
    """A synthetic published checkpoint: ``files`` (name -> bytes), its ``config`` (config.json), the main model
    ``target`` (fp32, eval; MiMo: as Qwen2ForCausalLM), per MTP module ``k`` the plain weights ``modules[k]``
    (``emb_norm``, ``hid_norm``, ``proj`` [H, 2H], ``out_norm``, ``block``: the transformers decoder layer holding
    the block's weights, or for MiMo a dict of the published tensors), and the shard names."""

    files: dict[str, bytes]
    config: dict
    target: object
    modules: list[dict]
    layout: str
    centred: bool  # zero-centred (1 + w) RMSNorm
    eps: float
    num_target_layers: int
    main: dict = field(default_factory=dict, repr=False)  # the main model's tensors, checkpoint names
    mtp: dict = field(default_factory=dict, repr=False)  # the MTP tensors, checkpoint names (as stored)
    dtype: torch.dtype = torch.float32  # what sharded_files stores fp32 tensors in
    mtp_shard: str = "model-00003-of-00003.safetensors"
    main_shards: list[str] = field(default_factory=lambda: ["model-00001-of-00003.safetensors",
                                                            "model-00002-of-00003.safetensors"])


# ------------------------------------------------------------------------------------------------------- helpers
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _scale(model, factor=3.0):
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    return model


def _randomize(module, seed, centred):
    """Every weight random at a useful scale: norms around 1 (zero-centred ones around 0), biases small,
    matrices ~ 1/sqrt(fan_in); the router's correction bias small."""
    g = _gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name):
                p.copy_((0.0 if centred else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return module


def _round(model, dtype):
    """Make every floating weight representable in ``dtype`` (the checkpoint's), keeping the model in fp32."""
    if dtype == torch.float32:
        return model
    with torch.no_grad():
        for t in model.state_dict().values():  # weights and persistent buffers (not the rotary inv_freq)
            if t.is_floating_point():
                t.copy_(t.to(dtype).float())
    return model


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes for ``model`` (the checkpoint names: MoE experts per expert)."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        state = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            state.update(load_file(str(f)))
    return state


def _built_config(published: dict):
    """The transformers config of a published config.json (remote-code and quantization fields left out)."""
    data = {k: v for k, v in published.items()
            if k not in ("auto_map", "quantization_config", "architectures", "torch_dtype", "transformers_version")}
    return AutoConfig.for_model(data.pop("model_type"), **data)


def sharded_files(config: dict, main: dict, mtp: dict, dtype=torch.float32, shards=3, single=False,
                  ) -> dict[str, bytes]:
    """The repo's files: the main tensors over ``shards - 1`` shards, the MTP tensors alone in the last one (or
    everything in one ``model.safetensors``), the index, config.json and generation_config.json."""
    def cast(state):
        return {k: (v.to(dtype) if v.is_floating_point() and v.dtype == torch.float32
                    and not k.endswith(("weight_scale_inv", "e_score_correction_bias")) else v).contiguous()
                for k, v in state.items()}

    main, mtp = cast(main), cast(mtp)
    files = {"config.json": json.dumps(config, indent=2).encode(),
             "generation_config.json": json.dumps({"bos_token_id": 2, "eos_token_id": 1}).encode()}
    if single:
        files["model.safetensors"] = save_safetensors({**main, **mtp}, metadata={"format": "pt"})
        return files
    keys = sorted(main)
    parts = [{k: main[k] for k in keys[i * len(keys) // (shards - 1):(i + 1) * len(keys) // (shards - 1)]}
             for i in range(shards - 1)] + [mtp]
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        files[name] = save_safetensors(part, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    files[INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                              indent=2).encode()
    return files


def _inputs(g, centred, hidden=H):
    """enorm / hnorm / projection / output norm of one module, random."""
    base = 0.0 if centred else 1.0
    return {"emb_norm": base + 0.2 * torch.randn(hidden, generator=g),
            "hid_norm": base + 0.2 * torch.randn(hidden, generator=g),
            "proj": torch.randn(hidden, 2 * hidden, generator=g) / math.sqrt(2 * hidden),
            "out_norm": base + 0.2 * torch.randn(hidden, generator=g)}


def _rounded_inputs(parts, dtype):
    return {k: v.to(dtype).float() for k, v in parts.items()}


# ------------------------------------------------------------------------------------- DeepSeek-V3 and GLM-4 MoE
def deepseek_config(num_mtp=1, fp8_block=None, dtype="float32") -> dict:
    """deepseek-ai/DeepSeek-V3's config.json field names, tiny sizes (2 layers, the first dense, 4 routed experts)."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "bos_token_id": 2, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 64, "kv_lora_rank": 16,
        "max_position_embeddings": 256, "model_type": "deepseek_v3", "moe_intermediate_size": 24,
        "moe_layer_freq": 1, "n_group": 2, "n_routed_experts": 4, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 4,
        "num_nextn_predict_layers": num_mtp, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
        "torch_dtype": dtype, "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 8,
        "vocab_size": V,
    }
    if fp8_block is not None:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": list(fp8_block)}
        cfg["torch_dtype"] = "bfloat16"
    return cfg


def glm4_moe_config(num_mtp=1) -> dict:
    """zai-org/GLM-4.5-Air's config.json field names, tiny sizes; its MTP layer sits at its own N = 3."""
    return {
        "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "pad_token_id": 0, "eos_token_id": [1], "head_dim": 8, "hidden_act": "silu", "hidden_size": H,
        "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 64,
        "max_position_embeddings": 256, "model_type": "glm4_moe", "moe_intermediate_size": 16,
        "norm_topk_prob": True, "num_attention_heads": 4, "n_group": 1, "topk_group": 1, "n_routed_experts": 4,
        "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 1000000, "num_nextn_predict_layers": num_mtp, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False,
        "vocab_size": V,
    }


def quantize_fp8(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: ``(q float8_e4m3fn, scale_inv fp32 [ceil(r/b0), ceil(c/b1)])``, ``w ~ q * scale``."""
    b0, b1 = block
    rows, cols = w.shape
    gr, gc = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.zeros(gr * b0, gc * b1)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(gr, b0, gc, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[:, None, :, None]).view(gr * b0, gc * b1)[:rows, :cols].to(FP8)
    return q, scale


def dequantized(q, scale, block):
    b0, b1 = block
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:q.shape[0], :q.shape[1]]
    return q.float() * full


# the linear weights DeepSeek-V3 stores in FP8 (attention projections, experts, shared experts; not the router)
_FP8_KEY = (r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
            r"|mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj)\.weight$")


def _load_back(layer, prefix, ckpt: dict[str, torch.Tensor]):
    """Put checkpoint-named tensors (per expert) back into a transformers MoE decoder layer (fused experts), by hand:
    ``gate_up_proj[e] = cat(gate_e, up_e)``, ``down_proj[e] = down_e``."""
    import re

    own = layer.state_dict()
    with torch.no_grad():
        for key, value in ckpt.items():
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)
            if m is None:
                own[rest].copy_(value.float())
                continue
            e, which = int(m[1]), m[2]
            if which == "down":
                own["mlp.experts.down_proj"][e].copy_(value.float())
            else:
                inter = value.shape[0]
                rows = slice(0, inter) if which == "gate" else slice(inter, 2 * inter)
                own["mlp.experts.gate_up_proj"][e, rows].copy_(value.float())


def deepseek_checkpoint(family="deepseek_v3", num_mtp=1, seed=0, fp8_block=None, single=False) -> Published:
    """DeepSeek-V3 (or GLM-4 MoE with ``family="glm4_moe"``): main model ``model.layers.{0..N-1}``, MTP modules at
    ``model.layers.{N+k}.*`` with the copies of the embedding and LM head DeepSeek stores. ``fp8_block``: the MTP
    block's linear weights in FP8 with ``weight_scale_inv`` (the main model stays bf16 here), the rest bf16."""
    published = deepseek_config(num_mtp, fp8_block) if family == "deepseek_v3" else glm4_moe_config(num_mtp)
    dtype = torch.bfloat16 if fp8_block else torch.float32
    text = _built_config(published)
    torch.manual_seed(seed)
    target = _round(_scale(AutoModelForCausalLM.from_config(text)).eval(), dtype)
    n = text.num_hidden_layers
    donor = AutoModelForCausalLM.from_config(text.get_mtp_config()).eval()  # its K layers are the MTP blocks (MoE)
    _round(_randomize(donor.model.layers, seed + 1, centred=False), dtype)
    g = _gen(seed + 2)
    mtp, modules = {}, []
    block_ckpt = checkpoint_state(donor)
    for k in range(num_mtp):
        prefix = f"model.layers.{n + k}."
        for key, value in block_ckpt.items():
            if key.startswith(f"model.layers.{k}."):
                mtp[prefix + key[len(f"model.layers.{k}."):]] = value
        parts = _rounded_inputs(_inputs(g, centred=False), dtype)
        mtp.update({prefix + "enorm.weight": parts["emb_norm"], prefix + "hnorm.weight": parts["hid_norm"],
                    prefix + "eh_proj.weight": parts["proj"], prefix + "shared_head.norm.weight": parts["out_norm"],
                    prefix + "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
                    prefix + "shared_head.head.weight": target.get_output_embeddings().weight.detach().clone()})
        modules.append({**parts, "block": donor.model.layers[k]})
    if fp8_block:
        import re

        for key in sorted(k for k in mtp if re.search(_FP8_KEY, k)):
            q, scale = quantize_fp8(mtp[key], fp8_block)
            mtp[key], mtp[key + "_scale_inv"] = q, scale
            mtp[key + "_deq"] = dequantized(q, scale, fp8_block)
        for k in range(num_mtp):  # the reference block holds the dequantized weights
            deq = {key[:-4]: v for key, v in mtp.items() if key.endswith("_deq")}
            _load_back(donor.model.layers[k], f"model.layers.{n + k}.", deq)
        mtp = {k: v for k, v in mtp.items() if not k.endswith("_deq")}
    main = checkpoint_state(target)
    files = sharded_files(published, main, mtp, dtype=dtype, single=single)
    return Published(files, published, target, modules, "deepseek", False, text.rms_norm_eps, n, main, mtp, dtype)


# ------------------------------------------------------------------------------------------ Qwen3-Next and Qwen3.5
def qwen3_next_config(num_mtp=1) -> dict:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json field names, tiny sizes: 2 layers, linear attention then full
    attention (``full_attention_interval: 2``), MoE with a shared expert."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 2, "decoder_sparse_step": 1, "eos_token_id": 1, "full_attention_interval": 2,
        "head_dim": 16, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 64,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 8, "max_position_embeddings": 256,
        "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 16, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "num_nextn_predict_layers": num_mtp, "output_router_logits": False,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 16, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.57.0.dev0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": V,
    }


def qwen3_5_config(num_mtp=1) -> dict:
    """Qwen/Qwen3.5-0.8B's config.json field names (a vision-language model nesting ``text_config`` with
    ``mtp_num_hidden_layers``), tiny sizes: 2 text layers (linear, full attention), a 1-layer vision tower."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 93, "model_type": "qwen3_5",
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 2,
            "dtype": "float32", "eos_token_id": 1, "full_attention_interval": 2, "head_dim": 16,
            "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 64,
            "layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_value_head_dim": 8, "max_position_embeddings": 256, "model_type": "qwen3_5_text",
            "mtp_num_hidden_layers": num_mtp, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default",
                                "rope_theta": 10000000, "partial_rotary_factor": 0.5},
            "tie_word_embeddings": False, "use_cache": True, "vocab_size": V,
        },
        "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 92,
        "vision_config": {"deepstack_visual_indexes": [], "depth": 1, "hidden_act": "gelu_pytorch_tanh",
                          "hidden_size": 16, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 32,
                          "model_type": "qwen3_5", "num_heads": 2, "num_position_embeddings": 16,
                          "out_hidden_size": H, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 1},
        "vision_end_token_id": 91, "vision_start_token_id": 90,
    }


def qwen3_next_checkpoint(family="qwen3_next", num_mtp=1, seed=0) -> Published:
    """Qwen3-Next (or Qwen3.5 dense with ``family="qwen3_5"``): ``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``,
    ``mtp.norm`` and full-attention decoder layers ``mtp.layers.{k}.*`` beside the main model's keys."""
    import re

    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    published = qwen3_next_config(num_mtp) if family == "qwen3_next" else qwen3_5_config(num_mtp)
    full = _built_config(published)
    text = full.get_text_config()
    torch.manual_seed(seed)
    if family == "qwen3_5":
        whole = _scale(Qwen3_5ForConditionalGeneration(full)).eval()
        main = checkpoint_state(whole)  # model.language_model.*, model.visual.*, lm_head.weight
        target = Qwen3_5ForCausalLM(text).eval()
        target.model.load_state_dict(whole.model.language_model.state_dict())
        target.lm_head.load_state_dict(whole.lm_head.state_dict())
    else:
        target = _scale(AutoModelForCausalLM.from_config(text)).eval()
        main = checkpoint_state(target)
    donor_cfg = copy.deepcopy(text)
    donor_cfg.num_hidden_layers = num_mtp
    donor_cfg.layer_types = ["full_attention"] * num_mtp
    donor = AutoModelForCausalLM.from_config(donor_cfg).eval()
    _randomize(donor.model.layers, seed + 1, centred=True)
    mtp = {}
    for key, value in checkpoint_state(donor).items():
        m = re.fullmatch(r"model\.(?:language_model\.)?layers\.(\d+)\.(.+)", key)
        if m is not None:
            mtp[f"mtp.layers.{m[1]}.{m[2]}"] = value
    parts = _inputs(_gen(seed + 2), centred=True)
    mtp.update({"mtp.pre_fc_norm_embedding.weight": parts["emb_norm"], "mtp.pre_fc_norm_hidden.weight":
                parts["hid_norm"], "mtp.fc.weight": parts["proj"], "mtp.norm.weight": parts["out_norm"]})
    modules = [{**parts, "block": donor.model.layers[k]} for k in range(num_mtp)]
    files = sharded_files(published, main, mtp)
    return Published(files, published, target, modules, "qwen3_next", True, text.rms_norm_eps,
                     text.num_hidden_layers, main, mtp)


# ------------------------------------------------------------------------------------------------------------ MiMo
def mimo_config(num_mtp=1) -> dict:
    """XiaomiMiMo/MiMo-7B-RL's config.json field names (remote code ``modeling_mimo.MiMoForCausalLM``), tiny sizes."""
    return {
        "architectures": ["MiMoForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_mimo.MiMoConfig", "AutoModel": "modeling_mimo.MiMoModel",
                     "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"},
        "bos_token_id": 2, "eos_token_id": 1, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
        "intermediate_size": 64, "max_position_embeddings": 256, "max_window_layers": 2, "model_type": "mimo",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "num_nextn_predict_layers": num_mtp, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 640000,
        "sliding_window": 256, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": V,
    }


def mimo_qwen2_config(published: dict):
    """The Qwen2Config the fixture builds the main model from (written here, independently of the converter)."""
    from transformers import Qwen2Config

    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "use_sliding_window", "sliding_window")
    return Qwen2Config(**{k: published[k] for k in keep})


def mimo_checkpoint(num_mtp=1, seed=0) -> Published:
    """MiMo-7B: the Qwen2 main model's ``model.*`` / ``lm_head.weight`` and ``model.mtp_layers.{k}.*`` with the
    names of the remote code's ``MiMoMTPLayers`` (q/k/v biases)."""
    from transformers import Qwen2ForCausalLM

    published = mimo_config(num_mtp)
    qcfg = mimo_qwen2_config(published)
    torch.manual_seed(seed)
    target = _scale(Qwen2ForCausalLM(qcfg)).eval()
    g = _gen(seed + 1)
    h, inter, heads, kv = H, published["intermediate_size"], 4, 2
    hd = h // heads

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def vec(n, base=0.0, s=0.1):
        return base + s * torch.randn(n, generator=g)

    mtp, modules = {}, []
    for k in range(num_mtp):
        parts = _inputs(g, centred=False)
        block = {"input_layernorm.weight": vec(h, 1.0, 0.2), "post_attention_layernorm.weight": vec(h, 1.0, 0.2),
                 "self_attn.q_proj.weight": mat(heads * hd, h), "self_attn.q_proj.bias": vec(heads * hd),
                 "self_attn.k_proj.weight": mat(kv * hd, h), "self_attn.k_proj.bias": vec(kv * hd),
                 "self_attn.v_proj.weight": mat(kv * hd, h), "self_attn.v_proj.bias": vec(kv * hd),
                 "self_attn.o_proj.weight": mat(h, heads * hd), "mlp.gate_proj.weight": mat(inter, h),
                 "mlp.up_proj.weight": mat(inter, h), "mlp.down_proj.weight": mat(h, inter)}
        prefix = f"model.mtp_layers.{k}."
        mtp.update({prefix + name: v for name, v in block.items()})
        mtp.update({prefix + "token_layernorm.weight": parts["emb_norm"],
                    prefix + "hidden_layernorm.weight": parts["hid_norm"],
                    prefix + "input_proj.weight": parts["proj"], prefix + "final_layernorm.weight": parts["out_norm"]})
        modules.append({**parts, "block": block})
    main = checkpoint_state(target)
    files = sharded_files(published, main, mtp)
    return Published(files, published, target, modules, "mimo", False, published["rms_norm_eps"],
                     published["num_hidden_layers"], main, mtp)


def checkpoint(kind: str, **kw) -> Published:
    """One of the published kinds: deepseek_v3, glm4_moe, qwen3_next, qwen3_5, mimo."""
    if kind in ("deepseek_v3", "glm4_moe"):
        return deepseek_checkpoint(kind, **kw)
    if kind in ("qwen3_next", "qwen3_5"):
        return qwen3_next_checkpoint(kind, **kw)
    if kind == "mimo":
        return mimo_checkpoint(**kw)
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------------------- fake Hub
class FakeHub:
    """A Hub to download from: repos are staged (with ``write_cached_repo``) in a separate "remote" folder, and
    ``snapshot_download`` copies into the local Hub cache only the files ``allow_patterns`` match, at the commit the
    revision names (a branch, tag or commit hash), as huggingface_hub does. ``calls`` records
    ``(repo, revision, allow_patterns)``."""

    def __init__(self, remote: Path, cache: Path):
        self.remote, self.cache, self.calls = Path(remote), Path(cache), []

    def add(self, repo: str, files: dict[str, bytes], ref: str = "main") -> str:
        from hf_specdec.hub_cache import write_cached_repo

        main = self._repo(self.remote, repo) / "refs" / "main"
        before = main.read_text() if main.exists() else None
        snapshot = write_cached_repo(self.remote, repo, files)
        if ref != "main":
            (main.parent / ref).parent.mkdir(parents=True, exist_ok=True)
            (main.parent / ref).write_text(snapshot.name)
            if before is not None:
                main.write_text(before)
        return snapshot.name

    @staticmethod
    def _repo(root, repo):
        return Path(root) / f"models--{repo.replace('/', '--')}"

    def snapshot_download(self, repo_id, revision=None, allow_patterns=None, **kwargs):
        self.calls.append((repo_id, revision, list(allow_patterns) if allow_patterns else None))
        remote = self._repo(self.remote, repo_id)
        revision = revision or "main"
        ref = remote / "refs" / revision
        commit = ref.read_text() if ref.is_file() else revision
        source = remote / "snapshots" / commit
        if not source.is_dir():
            raise FileNotFoundError(f"{repo_id} has no revision {revision}")
        local = self._repo(self.cache, repo_id)
        snapshot = local / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if allow_patterns is None or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copyfile(f, snapshot / f.name)
        (local / "refs").mkdir(parents=True, exist_ok=True)
        if ref.is_file():
            (local / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
            (local / "refs" / revision).write_text(commit)
        return str(snapshot)
