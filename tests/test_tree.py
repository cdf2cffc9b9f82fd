"""Tree verification: the logits of every tree node equal a separate linear run of its root-to-node path."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_specdec import cache as cache_ops
from hf_specdec.tree import DraftTree, build_attention_mask
from tiny import prompts, tiny_model

# root r; r->a, r->b; a->c, a->d; b->e; d->f  (node order = parents first)
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def _tree(bsz, roots, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(PARENTS)
    tokens = torch.randint(3, 96, (bsz, n), generator=g)
    tokens[:, 0] = roots
    parents = torch.tensor(PARENTS).expand(bsz, n).clone()
    return DraftTree(tokens=tokens, parents=parents, valid=torch.ones(bsz, n, dtype=torch.bool))


def _linear_logits(model, ids, mask, extra):
    """Logits of the last token of (prompt + extra) computed by the model in one plain call."""
    full = torch.cat([ids, extra], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(extra)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=full, attention_mask=full_mask, position_ids=pos)
    return out.logits[:, -1]


def _prefill_all_but_last(model, ids, mask, static):
    """Cache the prompt except its last token (the tree root); a static cache holds 64 columns."""
    bsz = ids.shape[0]
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if static:
        from transformers import StaticCache

        cache = cache_ops.new_cache_like(model, StaticCache(config=model.config, max_cache_len=64), capacity=64)
    else:
        cache = DynamicCache()
    past_ids, past_mask, past_pos = ids[:, :-1], mask[:, :-1], pos[:, :-1]
    n_past = past_ids.shape[1]
    full = torch.ones(n_past, n_past, dtype=torch.bool).tril()[None] & past_mask.bool()[:, None, :]
    m = build_attention_mask(model.config, torch.zeros(bsz, 0, dtype=torch.bool), past_pos[:, :0], past_pos, full,
                             torch.float32, kv_width=64 if static else None)
    model(input_ids=past_ids, attention_mask=m, position_ids=past_pos, cache=cache)
    return cache, pos, past_mask, past_pos, n_past


def test_tree_structure():
    tree = _tree(2, torch.tensor([5, 6]))
    assert tree.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.path_to(0, 6) == [0, 1, 4, 6]
    assert tree.children(0)[1] == [3, 4]
    anc = tree.ancestors[0]
    assert anc[6].nonzero().flatten().tolist() == [0, 1, 4, 6]
    assert anc[5].nonzero().flatten().tolist() == [0, 2, 5]
    chain = DraftTree.chain(torch.tensor([1, 2]), torch.tensor([[7, 8, 9], [4, 5, 6]]), [2, 1])
    assert chain.valid.tolist() == [[True, True, True], [True, True, False]]  # past the longest row: cut off
    assert chain.tokens.tolist() == [[1, 7, 8], [2, 4, 5]]
    device_counts = DraftTree.chain(torch.tensor([1, 2]), torch.tensor([[7, 8, 9], [4, 5, 6]]), torch.tensor([2, 1]))
    assert device_counts.valid.tolist() == [[True, True, True, False], [True, True, False, False]]  # not read back
    assert chain.ancestors[0, 2].tolist() == [True, True, True]
    probs = torch.rand(2, 3, 11)
    assert torch.equal(DraftTree.chain(torch.tensor([1, 2]), torch.tensor([[7, 8, 9], [4, 5, 6]]),
                                       [1, 0], probs).draft_probs[:, 1:], probs[:, :1])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("static", [False, True])
def test_tree_logits_equal_linear_paths(arch, static):
    model = tiny_model(arch)
    bsz = 2
    ids, mask = prompts(bsz, length=11, seed=3)
    with torch.no_grad():
        cache, pos, past_mask, past_pos, n_past = _prefill_all_but_last(model, ids, mask, static)
        tree = _tree(bsz, ids[:, -1])
        node_pos = pos[:, -1:] + tree.depths
        m = build_attention_mask(model.config, past_mask.bool(), past_pos, node_pos, tree.ancestors, torch.float32,
                                 kv_width=64 if static else None)
        logits = model(input_ids=tree.tokens, attention_mask=m, position_ids=node_pos, cache=cache).logits
        for node in range(len(PARENTS)):
            for b in range(bsz):
                path = tree.path_to(b, node)
                extra = tree.tokens[b:b + 1, path[1:]]
                ref = _linear_logits(model, ids[b:b + 1], mask[b:b + 1], extra)
                torch.testing.assert_close(logits[b, node], ref[0], atol=2e-4, rtol=1e-4)
        # negative control: without the tree mask, node 5 (a child of b) would see a, c, d
        plain = build_attention_mask(model.config, past_mask.bool(), past_pos, node_pos,
                                     torch.ones(bsz, 7, 7, dtype=torch.bool).tril(), torch.float32,
                                     kv_width=64 if static else None)
        cache_ops.crop(cache, n_past)
        wrong = model(input_ids=tree.tokens, attention_mask=plain, position_ids=node_pos, cache=cache).logits
        assert (wrong[:, 5] - logits[:, 5]).abs().max() > 1e-2


@pytest.mark.parametrize("static", [False, True])
def test_keep_accepted_path_then_continue(static):
    """After keeping a path's columns, the next token's logits equal a linear run of prompt + path."""
    model = tiny_model("llama")
    ids, mask = prompts(2, length=9, seed=4)
    width = 64 if static else None
    with torch.no_grad():
        cache, pos, past_mask, past_pos, n_past = _prefill_all_but_last(model, ids, mask, static)
        tree = _tree(2, ids[:, -1], seed=9)
        node_pos = pos[:, -1:] + tree.depths
        model(input_ids=tree.tokens, position_ids=node_pos, cache=cache,
              attention_mask=build_attention_mask(model.config, past_mask.bool(), past_pos, node_pos, tree.ancestors,
                                                  torch.float32, kv_width=width))
        paths = [tree.path_to(0, 6), tree.path_to(1, 5)]  # different lengths: row 1 gets a hole
        index = torch.zeros(2, 4, dtype=torch.long)
        for b, p in enumerate(paths):
            index[b, : len(p)] = torch.tensor(p)
        cache_ops.keep_columns(cache, n_past, index)
        assert cache_ops.cache_length(cache) == n_past + 4
        keep_valid = torch.tensor([[True] * 4, [True] * 3 + [False]])
        kept_pos = pos[:, -1:] + torch.arange(4)
        nxt = torch.tensor([[11], [12]])
        nxt_pos = torch.tensor([[int(pos[0, -1]) + 4], [int(pos[1, -1]) + 3]])
        m = build_attention_mask(model.config, torch.cat([past_mask.bool(), keep_valid], 1),
                                 torch.cat([past_pos, kept_pos], 1), nxt_pos, torch.ones(2, 1, 1, dtype=torch.bool),
                                 torch.float32, kv_width=width)
        logits = model(input_ids=nxt, attention_mask=m, position_ids=nxt_pos, cache=cache).logits[:, -1]
        for b, p in enumerate(paths):
            extra = torch.cat([tree.tokens[b:b + 1, p[1:]], nxt[b:b + 1]], dim=1)
            ref = _linear_logits(model, ids[b:b + 1], mask[b:b + 1], extra)
            torch.testing.assert_close(logits[b], ref[0], atol=2e-4, rtol=1e-4)


def test_cost_model_keeps_verifications_cheaper_than_a_step():
    """Measured costs are not floored at one step: where a 2-token verification (CPU kernels) is cheaper than the
    model's own one-token step, the draft-length rule drafts even with a low acceptance rate."""
    from hf_specdec.costs import ForwardCostModel, best_draft_length

    cost = ForwardCostModel("cpu")
    cost.record(1, 0.068)
    cost.record(2, 0.045)
    cost.record(4, 0.053)
    assert cost.relative(2) == pytest.approx(0.045 / 0.068)
    assert cost.relative(3) < 0.8  # interpolated between measured sizes
    assert best_draft_length(0.05, 3, cost) == 1
    assert best_draft_length(0.05, 3, cost, draft_cost=0.5) == 0  # the drafter's own time still counts
    slow = ForwardCostModel("cpu")
    slow.record(1, 0.05)
    slow.record(2, 0.08)
    assert best_draft_length(0.05, 3, slow) == 0


