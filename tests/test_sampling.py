"""Speculative sampling is distributed exactly as the target's own sampling (chi-square over thousands of draws):
rejection sampling for every method, coupled sampling (the default) for the plain loop and methods with sampled,
deterministic and tree drafts (the coupled text of every other method equals the plain loop's: test_coupled.py).

A tiny vocabulary makes the exact distribution of the first few generated tokens computable by enumeration; every
sample comes from one row of a large batch, so thousands of draws take a few generate calls.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import hf_specdec
from hf_specdec.proposers.base import Proposer
from hf_specdec.tree import DraftTree
from tiny import one_thread, tiny_model

V = 6
NEW = 3
ROWS = 1500
CALLS = 4
WARP = dict(temperature=1.4, top_k=4)


def _target():
    return tiny_model("llama", seed=21, vocab=V, hidden=16, scale=1.5)


def _exact_distribution(model, prompt, processors):
    """P(t1, t2, t3) under the target with the call's processors, by enumeration."""
    probs = {}
    for seq in itertools.product(range(V), repeat=NEW):
        p = 1.0
        for i in range(NEW):
            prefix = torch.tensor([prompt + list(seq[:i])])
            with torch.no_grad():
                logits = model(prefix).logits[:, -1].float()
            q = torch.softmax(processors(prefix, logits), dim=-1)[0]
            p *= float(q[seq[i]])
            if p == 0:
                break
        probs[seq] = p
    return probs


class SampledTree(Proposer):
    """Each node gets 2 children drawn i.i.d. from a fixed random distribution p (SpecInfer-style tree)."""

    name = "sampled_tree"
    max_nodes = 7

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.p = torch.distributions.Dirichlet(torch.ones(V)).sample((1,))[0]

    def propose(self, state):
        bsz = state.batch_size
        parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2]).expand(bsz, 7)
        tokens = torch.multinomial(self.p.expand(bsz, V), 7, replacement=True)
        tokens[:, 0] = state.roots()
        depth_ok = torch.tensor([0, 1, 1, 2, 2, 2, 2])[None] <= torch.tensor(state.max_drafts)[:, None]
        probs = self.p.expand(bsz, 7, V).clone()
        return DraftTree(tokens=tokens, parents=parents.clone(), valid=depth_ok, draft_probs=probs)


class TopKTree(Proposer):
    """Deterministic children: at every node the 2 tokens the *target* ranks lowest... here a fixed pair per depth."""

    name = "topk_tree"
    max_nodes = 7

    def propose(self, state):
        bsz = state.batch_size
        parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2]).expand(bsz, 7).clone()
        tokens = torch.tensor([0, 3, 1, 2, 4, 3, 5]).expand(bsz, 7).clone()
        tokens[:, 0] = state.roots()
        depth_ok = torch.tensor([0, 1, 1, 2, 2, 2, 2])[None] <= torch.tensor(state.max_drafts)[:, None]
        return DraftTree(tokens=tokens, parents=parents, valid=depth_ok)


def _sample(model, prompt, custom, sampling="rejection", **kw):
    counts = {}
    ids = torch.tensor([prompt] * ROWS)
    stats = []
    for call in range(CALLS):
        torch.manual_seed(1000 + call)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, custom_generate=custom,
                             return_dict_in_generate=True, speculative_sampling=sampling, **WARP, **kw)
        stats.append(out.speculative_stats)
        for row in out.sequences[:, len(prompt):].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, stats


def _chi2(counts, exact):
    cells = sorted(exact, key=lambda s: -exact[s])
    total = sum(counts.values())
    obs, exp = [], []
    rest_o = rest_e = 0.0
    for s in cells:
        e = exact[s] * total
        if e >= 5:
            obs.append(counts.get(s, 0))
            exp.append(e)
        else:
            rest_o += counts.get(s, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    # any sample outside the support would already be a failure
    assert all(exact.get(s, 0) > 0 for s in counts), "sampled a sequence the target can never produce"
    scale = total / sum(exp)  # fp32 probabilities sum to 1 only up to rounding (which depends on the thread count)
    return chisquare(obs, [e * scale for e in exp])


PROMPT = [3, 4, 5, 3, 4]


def _with_exact(model):
    processors = model._get_logits_processor(
        generation_config=model.generation_config.__class__(do_sample=True, **WARP),
        input_ids_seq_length=len(PROMPT), encoder_input_ids=None, prefix_allowed_tokens_fn=None,
        logits_processor=None, device="cpu", model_kwargs={})
    return model, _exact_distribution(model, PROMPT, processors)


@pytest.fixture(scope="module")
def target_and_exact():
    return _with_exact(_target())


@pytest.fixture(scope="module")
def bf16_target_and_exact():
    """The target in bfloat16, with its own distribution (the bf16 forwards' logits)."""
    with one_thread():  # bf16 at tiny shapes: no waiting on a thread pool (tiny.one_thread)
        return _with_exact(_target().to(torch.bfloat16))


def _eagle3_drafter():
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

    torch.manual_seed(3)
    config = Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=V, draft_vocab_size=V, num_target_layers=2, target_layer_ids=[0, 1, 2],
                          initializer_range=0.5)
    return Eagle3Drafter(config).eval()


