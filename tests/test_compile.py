"""The ``compile`` option (hf_specdec.compiled): verification through torch.compile at bucket sizes over a static
cache. Greedy outputs stay the target's own; after a warm-up call a second call compiles nothing new; padding nodes
change no node's logits. Inductor on the CPU compiles for seconds per size, so most tests run dynamo with its
``eager`` backend (the same graphs, guards and recompilations, no code generation) and one runs inductor."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, StaticCache

import hf_specdec
from eagle3_fixtures import H, random_weights
from hf_specdec import cache as cache_ops
from hf_specdec.compiled import CompiledRunner, bucket_size
from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
from hf_specdec.runner_choice import runner_for
from hf_specdec.runners import TargetRunner
from hf_specdec.tree import build_attention_mask
from tiny import on_device, prompts, tiny_model

pytestmark = pytest.mark.device  # pytest --device cuda runs these there (docs/gpu.md)

KW = dict(do_sample=False, eos_token_id=None)


@pytest.fixture()
def eager_backend(monkeypatch):
    monkeypatch.setattr(CompiledRunner, "backend", "eager")


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_bucket_sizes():
    assert [bucket_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 128, 129)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64, 128, 128, 192]


def test_runner_choice_and_the_kept_static_cache(eager_backend):
    """compile=True's loop cache is a static one kept by the runner per batch size: the same tensors (emptied) in a
    later call of any prompt length, so graphs recorded over them replay; a longer call's length (rounded up) holds
    for every call after it; the caller gets a copy back, never the kept one."""
    model = tiny_model("llama")
    runner = runner_for(model, compile=True)
    assert isinstance(runner, CompiledRunner) and runner is runner_for(model, compile=True)
    assert type(runner_for(model, kernels=False)) is TargetRunner
    cache = runner.loop_cache(DynamicCache(), capacity=100, batch_size=1)
    assert isinstance(cache, StaticCache) and cache.get_max_length() == CompiledRunner.MIN_CACHE
    assert runner.loop_cache(None, capacity=200, batch_size=1) is cache
    assert runner.loop_cache(None, capacity=200, batch_size=2) is not cache  # one per batch size
    assert runner.loop_cache(None, capacity=700, batch_size=1).get_max_length() == 768
    assert runner.loop_cache(None, capacity=10, batch_size=1).get_max_length() == 768
    ids, mask = prompts(1, 7, seed=1)
    outs = []
    for _ in range(2):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, **KW, compile=True,
                             return_dict_in_generate=True, custom_generate=hf_specdec.decoding_method("plain"))
        kept = runner.caches[(1, 768, str(model.dtype), str(model.device))]
        assert out.cache is not kept and out.cache.layers[0].keys.data_ptr() != kept.layers[0].keys.data_ptr()
        outs.append((out.sequences, out.cache.layers[0].keys.data_ptr(), kept.layers[0].keys.data_ptr()))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][2] == outs[1][2]  # the same kept tensors both calls
    assert cache_ops.cache_length(out.cache) == ids.shape[1] + 4


def test_a_size_oblivious_region_the_backend_refuses_compiles_again_without(monkeypatch):
    """The loop's own regions compile with size-oblivious sizes (one graph for trees of 1, 2 and more nodes); a
    function the backend cannot compile so is compiled again without, and gives the same result."""
    import contextlib

    from hf_specdec import compiled as compiled_mod
    from hf_specdec.verify import greedy_rule

    runner = CompiledRunner(tiny_model("llama", layers=1))
    runner.backend = "eager"
    tokens, logits = torch.tensor([[5, 1, 2]]), torch.randn(1, 3, 8)
    args = (tokens, (torch.arange(3) - 1)[None], torch.ones(1, 3, dtype=torch.bool), None, None, logits, True)
    want = greedy_rule(*args)

    @contextlib.contextmanager
    def refused():
        raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("lowering refused"), None)
        yield

    monkeypatch.setattr(compiled_mod, "_oblivious", refused)
    got = runner.fused(greedy_rule, oblivious=True)(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_compiled_session_needs_a_static_cache():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="static KV cache.*cache_implementation='static'"):
        runner_for(model, compile=True).session(DynamicCache())


def test_padding_nodes_change_no_logits(eager_backend):
    """A 3-node tree verified at 4 nodes (and cut to room when the cache is nearly full) gives the logits and hidden
    states of the unpadded forward; the padding column lies after the tree's."""
    model = tiny_model("llama", layers=2)
    ids, _ = prompts(2, 10, pad=False)
    tokens = torch.randint(3, 90, (2, 3))
    pos = torch.arange(10, 13)[None].expand(2, -1)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None].expand(2, 3, 3)  # root, 2 kids

    def run(runner, capacity, room=None):
        cache = cache_ops.new_cache_like(model, StaticCache(config=model.config, max_cache_len=1), capacity)
        with torch.no_grad(), runner.session(cache, hidden_states=[1, 2]) as target:
            model(input_ids=ids, cache=cache, use_cache=True)
            mask = build_attention_mask(model.config, torch.ones(2, 10, dtype=torch.bool), torch.arange(10)[None]
                                        .expand(2, -1), pos, tree, model.dtype, kv_width=target.kv_width)
            target._past = None if room is None else target.kv_width - room
            out = target.forward(tokens, mask, pos)
        return out.logits, out.hidden_states

    ref_logits, ref_hidden = run(TargetRunner(model), 13)
    for capacity, room in ((64, None), (13, 3)):
        logits, hidden = run(CompiledRunner(model), capacity, room)
        assert logits.shape == (2, 3, model.config.vocab_size)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        for i in (1, 2):
            torch.testing.assert_close(hidden[i], ref_hidden[i], rtol=1e-5, atol=1e-5)