@pytest.mark.parametrize("sliding", [False, True])
def test_the_fixed_shape_mask_over_buffers_is_the_mask_over_the_layout(sliding):
    """compile=True's tree inputs (tree.buffered_tree_inputs: the tree padded with nodes that are not valid, placed
    after a start that is a tensor, over a BufferedLayout's buffers as wide as the cache, stale columns past its
    length included) equal tree_inputs over the layout's columns, for every real node: mask (each layer type's),
    positions, ancestors and depths; the padding nodes see the layout and the root, so no row is all masked."""
    from types import SimpleNamespace

    from hf_specdec.tree import buffered_tree_inputs, tree_inputs

    g = torch.Generator().manual_seed(5)
    bsz, length, width = 3, 9, 24
    config = SimpleNamespace(sliding_window=4 if sliding else None, _attn_implementation="sdpa",
                             layer_types=["sliding_attention", "full_attention"] if sliding else None)
    valid = torch.rand(bsz, length, generator=g) > 0.3  # holes
    valid[:, -1] = True
    positions = valid.long().cumsum(1) - 1
    layout = cache_ops.BufferedLayout(bsz, width, "cpu")
    for buf in layout.buffers:  # stale columns past the length: never seen
        buf.fill_(1)
    layout.load(cache_ops.CacheLayout(valid, positions, torch.zeros(bsz, length, dtype=torch.long)))
    tree = _tree(bsz, torch.tensor([5, 6, 7]))
    tree.valid[1, 5:] = False  # a row with fewer nodes
    roots = positions[:, -1] + 1
    anc, depths, pos, mask = tree_inputs(config, tree.parents, tree.valid, False, roots, layout.valid,
                                         layout.positions, torch.float32, width)
    n, q = 8, tree.num_nodes
    packed = tree.packed(n, torch.zeros(bsz, n - q, dtype=torch.long))
    tokens, valid_p, anc_p, depths_p, pos_p, mask_p = buffered_tree_inputs(
        layout, packed, torch.tensor([length, 1, 1, 1]), roots, config, False, torch.float32)
    masks, masks_p = (mask, mask_p) if sliding else ({"full": mask}, {"full": mask_p})
    assert set(masks) == set(masks_p)
    for kind in masks:
        assert torch.equal(masks_p[kind][:, :, :q], masks[kind])
        assert (masks_p[kind][:, :, q:] == 0).any(-1).all()  # a padding node sees something
        assert (masks_p[kind][:, :, :, length + q:] != 0).all()  # nothing sees a padding node's column, or past it
    assert torch.equal(tokens[:, :q], tree.tokens) and torch.equal(valid_p[:, :q], tree.valid)
    assert not valid_p[:, q:].any()
    assert torch.equal(anc_p[:, :q, :q], anc) and torch.equal(depths_p[:, :q], depths)
    assert torch.equal(pos_p[:, :q], pos)