def _dflash_drafter():
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(4)
    config = DFlashConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=V, block_size=3, mask_token_id=V - 1,
                          target_layer_ids=[0, 1], num_target_layers=2, initializer_range=0.5)
    return DFlashDrafter(config).eval()


def _medusa_heads():
    from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(6)
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=V, medusa_num_heads=2)).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    return heads


def _exit_adapter(model):
    from hf_specdec.modeling.layerskip import ExitAdapter, ExitAdapterConfig

    torch.manual_seed(7)
    config = ExitAdapterConfig(exit_layer=1, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=4, intermediate_size=8, vocab_size=V, draft_vocab_size=4, num_target_layers=2)
    adapter = ExitAdapter(config).init_from_target(model, torch.tensor([0, 2, 3, 5]))
    with torch.no_grad():
        for layer in adapter.layers:
            layer.o_proj.weight.normal_(0, 0.5)
    return adapter.eval()


def _mtp_module(model, parallel=False):
    from hf_specdec.modeling.mtp import MTPConfig, MTPModule, ParallelMTPConfig, ParallelMTPHeads, block_config_for

    torch.manual_seed(8)
    if parallel:  # two heads over 4 of the 6 tokens: q is zero on the other two
        heads = ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(model.config, 2), num_modules=2,
                                                   vocab_size=V, draft_vocab_size=4))
        heads.set_draft_vocabulary(torch.tensor([0, 2, 3, 5]))
        return heads.init_from_target(model).eval()
    module = MTPModule(MTPConfig(block_config=block_config_for(model.config, 1), vocab_size=V))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else None
    return module.eval()


@pytest.mark.parametrize("method", ["assisted", "assisted_draft_vocab", "prompt_lookup", "sampled_tree", "topk_tree", "eagle3_tree",
                                    "eagle3_chain", "dflash", "medusa", "layerskip", "layerskip_adapter", "mtp_chain",
                                    "mtp_parallel", "suffix", "assisted_hybrid", "lookahead"])
def test_speculative_sampling_matches_target(target_and_exact, method):
    model, exact = target_and_exact
    counts, stats = _sample(model, PROMPT, _custom(model, method))
    accepted = sum(s["accepted_drafts"] for s in stats)
    proposed = sum(s["proposed_drafts"] for s in stats)
    assert 0 < accepted < proposed, "the test must see both accepted and rejected drafts"
    result = _chi2(counts, exact)
    assert result.pvalue > 1e-3, result


def _custom(model, method):
    """The decoding method ``method`` (a case of :func:`test_speculative_sampling_matches_target`) for ``model``."""
    if method == "assisted":
        drafter = tiny_model("llama", seed=5, vocab=V, hidden=16, scale=1.5)
        custom = hf_specdec.decoding_method("assisted", drafter=drafter, num_speculative_tokens=2)
    elif method == "assisted_draft_vocab":  # drafts never propose tokens 0 and 3: q is zero there, p is not
        drafter = tiny_model("llama", seed=5, vocab=V, hidden=16, scale=1.5)
        custom = hf_specdec.decoding_method("assisted", drafter=drafter, num_speculative_tokens=2,
                                            draft_vocab=[1, 2, 4, 5])
    elif method == "prompt_lookup":
        custom = hf_specdec.decoding_method("prompt_lookup", draft_length_schedule="constant",
                                            max_matching_ngram_size=1)
    elif method == "lookahead":  # window and pool n-grams: deterministic drafts, several siblings at the root
        custom = hf_specdec.decoding_method("lookahead", draft_length_schedule="constant", window_size=2,
                                            ngram_size=3, guess_set_size=2)
    elif method == "suffix":  # a tree of continuations, from this call and the earlier ones (a shared cache)
        custom = hf_specdec.decoding_method("suffix", draft_length_schedule="constant",
                                            suffix_cache=hf_specdec.SuffixCache(max_sequences=64))
    elif method == "assisted_hybrid":  # sampled drafts and copied ones (point masses) in one batch
        drafter = tiny_model("llama", seed=5, vocab=V, hidden=16, scale=1.5)
        custom = hf_specdec.decoding_method("assisted", drafter=drafter, num_speculative_tokens=2, hybrid="suffix")
    elif method == "sampled_tree":
        custom = hf_specdec.decoding_method(SampledTree())
    elif method == "eagle3_tree":
        custom = hf_specdec.decoding_method("eagle3", drafter=_eagle3_drafter(), tree_top_k=2, tree_depth=3,
                                            tree_total_tokens=6, draft_length_schedule="constant")
    elif method == "dflash":
        custom = hf_specdec.decoding_method("dflash", drafter=_dflash_drafter(), draft_length_schedule="constant")
    elif method == "medusa":  # a static top-k tree: deterministic drafts, several siblings per node
        custom = hf_specdec.decoding_method("medusa", drafter=_medusa_heads(),
                                            medusa_choices=[[0], [1], [0, 0], [0, 1], [1, 0]],
                                            draft_length_schedule="constant")
    elif method == "layerskip":  # the target's own first layer + its head draft (sampled from that distribution)
        custom = hf_specdec.decoding_method("layerskip", exit_layer=1, num_speculative_tokens=2)
    elif method == "layerskip_adapter":  # through an adapter over 4 of the 6 tokens: q is zero on the other two
        custom = hf_specdec.decoding_method("layerskip", drafter=_exit_adapter(model), num_speculative_tokens=2)
    elif method == "mtp_chain":  # the module applied again: drafts sampled from its distributions
        custom = hf_specdec.decoding_method("mtp", drafter=_mtp_module(model), num_speculative_tokens=2,
                                            draft_length_schedule="constant")
    elif method == "mtp_parallel":
        custom = hf_specdec.decoding_method("mtp", drafter=_mtp_module(model, parallel=True),
                                            draft_length_schedule="constant")
    elif method == "eagle3_chain":
        custom = hf_specdec.decoding_method("eagle3", drafter=_eagle3_drafter(), num_speculative_tokens=2,
                                            draft_length_schedule="constant")
    else:
        custom = hf_specdec.decoding_method(TopKTree())
    return custom