def test_a_buffered_layout_compacts_in_place(eager_backend, monkeypatch):
    """compile=True holds the layout in buffers as wide as the static cache (cache.BufferedLayout); a padded batch
    whose rows accept different lengths leaves holes, and in a small cache the loop compacts: in place, the buffers
    kept, and the output stays the target's own greedy one."""
    import test_syncs

    monkeypatch.setattr(CompiledRunner, "MIN_CACHE", 16)
    monkeypatch.setattr(CompiledRunner, "CACHE_STEP", 8)
    target = test_syncs._target()
    ids, mask = prompts(3, 12, seed=5)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=300, **KW)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=300, **KW, compile=True,
                          return_dict_in_generate=True, custom_generate=test_syncs.method("prompt_lookup", target))
    assert torch.equal(out.sequences, ref) and out.speculative_stats["compactions"] >= 1
    assert [type(kept) for kept in runner_for(target, compile=True).layouts.values()] == [cache_ops.BufferedLayout]


def test_a_rule_on_the_host_grows_the_buffered_layout(eager_backend):
    """Greedy with a logits processor (a repetition penalty) verifies on the host, not in the fixed-shape rule: the
    buffered layout then takes the step's columns from the layout's functions (BufferedLayout.grow), and the output
    stays the target's own."""
    import test_syncs

    target = test_syncs._target()
    ids, mask = prompts(3, 12, seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, repetition_penalty=1.3, **KW)
    out = target.generate(**kw, compile=True, custom_generate=test_syncs.method("prompt_lookup", target))
    assert torch.equal(out, target.generate(**kw))


def _eagle3(target):
    """A tiny random EAGLE-3 drafter for ``target`` (as tests/test_eagle3.py makes them)."""
    weights = random_weights(target_hidden=target.config.hidden_size, seed=0, scale=0.5)
    config = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=target.config.vocab_size, draft_vocab_size=weights["lm_head.weight"].shape[0],
                          num_target_layers=target.config.num_hidden_layers)
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(weights, strict=False)
    return on_device(drafter.eval())


