"""The decoding loop on a GPU at a fixed acceptance length: every method's real drafter, a Llama-3.1-8B-shaped target.

    python benchmarks/gpu.py                      # one H100/H200-class GPU, at most ~8 minutes, nothing downloaded
    python benchmarks/gpu.py --tau 2,4,6 --methods eagle3,dflash --steps 32 --out gpu_out
    python benchmarks/gpu.py --tiny               # the same on the CPU with a tiny config, in under a minute

What runs (random weights, built on the device as vLLM's ``load_format="dummy"`` does: no checkpoint, no download):

* target: ``LlamaForCausalLM`` with Llama-3.1-8B's config (hidden 4096, 32 layers, 32 heads, 8 KV heads,
  intermediate 14336, vocabulary 128256, RoPE theta 500000 with the published llama3 scaling), bf16, sdpa.
  Its weights are random except for one structure that makes its greedy continuation robust to rounding: the
  embedding rows are large next to what the layers add to the residual stream (``o_proj`` / ``down_proj`` small) and
  the LM head is the embedding permuted, so the next token is a fixed permutation of the current one by a wide
  margin. A forward costs exactly what it costs with any other values; the reference continuation (plain greedy
  ``generate()``) is then what every verification in bf16 reproduces, so the replayed acceptance below is exact.
* drafters at the published shapes for that target, built with random weights through hf_specdec's own modeling
  classes: EAGLE-3 (``Eagle3Drafter``: one decoder layer, features of layers [2, 16, 29], draft vocabulary 32000
  with ``d2t`` / ``t2d`` maps, RoPE theta 10000 as the yuhuili checkpoint; its head is scaled so that its
  distributions are peaked, as a trained drafter's are, which is what gives the dynamic tree its depth), Medusa
  (``MedusaHeads``, 5 heads of one residual block, the mc_sim_7b_63 tree), MTP (``MTPModule``, one DeepSeek-style
  module whose block is a Llama decoder layer), DFlash (``DFlashDrafter``: 5 layers, block 16, taps [1, 8, 15, 22,
  29], mask token 128002; the z-lab Llama-3.1-8B drafter's layer count is not in our reference notes, so this takes
  the published Qwen3-8B-DFlash-b16 shape, with the target's intermediate size) and a one-layer draft model
  (``assisted``: the target's config with one decoder layer). The drafter-free methods (prompt lookup, suffix
  decoding, lookahead) need no drafter but something to copy: when one of them runs, the prompt of every row holds
  the continuation (:func:`copy_prompt`; it is then ``prompt-len + new tokens + 3`` tokens long). LayerSkip is not
  replayed: its verification reuses the early layers its drafts went through, so rewritten tokens would not be the
  ones those layers saw.
* the replay (:class:`hf_specdec.bench.oracle.ReplayProposer`): each method's proposer runs unchanged, draft
  schedule constant, and its tree's tokens are rewritten on the device so that exactly ``tau - 1`` drafts are
  accepted per step (the reference continuation along one path of the tree, wrong tokens elsewhere; the tree keeps
  its shape). Chains (assisted, MTP) draft ``--chain-length`` tokens (default ``tau - 1``); EAGLE-3 the reference
  tree (top-k 10, depth 7, 60 tokens); DFlash a full block; prompt lookup and suffix decoding chains of
  ``--chain-length``, lookahead n-grams of ``--chain-length + 1``. With ``--compile both`` (the default on a GPU)
  every hf_specdec method also runs with ``compile=True`` (rows ``<method>+compile``).
* beside them, in the same run: stock ``generate()`` (greedy), ``stock_compiled`` (transformers' own fast path for
  plain decoding, as it documents it: ``cache_implementation="static"``, whose one-token decode step ``generate()``
  compiles with ``mode="reduce-overhead"``, CUDA graphs, on a GPU; on a CPU transformers compiles nothing, so there
  it is the static cache alone) and transformers' assisted decoding with the target itself as assistant
  (``hf_assisted``: a second handle on the same weights, ``num_assistant_tokens = tau - 1``, constant schedule: full
  acceptance, so the same tau).

Measured per method (greedy, at each ``--batch`` size, default 1: one set of prompts per size, ``--reps`` timed
calls after an untimed warm-up; medians; ``tok/s`` counts every row's tokens):

* ``ms/step``: wall time of the call less its first target forward (the prefill), per step (target forwards after
  the first); ``tau``: tokens committed per step.
* ``target ms/step`` and ``draft ms/step`` (both ``–`` under ``compile=True``: a compiled forward, a drafter's
  inside a compiled region or CUDA graph, passes no module hook, so their time stays in ``host ms/step``, and
  ``ideal`` / ``efficiency`` are ``–`` too): time inside the target's and the drafter's forwards (hooks on the
  modules; on CUDA, events recorded around each forward and read after the call, so the span a forward occupies on
  the device timeline, no synchronisation added; on the CPU, ``perf_counter``).
* ``host ms/step`` = ``ms/step - target ms/step - draft ms/step - replay ms/step``: the part of a step outside every
  forward, i.e. the loop's own work (acceptance, commit, cache and tree bookkeeping, the proposer's Python); on CUDA,
  the time per step the device spends outside any forward (waiting for the host). ``replay ms/step`` is the
  benchmark's own token rewrite, measured and taken out.
* ``syncs/step``: host reads of tensor values (:class:`hf_specdec.syncs.SyncCounter`) over the steps, in one extra,
  untimed call (counting intercepts every torch call); on CUDA the same call also counts the synchronisations the
  CUDA runtime reports (``torch.cuda.set_sync_debug_mode("warn")``): ``cuda syncs/step``.
* ``launches/step``: the kernels the host starts per step (:class:`hf_specdec.launches.LaunchCounter`, in another
  untimed call: each operation that does work outside a compiled region one, each compiled region, a graph replay on
  a GPU, one; the stock rows have no step ranges, so theirs is the whole call over its forwards, prefill included).
* ``warm-up s``: the untimed first call of the row (where ``compile=true`` and ``stock_compiled`` compile and capture).
* ``graphs recorded (timed)``: CUDA graphs recorded during the timed calls
  (:func:`hf_specdec.graphs.counting_captures`): 0 where the warm-up's graphs, and the static caches they were
  recorded over, are kept and replayed.
* ``speedup``: stock ``generate()``'s time per decoded token over the method's (first forward excluded from both);
  ``over stock_compiled``: the same against ``stock_compiled``.
* ``ideal``: the speedup the method's forwards would give with no drafting and no overhead:
  ``decoded tokens / sum over its verification forwards of c(q) / c(1)``, with ``c(q)`` the measured time of a target
  forward over ``q`` new tokens (``hf_specdec.bench.probes.forward_cost_curve``, the cache filled to the middle of the
  run); for a constant tree of ``N`` nodes that is ``tau * c(1) / c(N)``.
* ``efficiency = speedup / ideal``: what drafting and the loop's overhead leave of the ideal (1.0: none).

Outputs ``<out>/gpu_bench.json`` (``schema: "hf_specdec.gpu_bench/1"``; ``rows``: one record per (tau, method) with
the fields above, ``identical``: the output equals stock ``generate()``'s) and ``<out>/gpu_bench.md``; the table is
printed. ``--loop-option KEY=VALUE`` passes a loop option (``hf_specdec.registry.LOOP_OPTIONS``, e.g. ``compile=true``:
its compilation then falls in each row's untimed warm-up, and the run may need more than 8 minutes) to every hf_specdec
method. No new row starts after ``--time-limit`` seconds (default 420; the rows left out are listed under ``skipped``).
Nothing here is timed by a test (``tests/test_gpu_bench.py`` runs ``--tiny`` for the report's shape).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import warnings
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from hf_specdec.bench.probes import ForwardProbe
from hf_specdec.graphs import counting_captures

SCHEMA = "hf_specdec.gpu_bench/1"
METHODS = ("eagle3", "medusa", "mtp", "dflash", "assisted", "prompt_lookup", "suffix", "lookahead",
           "hf_assisted")  # stock generate() and stock_compiled always run
LOOKUP = ("prompt_lookup", "suffix", "lookahead")  # drafter-free: the prompt holds the continuation (see copy_prompt)
COMPILE_SUFFIX = "+compile"  # a row of a method run with compile=True
MEDUSA_HEADS = 5
EAGLE3_TREE = {"top_k": 10, "depth": 7, "total_tokens": 60}  # the reference's (EaModel defaults)
TINY_EAGLE3_TREE = {"top_k": 4, "depth": 5, "total_tokens": 16}
DFLASH_LAYERS, DFLASH_BLOCK, DFLASH_MASK = 5, 16, 128002  # mask: <|reserved_special_token_0|>, a reserved row
EAGLE3_DRAFT_VOCAB = 32000
DEADLINE_S = 420  # stop starting new rows past this (the run's promise: at most 8 minutes on one GPU)


# ------------------------------------------------------------------------------------------------------ configs
def target_config(tiny: bool):
    """Llama-3.1-8B's config (meta-llama/Llama-3.1-8B config.json), or a tiny one of the same family."""
    from transformers import LlamaConfig

    if tiny:
        fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=16384)
    else:
        fields = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072)
    config = LlamaConfig(rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         **fields)
    config._attn_implementation = "sdpa"  # a 4D tree mask is honoured by sdpa (not by flash attention)
    return config