@pytest.mark.parametrize("method", ["sampled_tree", "eagle3_tree", "dflash"])
def test_speculative_sampling_matches_a_bfloat16_target(bf16_target_and_exact, method):
    """The same test on a bf16 target, drafters in its dtype: sampled as the bf16 target samples, at the same
    significance."""
    model, exact = bf16_target_and_exact
    if method == "sampled_tree":  # random drafts: fp32 draft probabilities against the bf16 target's
        custom = hf_specdec.decoding_method(SampledTree())
    elif method == "eagle3_tree":
        custom = hf_specdec.decoding_method("eagle3", drafter=_eagle3_drafter().to(torch.bfloat16), tree_top_k=2,
                                            tree_depth=3, tree_total_tokens=6, draft_length_schedule="constant")
    else:
        custom = hf_specdec.decoding_method("dflash", drafter=_dflash_drafter().to(torch.bfloat16),
                                            draft_length_schedule="constant")
    with one_thread():
        counts, stats = _sample(model, PROMPT, custom)
    accepted = sum(s["accepted_drafts"] for s in stats)
    proposed = sum(s["proposed_drafts"] for s in stats)
    assert 0 < accepted < proposed, "the test must see both accepted and rejected drafts"
    result = _chi2(counts, exact)
    assert result.pvalue > 1e-3, result


def test_chi_square_detects_a_wrong_distribution(target_and_exact):
    """Negative control: sampling without the target's warpers is caught by the same test."""
    model, exact = target_and_exact
    counts = {}
    ids = torch.tensor([PROMPT] * ROWS)
    for call in range(CALLS):
        torch.manual_seed(call)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0, temperature=1.0, top_k=0)
        for row in out[:, len(PROMPT):].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    exact_no_support_check = {s: max(p, 1e-12) for s, p in exact.items()}
    assert _chi2(counts, exact_no_support_check).pvalue < 1e-3


@pytest.mark.parametrize("method", ["plain", "eagle3_tree", "assisted", "sampled_tree"])
def test_coupled_sampling_matches_target(target_and_exact, method):
    """Coupled (Gumbel-max) sampling: each position an exact sample of the target's processed distribution."""
    model, exact = target_and_exact
    if method == "plain":
        custom = hf_specdec.decoding_method("plain")
    elif method == "eagle3_tree":
        custom = hf_specdec.decoding_method("eagle3", drafter=_eagle3_drafter(), tree_top_k=2, tree_depth=3,
                                            tree_total_tokens=6, draft_length_schedule="constant")
    elif method == "assisted":
        drafter = tiny_model("llama", seed=5, vocab=V, hidden=16, scale=1.5)
        custom = hf_specdec.decoding_method("assisted", drafter=drafter, num_speculative_tokens=2)
    else:  # drafts that ignore the noise (sampled from a fixed distribution): the text is the same
        custom = hf_specdec.decoding_method(SampledTree())
    counts, stats = _sample(model, PROMPT, custom, sampling="coupled")
    assert all(s["sampling"] == "coupled" for s in stats)
    if method != "plain":
        accepted = sum(s["accepted_drafts"] for s in stats)
        assert 0 < accepted < sum(s["proposed_drafts"] for s in stats)
    result = _chi2(counts, exact)
    assert result.pvalue > 1e-3, result
