"""gemma4_assistant: stock generate(), transformers' own assisted loop and hf_specdec's, on a tiny Gemma 4 pair.

The weights are RANDOM (no download: the published pairs are gigabytes). The target is a Gemma 4 text model
(hidden 256, 8 layers: sliding / full attention mixed, the last 4 layers reading the KV of earlier ones, per-layer
inputs of 32), the assistant a 2-layer ``Gemma4AssistantForCausalLM`` (hidden 256) over the target's shared KV. Two
variants of the pair:

* ``random``: random weights; the assistant's drafts are almost never accepted, so this measures the overhead of
  drafting that does not pay (hf_specdec's adaptive draft length turns drafting down; transformers' loop always
  drafts ``num_assistant_tokens``).
* ``oracle``: the same shapes and the same compute per forward, but the norms that scale what each target layer adds to
  its residual stream are zero, so the target's next token is a function of the current token (a bigram of its
  embeddings and LM head); the assistant is built to compute that same function (its ``pre_projection`` passes the
  token embedding through, its layers add nothing, its final norm and LM head are the target's). Every draft is
  right: this is the fair comparison of the loops when drafts are accepted (zero weights cost the same as others).

Batch 1, greedy, ``--new`` new tokens; each entry runs ``--runs`` times (median time, in an order that rotates per
round). τ: tokens committed per target forward after the prefill (``speculative_stats``; for transformers' loop,
counted from the target's forwards). Prints a markdown table.

Usage: python benchmarks/gemma4_assistant.py [--new 96] [--runs 3] [--threads 1] [--k 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

import hf_specdec
from hf_specdec.dtypes import cpu_name

VOCAB, HIDDEN, LAYERS, WINDOW = 8192, 256, 8, 32
POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
              "post_per_layer_input_norm.weight")


def _text(layers: int, types: list[str], **kw) -> Gemma4TextConfig:
    return Gemma4TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                            global_head_dim=128, sliding_window=WINDOW, layer_types=types,
                            max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                            tie_word_embeddings=False, **kw)


def build_pair(oracle: bool, seed: int = 0):
    torch.manual_seed(seed)
    pattern = ["sliding_attention"] * 3 + ["full_attention"]
    target = Gemma4ForCausalLM(_text(LAYERS, pattern * 2, num_kv_shared_layers=4, hidden_size_per_layer_input=32,
                                     vocab_size_per_layer_input=VOCAB))
    text = _text(2, ["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                 vocab_size_per_layer_input=0)
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=HIDDEN))
    with torch.no_grad():
        for model in (target, assistant):
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(3.0)  # sharper logits: fewer near-ties
        target.lm_head.weight.mul_(10.0)
        if oracle:
            for model in (target, assistant):
                for name, p in model.named_parameters():
                    if name.endswith(POST_NORMS):
                        p.zero_()
            assistant.pre_projection.weight.copy_(torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], 1))
            assistant.lm_head.weight.copy_(target.lm_head.weight)
            assistant.model.norm.weight.copy_(target.model.norm.weight)
    for model in (target, assistant):
        model.config._attn_implementation = "sdpa"
        model.config.get_text_config()._attn_implementation = "sdpa"
    return target.eval(), assistant.eval()


class ForwardCounter:
    """Counts the target's forwards (transformers' loop reports no statistics)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.n += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=4, help="num_assistant_tokens of transformers' loop and the fixed chain")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (1, 48), generator=g)
    method = hf_specdec.decoding_method("gemma4_assistant")
    greedy = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new,
                  do_sample=False, eos_token_id=None, pad_token_id=0)
    rows = []
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); batch 1, greedy, "
          f"{args.new} new tokens, median of {args.runs}. RANDOM weights (see the module doc).\n")
    for variant in ("random", "oracle"):
        target, assistant = build_pair(oracle=variant == "oracle")
        counter = ForwardCounter(target)

        def transformers_assisted():
            assistant.generation_config.num_assistant_tokens = args.k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            try:
                before = counter.n
                out = target.generate(**greedy, assistant_model=assistant)
                forwards = counter.n - before
            finally:
                assistant.generation_config.num_assistant_tokens = None
            return out, (args.new - 1) / max(forwards - 1, 1)

        def ours(**opts):
            def run():
                out = target.generate(**greedy, custom_generate=method, assistant_model=assistant,
                                      return_dict_in_generate=True, **opts)
                return out.sequences, out.speculative_stats["acceptance_length"]
            return run

        entries = {
            "stock generate()": lambda: (target.generate(**greedy), 1.0),
            f"transformers generate(assistant_model=), k={args.k}": transformers_assisted,
            "gemma4_assistant chain (adaptive)": ours(),
            f"gemma4_assistant chain k={args.k}": ours(num_speculative_tokens=args.k),
            "gemma4_assistant tree w=2 (adaptive)": ours(tree_width=2),
            f"gemma4_assistant tree w=2 depth={args.k}": ours(tree_width=2, num_speculative_tokens=args.k),
        }
        for run in entries.values():  # warm-up: one call each (the loop's cost calibration, allocations)
            run()
        times = {name: [] for name in entries}
        taus, outputs = {}, {}
        names = list(entries)
        for r in range(args.runs):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                out, tau = entries[name]()
                times[name].append(time.perf_counter() - t0)
                taus[name], outputs[name] = tau, out
        ref = outputs["stock generate()"]
        same = all(torch.equal(o, ref) for o in outputs.values())
        speed = {name: args.new / statistics.median(t) for name, t in times.items()}
        tf = speed[f"transformers generate(assistant_model=), k={args.k}"]
        for name in names:
            rows.append((variant, name, speed[name], speed[name] / speed["stock generate()"], speed[name] / tf,
                         taus[name]))
        print(f"{variant}: every output equals stock generate(): {same}")
        counter.handle.remove()
    print("\n| pair | method | tokens/s | × stock | × transformers' assisted | τ |")
    print("|---|---|---:|---:|---:|---:|")
    for variant, name, tps, over_stock, over_tf, tau in rows:
        print(f"| {variant} | {name} | {tps:.1f} | {over_stock:.2f} | {over_tf:.2f} | {tau:.2f} |")


if __name__ == "__main__":
    main()