@contextmanager
def _building(device, dtype):
    """Modules built inside are allocated on ``device`` in ``dtype`` (no CPU copy, no float32 detour)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def build_target(config, device, dtype, seed: int = 0):
    """``(model, perm)``: the target with random weights (see the module docstring), whose greedy next token is
    ``perm[current]``."""
    from transformers import LlamaForCausalLM

    with _building(device, dtype):
        model = LlamaForCausalLM(config)
    g = torch.Generator(device=device).manual_seed(seed)
    small = 1e-3  # o_proj / down_proj: what each layer adds stays well below the embedding's scale
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, small if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02, generator=g)
    emb = model.get_input_embeddings().weight
    emb.normal_(0.0, 1.0, generator=g)
    perm = torch.randperm(config.vocab_size, generator=g, device=device)
    model.get_output_embeddings().weight[perm] = emb  # logits[v] = <h, e[t]> for v = perm[t]: largest at t = current
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    return model.eval(), perm


@torch.no_grad()
def build_drafters(target, names, tiny: bool, device, dtype, seed: int = 1) -> dict:
    """The drafters of ``names`` at the published shapes for the target (tiny shapes with ``tiny``), random weights,
    built through hf_specdec's modeling classes."""
    from transformers import LlamaForCausalLM

    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
    from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
    from hf_specdec.modeling.mtp import MTPConfig, MTPModule, block_config_for

    cfg = target.config
    hidden, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    torch.manual_seed(seed)
    drafters = {}
    with _building(device, dtype):
        if "eagle3" in names:
            draft_vocab = 64 if tiny else EAGLE3_DRAFT_VOCAB
            drafter = Eagle3Drafter(Eagle3Config(
                hidden_size=hidden, intermediate_size=cfg.intermediate_size, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab,
                num_target_layers=layers, rope_theta=10000.0))
            used = torch.randperm(vocab, device=device)[:draft_vocab].sort().values
            drafter.d2t.copy_(used - torch.arange(draft_vocab, device=device))
            drafter.t2d.zero_()
            drafter.t2d[used] = True
            drafter.lm_head.weight.mul_(25.0)  # peaked distributions (a trained drafter's): the tree gets its depth
            drafters["eagle3"] = drafter.eval()
        if "medusa" in names:
            drafters["medusa"] = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=vocab,
                                                          medusa_num_heads=MEDUSA_HEADS, medusa_num_layers=1)).eval()
        if "mtp" in names:
            drafters["mtp"] = MTPModule(MTPConfig(block_config=block_config_for(cfg, 1), num_modules=1,
                                                  layout="deepseek", vocab_size=vocab,
                                                  num_target_layers=layers)).eval()
        if "dflash" in names:
            drafters["dflash"] = DFlashDrafter(DFlashConfig(
                hidden_size=hidden, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=2 if tiny else DFLASH_LAYERS, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, vocab_size=vocab, block_size=8 if tiny else DFLASH_BLOCK,
                mask_token_id=vocab - 1 if tiny else DFLASH_MASK, num_target_layers=layers,
                rope_theta=500000.0)).eval()
        if "assisted" in names:
            one = copy.deepcopy(cfg)
            one.num_hidden_layers = 1
            draft = LlamaForCausalLM(one).eval()
            draft.generation_config = copy.deepcopy(target.generation_config)
            drafters["assisted"] = draft
    return drafters