# the methods drafting at fixed shapes here, and the graphs each region compiles on the first call: EAGLE-3's feed at
# 1, 2, 4, 8 and 16 rows, its tree at depth limits 1, 2 and 3, its ranking (with and without depth budgets) and its
# tree of 1, 3 and 4 nodes after the root; DFlash's block after 1..16 context rows and its top tokens; MTP's feed, its
# chain of 1 and 2 drafts and its tree of 0, 1 and 2; a draft model's feed and its chain of 1, 2 and 3; LayerSkip's
# drafting step (over the target's own cache) with an exit adapter and the adapter's feeds (Medusa:
# test_sampling_with_a_compiled_proposal)
# the regions compiled per method (the loop's cache commit, commit_columns: a graph per bucket of kept columns, every
# bucket up to the proposer's longest path warmed at the first commit)
# the step's own regions: the tree's mask and the greedy rule at every bucket up to the largest tree, for the chains
# and the trees a call meets (EAGLE-3 and DFlash: both), the cache commit at every bucket of kept columns; LayerSkip's
# verification resumes from its early exit: layers E.. over the padded tree at every bucket of its own chains
# (resumed_layers: 1, 2, 4 nodes; the step's other regions at every bucket of the hybrid lookup's trees too), after the
# last draft's early layers (_early_region)
STEP = {"eagle3": 8, "dflash_tree": 8, "mtp": 3, "assisted": 3, "layerskip": 7}
FIXED = {name: {**regions, **({"buffered_tree_inputs": STEP[name], "greedy_step": STEP[name]} if name in STEP else {})}
         for name, regions in {
    "eagle3": {"_buffered_feed_region": 5, "_expand_fixed": 3, "_rank_region": 2, "_tree_region": 3,
               "commit_columns": 3},
    "dflash_tree": {"_buffered_block_region": 5, "_top_region": 1, "commit_columns": 3},
    "mtp": {"_buffered_feed_region": 5, "_draft_chain_fixed": 2, "_chain_region": 3, "commit_columns": 3},
    "assisted": {"_buffered_feed_region": 5, "_chain_region": 3, "commit_columns": 3},
    "layerskip": {"_draw_region": 1, "_early_region": 1, "resumed_layers": 3, "_adapter_feed_region": 5,
                  "commit_columns": 7}}.items()}


