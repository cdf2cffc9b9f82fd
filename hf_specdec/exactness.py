"""Does this target, in this dtype on this device, verify draft trees with the bits of its own one-token steps?

In float32 the loop's output is the target's greedy output token for token (the tests check it on every method): a
verification forward sums the same products in another order, which moves a logit by an ulp at most, and two logits
tie to the last bit almost never. In half precision (bf16 / fp16) an ulp is large enough for that to happen within a
few hundred tokens, so the output equals the target's own decoding in that dtype only if every verified token gets
exactly the logits of the one-token step plain decoding runs for it. Whether it does depends on the kernels the
processor and the libraries pick (benchmarks/RESULTS.md, "Half precision"): it is not assumed, it is probed.

:func:`probe_exact_bits` runs the target on a few random draft trees (a chain, bushes, one past 32 nodes) through the
runner, and each node's path through the model's own one-token steps, and compares the logits bit for bit. The
runner keeps the verdict per dtype, device and rounding (:meth:`hf_specdec.runners.TargetRunner.exact_bits`), so it
is probed once per model; every half-precision call reports it as ``speculative_stats["exact_bits"]``.

Example::

    from hf_specdec.runner_choice import runner_for

    runner_for(model).exact_bits("auto")   # True: verification rounds as plain decoding; False: up to rounding
    out = model.generate(**inputs, custom_generate=hf_specdec.decoding_method("eagle3"), return_dict_in_generate=True)
    out.speculative_stats["exact_bits"]     # the same verdict (None in float32, False for a batch of several rows)
"""

from __future__ import annotations

import copy
import random

import torch
from transformers import DynamicCache

from . import cache as cache_ops
from .placement import input_device
from .tree import build_attention_mask

PROBE_PAST = 160  # prompt tokens before each tree (the attention's rounding can change with the key count)
PROBE_TREES = ((5, 0.0), (13, 0.5), (34, 0.5))  # (nodes, share of nodes that branch off an earlier node)


def _random_tree(rng: random.Random, nodes: int, branching: float):
    """``(parents, depths, ancestors [n, n])`` of a random draft tree, node 0 the root, parents before children."""
    parents = [-1] + [rng.randrange(i) if rng.random() < branching else i - 1 for i in range(1, nodes)]
    ancestors, depths = torch.eye(nodes, dtype=torch.bool), [0] * nodes
    for i in range(1, nodes):
        ancestors[i] |= ancestors[parents[i]]
        depths[i] = depths[parents[i]] + 1
    return parents, depths, ancestors


@torch.no_grad()
def probe_exact_bits(runner, rounding: str | None = None, trees=PROBE_TREES) -> bool:
    """Whether one row's verification through ``runner`` (with ``rounding``, see the ``rounding`` option) gives every
    node of random draft trees the logits of the one-token step plain decoding runs for its path, to the bit.

    Costs one prompt forward, one verification and about one one-token step per node, per tree (about 50 steps).
    """
    model = runner.model
    device = input_device(model)  # not model.device: ``meta`` where Accelerate offloaded the embeddings
    text = model.config.get_text_config()
    vocab = text.vocab_size
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PROBE_PAST), generator=gen).to(device)
    past_pos = torch.arange(PROBE_PAST, device=device)[None]
    for nodes, branching in trees:
        parents, depths, ancestors = _random_tree(rng, nodes, branching)
        tokens = torch.randint(0, vocab, (1, nodes), generator=gen).to(device)
        pos = (PROBE_PAST + torch.tensor(depths, device=device))[None]  # [1, n]
        cache = cache_ops.new_cache_like(model, None, capacity=PROBE_PAST + nodes)
        model(input_ids=ids, cache=cache, use_cache=True)
        with runner.session(cache, rounding=rounding) as target:
            mask = build_attention_mask(text, torch.ones_like(ids, dtype=torch.bool), past_pos, pos,
                                        ancestors[None].to(device), model.dtype, kv_width=target.kv_width)
            verified = target.forward(tokens, mask, pos, with_hidden=False).logits[0]  # [n, V]
        # plain decoding of each node's path, one token at a time, in the cache plain generate() makes (a
        # sliding-window layer keeps only its window: its one-token step attends over exactly those keys)
        after = {-1: DynamicCache(config=model.config)}  # node -> the cache once its token is in
        model(input_ids=ids, cache=after[-1], use_cache=True)
        last_child = {parent: i for i, parent in enumerate(parents)}
        for i in range(nodes):
            parent = parents[i]
            cache = after.pop(parent) if last_child[parent] == i else copy.deepcopy(after[parent])
            step = model(input_ids=tokens[:, i:i + 1], cache=cache, use_cache=True,
                         position_ids=torch.tensor([[PROBE_PAST + depths[i]]], device=device)).logits[0, -1]
            if not torch.equal(step, verified[i]):
                return False
            if i in last_child:
                after[i] = cache
    return True