def proposer_options(name: str, tau: int, chain_length: int | None, tiny: bool) -> dict:
    """The method options of ``name`` for the run (constant draft schedule)."""
    chain = chain_length if chain_length is not None else max(tau - 1, 1)
    opts = {"draft_length_schedule": "constant"}
    if name == "eagle3":
        tree = TINY_EAGLE3_TREE if tiny else EAGLE3_TREE
        opts.update({f"tree_{k}": v for k, v in tree.items()})
    elif name == "medusa":
        opts["medusa_choices"] = "mc_sim_7b_63"
    elif name in ("mtp", "assisted"):
        opts["num_speculative_tokens"] = chain
    elif name == "prompt_lookup":
        opts.update(prompt_lookup_num_tokens=chain, max_matching_ngram_size=2)
    elif name == "suffix":
        opts.update(max_spec_tokens=chain, use_tree_spec=False)
    elif name == "lookahead":
        opts.update(ngram_size=max(chain, 1) + 1, window_size=3, guess_set_size=3)
    return opts


def copy_prompt(perm: torch.LongTensor, prompt_len: int, new_tokens: int, start: int = 1) -> torch.LongTensor:
    """``[1, prompt_len + new_tokens + 3]``: a prompt whose greedy continuation appears in it, for the drafter-free
    methods. With ``c`` the chain ``start, perm[start], perm[perm[start]], ...`` (the target's greedy walk), the prompt
    is ``c[P-3 : P+N]`` then ``c[0 : P]``: it ends at ``c[P-1]``, and the bigram before every next token of the
    continuation occurs in its first part, followed by that continuation (prompt lookup, suffix decoding and
    lookahead's pool find it; the replay still fixes their acceptance at ``tau - 1``)."""
    table = perm.cpu().tolist()
    chain = [start]
    for _ in range(prompt_len + new_tokens):
        chain.append(table[chain[-1]])
    tokens = chain[prompt_len - 3: prompt_len + new_tokens] + chain[:prompt_len]
    return torch.tensor([tokens], device=perm.device)