@pytest.mark.parametrize("name", list(FIXED))
def test_drafters_draft_at_fixed_shapes(name, eager_backend, monkeypatch):
    """compile=True drafts at fixed shapes (hf_specdec.graphs; a CUDA graph per shape on a GPU): the drafter's cache a
    fixed one kept by the runner, the context fed at bucket sizes, the drafting one graph per depth limit (EAGLE-3's
    tree, MTP's chain) or the block after each bucket of context (DFlash), each compiled whole (no graph break, no
    host read) on the first call. A padded batch whose rows accept different lengths decodes as the target's own
    greedy generate(); a second call with another prompt length compiles nothing at all (no verification size,
    drafter context length or row budget is a new graph: host bookkeeping is never traced, hf_specdec.syncs.host_side).
    The second call and (EAGLE-3) a coupled sampling call (the plain method's text for the seed) take the GPU's path, a
    graph per shape over input buffers of its own, with a stand-in for the CUDA graph (:class:`_ReplayOnTheCpu`)."""
    import test_syncs
    from hf_specdec.cache import FixedDraftCache
    from hf_specdec.graphs import FixedShapeRegion
    from test_coupled import _run

    bsz = 2
    if name == "eagle3":
        target = tiny_model("llama", layers=4, hidden=H)
        method = hf_specdec.decoding_method("eagle3", drafter=_eagle3(target), tree_top_k=2, tree_depth=3,
                                            tree_total_tokens=5, draft_length_schedule="constant", compile=True)
    elif name == "layerskip":  # with an exit adapter of a smaller draft vocabulary
        from test_layerskip import random_adapter

        target = test_syncs._target()
        adapter = random_adapter(target, exit_layer=1, draft_vocab=target.config.vocab_size // 2, seed=3)
        method = hf_specdec.decoding_method("layerskip", drafter=adapter, num_speculative_tokens=3)
    else:
        target = test_syncs._target()
        method = test_syncs.method(name, target)
    runner = runner_for(target, compile=True)
    graphs, compiles = [], []
    for length in (12, 15):
        ids, mask = prompts(bsz, length, seed=bsz)
        ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **KW)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **KW, compile=True,
                              return_dict_in_generate=True, custom_generate=method)
        assert torch.equal(out.sequences, ref)
        assert out.speculative_stats["proposed_drafts"] > 0
        regions = {key[0].__name__: fn for key, fn in runner.compiled_fns.items() if isinstance(fn, FixedShapeRegion)}
        assert set(regions) == set(FIXED[name]) and all(r.calls for r in regions.values())
        assert [type(kept[1]) for kept in runner.draft_buffers.values()] == [FixedDraftCache]
        compiles.append({name: r.compiles for name, r in regions.items()})
        graphs.append(_graphs())
        if target.device.type == "cpu":  # from here on the graph path, a stand-in replaying on the CPU
            monkeypatch.setattr(FixedShapeRegion, "GRAPHED", ("cuda", "cpu"))
            monkeypatch.setattr(FixedShapeRegion, "GRAPH", _ReplayOnTheCpu)
    assert compiles[0] == compiles[1] == FIXED[name]
    assert graphs[1] == graphs[0]
    assert all(0 < r.captures <= FIXED[name][n] for n, r in regions.items())  # each shape used, captured once
    if name == "layerskip":  # the plain exit (no adapter) drafts through the same step region
        plain = test_syncs.method("layerskip", target)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **KW, compile=True,
                              return_dict_in_generate=True, custom_generate=plain)
        assert torch.equal(out.sequences, ref) and out.speculative_stats["proposed_drafts"] > 0
    if name != "eagle3":  # MTP perturbs as EAGLE-3 in its regions, DFlash after its region as when eager
        return
    ref, _ = _run(target, hf_specdec.decoding_method("plain"), bsz, seed=11)
    out, stats = _run(target, method, bsz, seed=11, compile=True)
    assert out == ref and stats["sampling"] == "coupled" and stats["proposed_drafts"] > 0
    # the coupled rule's walks (to a power-of-2 depth) up to the tree's depth (3) compiled at its first use
    from hf_specdec.verify import _WALKS, coupled_rule
    assert all(walks >= {0, 1, 3} for walks in _WALKS[runner.compiled_fns[coupled_rule, "step"]].values())


class _ReplayOnTheCpu:
    """A CUDA graph stood in for on the CPU (:class:`hf_specdec.graphs.Graph`'s interface): a replay runs the captured
    function again over the graph's own input buffers and writes its outputs into the tensors of the capture, as a
    replay overwrites a graph's outputs."""

    def __init__(self, run, device):
        self.run = run
        for _ in range(2):
            run()
        self.out = run()

    def replay(self):
        fresh = self.run()
        for old, new in zip(torch.utils._pytree.tree_leaves(self.out), torch.utils._pytree.tree_leaves(fresh)):
            if isinstance(old, torch.Tensor):
                old.copy_(new)
        return self.out


def test_sliding_window_masks_and_layerskip_resume(eager_backend):
    """gemma3 (a {layer type: mask} mapping, padded per type) with prompt_lookup, and LayerSkip, whose verification
    resumes from its early exit over the static cache (one compiled region, :meth:`DecoderStack.resume`)."""
    from test_layerskip import agreeable

    target = agreeable("gemma3", layers=4)
    ids, mask = prompts(2, 12, seed=3)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **KW)
    for method, opts in (("prompt_lookup", dict(prompt_lookup_num_tokens=3)),
                         ("layerskip", dict(exit_layer=2, num_speculative_tokens=3))):
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **KW, compile=True,
                              return_dict_in_generate=True, draft_length_schedule="constant",
                              custom_generate=hf_specdec.decoding_method(method), **opts)
        assert torch.equal(out.sequences, ref), method
        assert out.speculative_stats["proposed_drafts"] > 0, method


