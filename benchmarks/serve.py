"""A method attached to a model folder, served by ``transformers serve``, against the same method called directly.

    python benchmarks/serve.py                                  # eagle3 on SmolLM2-135M-Instruct, 5 GSM8K + 5 MT-bench
    python benchmarks/serve.py --method prompt_lookup --limit 3 --max-new-tokens 96

SmolLM2-135M-Instruct (the embedded default model, float32) is saved to a folder with its tokenizer and
``hf-specdec attach FOLDER --method M`` (the drafter shipped for it). Then, one phase after the other on the same
machine (the server's two processes and this one never compete):

1. direct: the folder loaded without ``trust_remote_code`` (stock ``generate()``, and ``plain_kernels``: the same
   inside :func:`hf_specdec.kernels.padded_plain_decoding`) and with it (the attached method), each chat once to warm
   up, then each timed;
2. served: ``transformers serve FOLDER --trust-remote-code`` (:class:`hf_specdec.bench.served.TransformersServer`),
   each chat as a non-streamed chat completion (``temperature: 0``), timed at the client, after one warm-up request;
3. served plain: the same server without ``--trust-remote-code`` (stock ``generate()`` in the server).

Reports per request and in total: served / direct for the method (the issue's target: within 10 %), the speedups over
stock and ``plain_kernels`` direct and over plain served, and whether every served text equals the direct plain text.
Greedy throughout; the chat template applied by the server exactly as here (``apply_chat_template(...,
add_generation_prompt=True)``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="eagle3")
    parser.add_argument("--limit", type=int, default=5, help="prompts per dataset")
    parser.add_argument("--datasets", default="gsm8k,mtbench")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--folder", default=None, help="where to save the attached model (default: a cache folder)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_specdec
    from hf_specdec.bench import data
    from hf_specdec.bench.served import TransformersServer
    from hf_specdec.default_model import cache_root, load_smollm2
    from hf_specdec.dtypes import cpu_name
    from hf_specdec.kernels import padded_plain_decoding

    folder = Path(args.folder or cache_root() / "serve-bench" / "smollm2-135m-instruct")
    if not (folder / "config.json").is_file():
        model, tok = load_smollm2()
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    hf_specdec.attach(folder, args.method)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [p for name in args.datasets.split(",") for p in getattr(data, name)()[:args.limit]]
    chats = [[{"role": "user", "content": p.text}] for p in prompts]
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    cpu = cpu_name()
    print(f"{args.method} attached to {folder}; {len(chats)} chats, {args.max_new_tokens} new tokens at most; "
          f"CPU {cpu}, torch {torch.__version__}", file=sys.stderr)

    def text_of(ids, out):
        return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    inputs = [tok.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt", return_dict=True)
              for c in chats]
    rows = [{"id": f"{p.dataset}/{p.id}"} for p in prompts]
    # 1. direct
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    attached = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        for label, run in (("stock", lambda ids: plain.generate(**ids, **gen)),
                           ("plain_kernels", lambda ids: _kernels(plain, padded_plain_decoding, ids, gen)),
                           ("direct", lambda ids: attached.generate(**ids, **gen))):
            run(inputs[0])  # warm-up
            for row, ids in zip(rows, inputs):
                out, row[label] = _timed(lambda: run(ids))
                row[f"{label}_text"] = text_of(ids, out)
    del plain, attached
    # 2. and 3. served
    for label, trust in (("served", True), ("served_plain", False)):
        with TransformersServer(folder, trust_remote_code=trust, env={"HF_HUB_OFFLINE": "1"}) as server:
            print(f"{label}: server ready in {server.startup_seconds:.1f} s", file=sys.stderr)
            server.complete(chats[0], args.max_new_tokens)  # warm-up
            for row, chat in zip(rows, chats):
                answer, row[label] = _timed(lambda: server.complete(chat, args.max_new_tokens))
                row[f"{label}_text"] = answer["choices"][0]["message"]["content"]

    print(f"\n| request | stock s | plain_kernels s | {args.method} direct s | served s | served plain s | "
          "served / direct | texts equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = all(r[f"{k}_text"] == r["stock_text"] for k in ("plain_kernels", "direct", "served", "served_plain"))
        print(f"| {r['id']} | {r['stock']:.2f} | {r['plain_kernels']:.2f} | {r['direct']:.2f} | {r['served']:.2f} | "
              f"{r['served_plain']:.2f} | {r['served'] / r['direct']:.3f} | {'yes' if same else 'NO'} |")
    total = {k: sum(r[k] for r in rows) for k in ("stock", "plain_kernels", "direct", "served", "served_plain")}
    ratios = [r["served"] / r["direct"] for r in rows]
    print(f"\ntotal: served / direct {total['served'] / total['direct']:.3f} (median per request "
          f"{statistics.median(ratios):.3f}); {args.method} direct {total['stock'] / total['direct']:.2f}x over stock, "
          f"{total['plain_kernels'] / total['direct']:.2f}x over plain_kernels; served "
          f"{total['served_plain'] / total['served']:.2f}x over plain served; every text equal: "
          f"{all(r[f'{k}_text'] == r['stock_text'] for r in rows for k in ('direct', 'served', 'served_plain'))}")
    if args.out:
        Path(args.out).write_text(json.dumps({"method": args.method, "cpu": cpu, "rows": rows, "total": total},
                                             indent=1))
    return 0


def _kernels(model, padded_plain_decoding, ids, gen):
    with padded_plain_decoding(model):
        return model.generate(**ids, **gen)


if __name__ == "__main__":
    raise SystemExit(main())