def deepest_draft(name: str, tau: int, chain_length: int | None, tiny: bool) -> int:
    """The most drafts one step of ``name`` can accept with these options."""
    chain = chain_length if chain_length is not None else max(tau - 1, 1)
    name = name.removesuffix(COMPILE_SUFFIX)
    return {"eagle3": (TINY_EAGLE3_TREE if tiny else EAGLE3_TREE)["depth"], "medusa": MEDUSA_HEADS,
            "dflash": (8 if tiny else DFLASH_BLOCK) - 1, "lookahead": chain}.get(name, chain)


# ----------------------------------------------------------------------------------------------------- measuring
def Forwards(module) -> ForwardProbe:
    """Times the ``forward`` calls of one module object (hooks on it alone): ``perf_counter`` on the CPU, CUDA events
    on a GPU (read after the caller synchronised); ``sizes``: new tokens per call."""
    return ForwardProbe(module, time_calls=True, by_last_layer=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _cuda_sync_warnings(active: bool):
    """Inside: the CUDA runtime reports every synchronising operation (``torch.cuda.set_sync_debug_mode("warn")``);
    yields the list of what it reported (empty when not ``active``)."""
    if not active:
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def assistant_handle(model, num_tokens: int):
    """A second handle on the target's weights for transformers' assisted mode: its own hooks (so its forwards are
    timed as drafting) and its own generation config (constant schedule, ``num_tokens`` drafts)."""
    handle = copy.copy(model)  # shares every submodule and parameter
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(model, attr):
            object.__setattr__(handle, attr, OrderedDict())
    handle.generation_config = copy.deepcopy(model.generation_config)
    handle.generation_config.num_assistant_tokens = num_tokens
    handle.generation_config.num_assistant_tokens_schedule = "constant"
    handle.generation_config.assistant_confidence_threshold = 0.0
    return handle


class Runner:
    """One (tau) round: builds each row's generate call and measures it."""

    def __init__(self, model, drafters, enc, reference, args, loop_options):
        self.model, self.drafters, self.enc, self.reference = model, drafters, enc, reference
        self.args, self.loop_options = args, loop_options
        self.device = model.device
        self.target = Forwards(model)
        self.drafter_forwards = {name: Forwards(d) for name, d in drafters.items()}

    def call(self, name: str, tau: int):
        """``(kwargs for generate, drafter Forwards or None, replay proposer or None, tokens of the first forward)``."""
        import hf_specdec
        from hf_specdec.bench.oracle import ReplayProposer

        gen = dict(max_new_tokens=self.args.new_tokens[tau], do_sample=False)
        if name == "stock":
            return gen, None, None, 1
        if name == "stock_compiled":  # transformers' fast path: a static cache, its decode step auto-compiled on a GPU
            return {**gen, "cache_implementation": "static"}, None, None, 1
        if name == "hf_assisted":
            handle = assistant_handle(self.model, max(tau - 1, 1))
            return {**gen, "assistant_model": handle}, Forwards(handle), None, tau
        base = name.removesuffix(COMPILE_SUFFIX)
        opts = proposer_options(base, tau, self.args.chain_length, self.args.tiny)
        if base in self.drafters:
            opts["drafter"] = self.drafters[base]
        inner = hf_specdec.build_proposer(base, self.model, **opts)
        replay = ReplayProposer(inner, self.reference, tau - 1, self.model.config.vocab_size)
        # compiled rows: the target's graphs live on its runner (one per model), so later calls reuse them
        loop = {**self.loop_options, **({"compile": True} if name.endswith(COMPILE_SUFFIX) else {})}
        method = hf_specdec.decoding_method(replay, **loop)
        return ({**gen, "custom_generate": method, "return_dict_in_generate": True},
                self.drafter_forwards.get(base), replay, 1)

    def run(self, name: str, tau: int, counter=None, cuda_syncs: list | None = None):
        """One call of row ``name``; with ``counter`` (a SyncCounter) active around ``generate()``, and with
        ``cuda_syncs`` (a list) the CUDA runtime's synchronisation warnings of the call appended to it."""
        kwargs, dprobe, replay, first_commit = self.call(name, tau)
        self.target.reset()
        if dprobe is not None:
            dprobe.reset()
        _sync(self.device)
        t0 = time.perf_counter()
        with counter if counter is not None else nullcontext(), _cuda_sync_warnings(cuda_syncs is not None) as caught:
            out = self.model.generate(**self.enc, **kwargs)
        if cuda_syncs is not None:
            cuda_syncs.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))
        _sync(self.device)
        wall = time.perf_counter() - t0
        sequences = out.sequences if hasattr(out, "sequences") else out
        record = dict(wall=wall, sequences=sequences, stats=getattr(out, "speculative_stats", None),
                      target_sizes=list(self.target.sizes), target_seconds=list(self.target.seconds),
                      draft_seconds=list(dprobe.seconds) if dprobe is not None else [],
                      replay_seconds=replay.replay_seconds if replay is not None else 0.0, first_commit=first_commit)
        if name == "hf_assisted":
            dprobe.remove()
        return record

    def count_syncs(self, name: str, tau: int) -> dict:
        """Host reads per call (SyncCounter), on CUDA the synchronisations the runtime reports, and in another call
        the kernels the host starts per step (LaunchCounter; stock rows have no step ranges: their whole call over
        their forwards, the prefill's included). Apart: dynamo traces SyncCounter's function mode, which would split
        and recompile the compiled regions of a compile=True row."""
        from hf_specdec.launches import LaunchCounter
        from hf_specdec.syncs import SyncCounter

        counter = SyncCounter()
        cuda_syncs = [] if self.device.type == "cuda" and self.args.cuda_sync_debug else None
        record = self.run(name, tau, counter, cuda_syncs)
        with LaunchCounter() as launches:
            self.run(name, tau)
        steps = _steps(record)
        return {"syncs": counter.count, "steps": steps, "syncs_per_step": counter.count / steps,
                "syncs_by_name": dict(counter.by_name.most_common()),
                "cuda_syncs_per_step": len(cuda_syncs) / steps if cuda_syncs is not None else None,
                "launches_per_step": launches.per_step() if launches.steps else launches.outside / (steps + 1)}

    def close(self):
        self.target.remove()
        for f in self.drafter_forwards.values():
            f.remove()