def test_prompt_lookup_compiled_with_inductor_lossless_and_no_recompile():
    """The real thing on a CPU: inductor, three sizes (1, 2, 4 nodes), the greedy output of the target's own
    generate(); a second call (another prompt length) compiles nothing, and under ``--device cuda`` records no CUDA
    graph."""
    from hf_specdec.graphs import counting_captures

    target = tiny_model("llama", layers=2)
    kw = dict(max_new_tokens=24, **KW, draft_length_schedule="constant", prompt_lookup_num_tokens=2)
    graphs, recorded = [], []
    for length in (12, 15):
        ids, mask = prompts(1, length, seed=length)
        ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, **KW)
        with counting_captures() as captures:  # on a GPU: CUDA graph trees' recordings (none on a CPU)
            out = target.generate(input_ids=ids, attention_mask=mask, **kw, return_dict_in_generate=True,
                                  compile=True, custom_generate=hf_specdec.decoding_method("prompt_lookup"))
        assert torch.equal(out.sequences, ref)
        assert out.speculative_stats["accepted_drafts"] > 0
        graphs.append(_graphs())
        recorded.append(captures[0])
    assert graphs[1] == graphs[0]
    assert recorded[1] == 0  # the kept static cache: the first call's CUDA graphs replay (CompiledRunner.loop_cache)


def test_bench_method_string_takes_compile():
    from hf_specdec.bench.methods import build_methods

    methods = build_methods(["prompt_lookup:compile=1", "prompt_lookup"])
    assert [m.kwargs["custom_generate"].defaults.get("compile") for m in methods] == [True, None]


@pytest.mark.parametrize("name", ["medusa", pytest.param("eagle3_chain", marks=pytest.mark.extended),
                                  pytest.param("assisted", marks=pytest.mark.extended)])
def test_sampling_with_a_compiled_proposal(name, eager_backend, monkeypatch):
    """Sampling under compile=True, the proposal (its draws, its coupled noise) inside compiled code, at fixed shapes
    (the three methods draft so; the coupled call through the graph path, replayed on the CPU): coupled sampling gives
    the plain method's text for the seed (a padded batch of 3), and rejection sampling draws the target's exact
    distribution (test_sampling's chi-square over 6,000 samples). EAGLE-3's chain and a draft model's with
    ``pytest --extended``."""
    import test_sampling
    import test_syncs
    from test_coupled import _run

    from hf_specdec.graphs import FixedShapeRegion

    model = test_syncs._target()
    ref, _ = _run(model, hf_specdec.decoding_method("plain"), 3, seed=11)
    with monkeypatch.context() as graphed:  # the fixed-shape drafting's graph path, replayed on the CPU
        graphed.setattr(FixedShapeRegion, "GRAPHED", ("cuda", "cpu"))
        graphed.setattr(FixedShapeRegion, "GRAPH", _ReplayOnTheCpu)
        out, stats = _run(model, test_syncs.method(name, model), 3, seed=11, compile=True)
    assert out == ref and stats["sampling"] == "coupled" and stats["proposed_drafts"] > 0
    model, exact = test_sampling._with_exact(test_sampling._target())
    monkeypatch.setattr(test_sampling, "ROWS", 300)  # 20 calls of 300 rows: a smaller batch to compile
    monkeypatch.setattr(test_sampling, "CALLS", 20)
    counts, stats = test_sampling._sample(model, test_sampling.PROMPT, test_sampling._custom(model, name),
                                          compile=True)
    accepted, proposed = (sum(s[k] for s in stats) for k in ("accepted_drafts", "proposed_drafts"))
    assert 0 < accepted < proposed, "the test must see both accepted and rejected drafts"
    assert test_sampling._chi2(counts, exact).pvalue > 1e-3
