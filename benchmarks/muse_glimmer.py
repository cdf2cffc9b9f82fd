"""transformers' Muse Glimmer assistant (MuseGlimmerAssistantModel) through hf_specdec's `dflash` vs transformers' own
`speculation_type="dflash"`, on tiny random models (CPU; the loops' overhead, not a real speed-up).

Target: a random Llama (hidden 256, 8 layers, vocabulary 4096, tests/tiny.py style); assistant: a random Muse Glimmer
assistant (2 layers, block 16, 3 taps, transformers' defaults otherwise: every layer sliding, window 2048). Batch 1,
greedy, 96 new tokens, median of 3 timed runs after a warm-up. Rows: stock `generate()`, transformers'
`generate(assistant_model=native, speculation_type="dflash")`, and ours, `decoding_method("dflash")` with
`assistant_model=native` (the object, converted in memory each call), adaptive and constant schedules.

Two cases, both with random weights:

* **random drafts**: the assistant's own drafts, which the target (nearly) never accepts; transformers verifies the
  whole block every step, ours adaptively verifies only what pays (or backs off), constant verifies the block.
* **forced acceptance**: both loops still run the assistant and its LM head every step, but the drafts are replaced by
  the reference continuation for the first ``--accept`` positions and a wrong token after (the same in both loops), so
  each step commits ``accept + 1`` tokens: the loops compared at a published drafter's acceptance (tau ~ 6).

tau: new tokens per target forward, the prefill included (ours: ``speculative_stats["target_forward_passes"]``;
transformers': counted with a forward hook).
Every output is checked against stock greedy decoding.

    python benchmarks/muse_glimmer.py [--new 96] [--runs 3] [--accept 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

import hf_specdec
from hf_specdec.proposers.dflash import DFlashProposer

VOCAB, HIDDEN, LAYERS, BLOCK = 4096, 256, 8, 16


def models():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties (as tests/tiny.py)
        for p in target.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    acfg = MuseGlimmerAssistantConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, block_size=BLOCK,
                                      mask_token_id=VOCAB - 1, target_layer_ids=[1, 4, 6], bos_token_id=2,
                                      eos_token_id=1, pad_token_id=0)
    return target, MuseGlimmerAssistantModel(acfg).eval()


class Forced:
    """Both loops' drafts replaced by ``reference``'s continuation for the first ``accept`` positions (the assistant
    and the LM head still run, as for a drafter that is right that often)."""

    def __init__(self, reference, accept):
        self.ref, self.accept = reference, accept
        self.saved = DFlashProposer._block_logits, DFlashTokenCandidateGenerator.get_candidates

    def tokens(self, anchor, width):
        true = [int(self.ref[0, q]) if q < self.ref.shape[1] else 3 for q in range(anchor + 1, anchor + 1 + width)]
        return torch.tensor([t if j < self.accept else (t + 1) % VOCAB for j, t in enumerate(true)])

    def __enter__(self):
        forced = self
        _, get_candidates = self.saved

        def our_block(self, state, hidden):
            need = min(hidden.shape[1], max(state.max_drafts))
            logits = self.drafter.draft_logits(hidden[:, :need]).float()  # the whole head, as a confident drafter
            if not need:
                return logits
            tokens = forced.tokens(int(state.root_positions[0]), need).to(logits.device)
            return torch.nn.functional.one_hot(tokens, logits.shape[-1])[None].float() * 100

        def their_candidates(self, input_ids, *args, **kwargs):
            out, logits = get_candidates(self, input_ids, *args, **kwargs)
            if logits is None:
                return out, logits
            n = input_ids.shape[1]
            return torch.cat([input_ids, forced.tokens(n - 1, out.shape[1] - n)[None]], dim=1), logits

        DFlashProposer._block_logits = our_block
        DFlashTokenCandidateGenerator.get_candidates = their_candidates
        return self

    def __exit__(self, *exc):
        DFlashProposer._block_logits, DFlashTokenCandidateGenerator.get_candidates = self.saved


def run(target, ids, kw, runs):
    """(median seconds, output, tau) of ``target.generate(ids, **kw)``."""
    forwards = []
    hook = target.register_forward_hook(lambda *a: forwards.append(1))
    times, out = [], None
    try:
        for i in range(runs + 1):  # the first is a warm-up
            forwards.clear()
            t0 = time.perf_counter()
            out = target.generate(ids, **kw)
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        hook.remove()
    sequences = out.sequences if hasattr(out, "sequences") else out
    stats = getattr(out, "speculative_stats", None)
    new = sequences.shape[1] - ids.shape[1]
    tau = new / (stats["target_forward_passes"] if stats else len(forwards))
    return statistics.median(times), sequences, tau


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--accept", type=int, default=5, help="drafts accepted per step in the forced case")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, native = models()
    ids = torch.randint(3, VOCAB - 1, (1, 32), generator=torch.Generator().manual_seed(1))
    base = dict(max_new_tokens=args.new, do_sample=False, eos_token_id=None)  # no EOS: always args.new tokens
    ref = target.generate(ids, **base)
    cases = {
        "stock generate()": dict(base),
        'transformers speculation_type="dflash"': dict(base, assistant_model=native, speculation_type="dflash"),
        "hf_specdec dflash, adaptive": dict(base, assistant_model=native, return_dict_in_generate=True,
                                            custom_generate=hf_specdec.decoding_method("dflash")),
        "hf_specdec dflash, constant": dict(base, assistant_model=native, return_dict_in_generate=True,
                                            custom_generate=hf_specdec.decoding_method(
                                                "dflash", draft_length_schedule="constant")),
    }
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"{cpu}; torch threads {args.threads}; batch 1, greedy, {args.new} new tokens, median of {args.runs}\n")
    stock = None
    for label, forced in (("random drafts", False), (f"forced acceptance ({args.accept} drafts a step)", True)):
        rows = []
        for name, kw in cases.items():
            if forced and name.startswith("stock"):
                rows.append((name, stock, None))
                continue
            if forced:
                with Forced(ref, args.accept):
                    seconds, out, tau = run(target, ids, kw, args.runs)
            else:
                seconds, out, tau = run(target, ids, kw, args.runs)
            assert torch.equal(out, ref), f"{name}: not the stock greedy output"
            rows.append((name, seconds, tau))
            stock = seconds if name.startswith("stock") else stock
        theirs = rows[1][1]
        print(f"### {label}\n\n| loop | tokens/s | x stock | x transformers' dflash | tau |\n|---|---|---|---|---|")
        for name, seconds, tau in rows:
            print(f"| {name} | {args.new / seconds:.1f} | {stock / seconds:.2f} | {theirs / seconds:.2f} | "
                  f"{'-' if tau is None else f'{tau:.2f}'} |")
        print()


if __name__ == "__main__":
    main()