def _hooks_missed(record: dict) -> bool:
    """compile=True: the compiled verification bypasses the module's hooks (only the prefill was timed)."""
    return bool(record["stats"]) and record["stats"]["target_forward_passes"] > len(record["target_sizes"])


def _steps(record: dict) -> int:
    """Target forwards after the prefill: the probe's count, or the loop's own where the probe missed them."""
    if _hooks_missed(record):
        return max(record["stats"]["target_forward_passes"] - 1, 1)
    return max(len(record["target_sizes"]) - 1, 1)


def summarize(name: str, tau: int, records: list[dict], prompt_len: int) -> dict:
    """One row from the timed calls of a method (medians over the calls)."""
    per_call = []
    for r in records:
        new = int(r["sequences"].shape[1] - prompt_len)
        steps = _steps(r)
        first = r["target_seconds"][0] if r["target_seconds"] else 0.0
        decode = r["wall"] - first
        decoded = max(new - min(r["first_commit"], new), 1)
        target = sum(r["target_seconds"][1:])
        draft = sum(r["draft_seconds"])
        per_call.append(dict(
            new_tokens=new, steps=steps, tau=decoded / steps, verify_sizes=r["target_sizes"][1:],
            ms_per_step=1000 * decode / steps, target_ms_per_step=1000 * target / steps,
            draft_ms_per_step=1000 * draft / steps, replay_ms_per_step=1000 * r["replay_seconds"] / steps,
            host_ms_per_step=1000 * (decode - target - draft - r["replay_seconds"]) / steps,
            ms_per_token=1000 * decode / decoded, tokens_per_s=new * r["sequences"].shape[0] / r["wall"],
            decoded=decoded))
    row = {"method": name, "tau_target": tau, "calls": len(per_call)}
    for key in ("tau", "ms_per_step", "target_ms_per_step", "draft_ms_per_step", "replay_ms_per_step",
                "host_ms_per_step", "ms_per_token", "tokens_per_s"):
        row[key] = statistics.median(c[key] for c in per_call)
    row.update(new_tokens=per_call[0]["new_tokens"], steps=per_call[0]["steps"],
               verify_sizes=per_call[0]["verify_sizes"], decoded=per_call[0]["decoded"])
    row["verify_size"] = statistics.mean(row["verify_sizes"]) if row["verify_sizes"] else None
    if _hooks_missed(records[0]):  # the target's time is inside the host column: unknown apart
        row["target_ms_per_step"] = None
    if name.endswith("+compile"):  # the drafters' forwards run inside compiled regions (CUDA graphs): no hook either
        row["draft_ms_per_step"] = None
    stats = records[0]["stats"]
    if stats:
        row["accepted_drafts"], row["proposed_drafts"] = stats["accepted_drafts"], stats["proposed_drafts"]
        row["accept_histogram"] = stats["accept_histogram"]
    return row


def ideal_speedup(row: dict, curve_ms: dict) -> float:
    """Decoded tokens over the cost of the row's verification forwards in one-token forwards (``c(q) / c(1)``)."""
    cost = sum(curve_ms[q] / curve_ms[1] for q in row["verify_sizes"])
    return row["decoded"] / cost if cost else 1.0


# ------------------------------------------------------------------------------------------------------- report
_COLUMNS = (("method", "method", ""), ("τ", "tau", ".2f"), ("verify size", "verify_size", ".1f"),
            ("ms/step", "ms_per_step", ".2f"), ("target ms/step", "target_ms_per_step", ".2f"),
            ("draft ms/step", "draft_ms_per_step", ".2f"), ("host ms/step", "host_ms_per_step", ".2f"),
            ("syncs/step", "syncs_per_step", ".1f"), ("cuda syncs/step", "cuda_syncs_per_step", ".1f"),
            ("launches/step", "launches_per_step", ".0f"), ("tok/s", "tokens_per_s", ".1f"),
            ("speedup", "speedup", ".2fx"), ("over stock_compiled", "speedup_vs_compiled", ".2fx"),
            ("ideal", "ideal_speedup", ".2fx"), ("efficiency", "efficiency", ".2f"),
            ("warm-up s", "warmup_seconds", ".1f"), ("graphs recorded (timed)", "graphs_recorded_timed", ""),
            ("identical", "identical", ""))


def _cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if fmt.endswith("x"):
        return format(value, fmt[:-1]) + "x"
    return format(value, fmt)


def markdown(result: dict) -> str:
    rows = result["rows"]
    columns = [c for c in _COLUMNS if c[1] != "cuda_syncs_per_step" or any(r.get(c[1]) is not None for r in rows)]
    lines = []
    for tau, batch in dict.fromkeys((r["tau_target"], r.get("batch", 1)) for r in rows):
        lines += ["", f"τ = {tau}, batch {batch} ({result['machine']['device_name']}, {result['config']['target']}, "
                      f"{result['config']['dtype']}, {result['config']['max_new_tokens'][str(tau)]} new tokens, "
                      f"prompt {result['config']['prompt_len']})", "",
                  "| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
        for r in rows:
            if (r["tau_target"], r.get("batch", 1)) == (tau, batch):
                lines.append("| " + " | ".join(_cell(r.get(k), f) for _, k, f in columns) + " |")
    curve = result["cost_curve_ms"]
    points = sorted(curve.items(), key=lambda kv: int(kv[0]))
    lines += ["", "Target forward c(q) (ms, q new tokens): " + ", ".join(f"{q}: {ms:.2f}" for q, ms in points)]
    if result.get("noise_ms"):
        lines += ["", "Coupled sampling's noise, a fresh block (ms): " + ", ".join(
            f"{k}: {v:.3f}" for k, v in result["noise_ms"].items())]
    if result.get("skipped"):
        lines += ["", "Skipped (past the time limit): " + ", ".join(result["skipped"])]
    return "\n".join(lines).lstrip("\n")


def noise_cost(device, vocab: int, reps: int = 20) -> dict:
    """Coupled sampling's noise (:class:`hf_specdec.coupling.CoupledNoise`) at the target's vocabulary: ms to make
    a fresh block of ``width`` positions for ``batch`` rows (what a step costs is about one position per committed
    token per row: the block keeps the positions it made), median of ``reps``."""
    from hf_specdec.coupling import CoupledNoise

    out = {}
    for batch, width in ((1, 1), (1, 8), (8, 1), (8, 8)):
        times = []
        for r in range(reps + 1):
            noise = CoupledNoise(seed=r, batch_size=batch, vocab=vocab, device=device)
            _sync(device)
            t0 = time.perf_counter()
            noise.block([0] * batch, width)
            _sync(device)
            if r:  # the first one builds the vocabulary's keys
                times.append((time.perf_counter() - t0) * 1e3)
        out[f"batch {batch}, {width} positions"] = statistics.median(times)
    return out


def _machine(device) -> dict:
    import transformers

    from hf_specdec.dtypes import cpu_name

    cpu = cpu_name()
    return {"platform": platform.platform(), "cpu": cpu, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu})",
            "torch_threads": torch.get_num_threads()}


# --------------------------------------------------------------------------------------------------------- main
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1 (tau 1: no draft accepted), got {text!r}")
    return values


def _method_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in METHODS and n != "stock"]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)} "
                                         "(stock generate() always runs)")
    return [n for n in names if n != "stock"]


def rows_of(methods: list[str], compile: str) -> list[str]:
    """The method rows: each method as it is (``compile`` "off" or "both") and with ``compile=True`` (``"on"`` or
    ``"both"``: the name with :data:`COMPILE_SUFFIX`); transformers' own assisted mode has no such option."""
    rows = []
    for name in methods:
        if compile != "on" or name == "hf_assisted":
            rows.append(name)
        if compile != "off" and name != "hf_assisted":
            rows.append(name + COMPILE_SUFFIX)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (float32), under a minute")
    p.add_argument("--tau", type=_int_list, default=None, metavar="T[,T...]",
                   help="acceptance lengths (tokens per step; tau - 1 drafts accepted); default 3,5 (--tiny: 3)")
    p.add_argument("--methods", type=_method_list, default=list(METHODS), metavar="M1,M2",
                   help=f"of {', '.join(METHODS)} (default: all; stock generate() always runs)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated per call (default 128; --tiny: 24)")
    p.add_argument("--steps", type=int, default=None,
                   help="instead of --max-new-tokens: verification steps per call at each tau (steps * tau + 1 new "
                        "tokens, the same number of steps for every tau)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; --tiny: 16)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per row (default 2; --tiny: 1)")
    p.add_argument("--chain-length", type=int, default=None,
                   help="drafts per step of the chain methods (assisted, mtp; default tau - 1)")
    p.add_argument("--device", default=None, help="default cuda (--tiny: cpu)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 (--tiny: float32)")
    p.add_argument("--batch", type=_int_list, default=[1], metavar="B[,B...]",
                   help="batch sizes, one set of prompts each (default 1); rows at each size over stock at that size")
    p.add_argument("--compile", choices=("off", "on", "both"), default=None,
                   help="hf_specdec's rows without compile=True (off), with it (on: the target's verification compiled, "
                        "CUDA graphs on a GPU) or both side by side (default both; --tiny: off)")
    p.add_argument("--loop-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a loop option for every hf_specdec method (repeatable)")
    p.add_argument("--no-cuda-sync-debug", dest="cuda_sync_debug", action="store_false",
                   help="on CUDA, do not count the runtime's synchronisations (set_sync_debug_mode)")
    p.add_argument("--time-limit", type=float, default=DEADLINE_S,
                   help=f"seconds after which no new row starts (default {DEADLINE_S})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="gpu_bench_out", help="output folder: gpu_bench.json, gpu_bench.md")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.tau = args.tau or ([3] if tiny else [3, 5])
    if args.steps is not None and args.max_new_tokens is not None:
        p.error("give --steps or --max-new-tokens, not both")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    args.max_new_tokens = args.max_new_tokens or (24 if tiny else 128)
    args.new_tokens = {tau: args.steps * tau + 1 if args.steps else args.max_new_tokens for tau in args.tau}
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.reps = args.reps or (1 if tiny else 2)
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.compile = args.compile or ("off" if tiny else "both")
    if args.chain_length is not None and args.chain_length < 1:
        p.error(f"--chain-length must be >= 1, got {args.chain_length}")
    for tau in args.tau:
        for name in args.methods:
            deepest = deepest_draft(name, tau, args.chain_length, tiny) if name != "hf_assisted" else tau - 1
            if tau - 1 > deepest:
                p.error(f"--tau {tau}: {name} accepts at most {deepest} drafts per step with these options "
                        f"(tau <= {deepest + 1}); lower --tau, raise --chain-length for a chain method, or drop "
                        f"{name} from --methods.")
    return args


def _loop_options(pairs: list[str]) -> dict:
    from hf_specdec import registry

    known = {o.name: o for o in registry.LOOP_OPTIONS}
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in known:
            raise SystemExit(f"--loop-option {pair!r}: expected KEY=VALUE with KEY one of {', '.join(known)} "
                             "(hf_specdec.registry.LOOP_OPTIONS).")
        options[key] = known[key].parse(value)
    return options


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, built with CUDA {torch.version.cuda}). It measures the loop on a GPU: run it on a "
              "machine with an NVIDIA GPU and a CUDA build of torch, or pass --tiny for the CPU smoke run of the "
              "same code.", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    loop_options = _loop_options(args.loop_option)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    torch.manual_seed(args.seed)

    from hf_specdec.bench.probes import forward_cost_curve

    config = target_config(args.tiny)
    model, perm = build_target(config, device, dtype, args.seed)
    drafters = build_drafters(model, args.methods, args.tiny, device, dtype, args.seed + 1)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    copying = any(name in LOOKUP for name in args.methods)  # something to copy (the same prompts for every row)
    if copying:
        args.prompt_len = copy_prompt(perm, args.prompt_len, max(args.new_tokens.values())).shape[1]
    rows, skipped, sizes, reference = [], [], {1}, None
    for batch in args.batch:  # one set of prompts per batch size (batch rows start their walks at other tokens)
        if copying:
            prompt = torch.cat([copy_prompt(perm, args.prompt_len - max(args.new_tokens.values()) - 3,
                                            max(args.new_tokens.values()), start=1 + b) for b in range(batch)])
        else:
            prompt = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=g).to(device)
        enc = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
        with torch.no_grad():
            reference = model.generate(**enc, max_new_tokens=max(args.new_tokens.values()), do_sample=False)
        if batch == args.batch[0]:
            first_reference = reference
        runner = Runner(model, drafters, enc, reference, args, loop_options)
        try:
            for tau in args.tau:
                for name in ["stock", "stock_compiled"] + rows_of(args.methods, args.compile):
                    if time.perf_counter() - started > args.time_limit:
                        skipped.append(f"{name} (tau {tau}, batch {batch})")
                        continue
                    print(f"[gpu bench] batch {batch}, tau {tau}: {name}", file=sys.stderr, flush=True)
                    with torch.no_grad():
                        warm = runner.run(name, tau)  # untimed: compiles, calibrates the forward costs, fills caches
                        syncs = runner.count_syncs(name, tau)
                        with counting_captures() as recorded:  # none, once warm: graphs and caches kept
                            timed = [runner.run(name, tau) for _ in range(args.reps)]
                    row = summarize(name, tau, timed, args.prompt_len)
                    row.update({k: v for k, v in syncs.items() if k != "steps"})
                    row["batch"] = batch
                    row["warmup_seconds"] = warm["wall"]  # the untimed first call: compilation, graph capture
                    row["graphs_recorded_timed"] = recorded[0]
                    expected = reference[:, : args.prompt_len + args.new_tokens[tau]]
                    row["identical"] = all(torch.equal(r["sequences"], expected) for r in [warm, *timed])
                    rows.append(row)
                    sizes.update(row["verify_sizes"])
        finally:
            runner.close()
    reference = first_reference[:1]

    # the forward cost curve at the sizes the rows verified, the cache filled to the middle of a run
    ctx = reference[:, : args.prompt_len + max(args.new_tokens.values()) // 2]
    with torch.no_grad():
        curve = forward_cost_curve(model, ctx, sorted(sizes), reps=5)
    stock = {(r["tau_target"], r["batch"]): r for r in rows if r["method"] == "stock"}
    compiled = {(r["tau_target"], r["batch"]): r for r in rows if r["method"] == "stock_compiled"}
    for row in rows:
        base = stock.get((row["tau_target"], row["batch"]))
        row["speedup"] = base["ms_per_token"] / row["ms_per_token"] if base else None
        fast = compiled.get((row["tau_target"], row["batch"]))
        row["speedup_vs_compiled"] = fast["ms_per_token"] / row["ms_per_token"] if fast else None
        row["ideal_speedup"] = ideal_speedup(row, curve) if row["verify_sizes"] or row["tau"] == 1.0 else None
        ok = row["speedup"] is not None and row["ideal_speedup"] is not None
        row["efficiency"] = row["speedup"] / row["ideal_speedup"] if ok else None
    continuation = reference[0, args.prompt_len - 1:]  # the structure worked: greedy next = perm[current]
    perm_ok = bool(torch.equal(perm[continuation[:-1]], continuation[1:]))
    result = {
        "schema": SCHEMA,
        "machine": _machine(device),
        "config": {"target": "tiny Llama" if args.tiny else "Llama-3.1-8B-shaped (random weights)",
                   "dtype": args.dtype, "tau": args.tau, "methods": ["stock", "stock_compiled", *args.methods],
                   "max_new_tokens": {str(t): n for t, n in args.new_tokens.items()}, "steps": args.steps,
                   "prompt_len": args.prompt_len, "reps": args.reps, "chain_length": args.chain_length,
                   "loop_options": {k: str(v) for k, v in loop_options.items()}, "compile": args.compile,
                   "batch": args.batch,
                   "eagle3_tree": TINY_EAGLE3_TREE if args.tiny else EAGLE3_TREE,
                   "target_params": sum(p.numel() for p in model.parameters()),
                   "drafter_params": {n: sum(p.numel() for p in d.parameters()) for n, d in drafters.items()},
                   "greedy_is_permutation": perm_ok},
        "cost_curve_ms": {q: ms for q, ms in curve.items()},
        "noise_ms": noise_cost(device, config.vocab_size),
        "rows": rows,
        "skipped": skipped,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    table = markdown(result)
    (out / "gpu_bench.md").write_text(table + "\n")
    print(table)
    print(f"\nwritten to {out}/ (gpu_bench.json, gpu_bench.md) in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
