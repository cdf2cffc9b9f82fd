"""Coupled (Gumbel-max) sampling: the text is a function of the seed, the same for every method.

For every method, at batch 1 and a padded batch of 3, sampled with temperature and top-p: the output equals the
``plain`` method's (the loop without drafts) for the same seed token for token; the same seed repeats (with the
adaptive schedules, whose draft lengths follow timings), another seed gives another text; ``torch.manual_seed``
before the call, ``seed=`` and ``generator=`` fix it. The sampler's distribution is checked against the target's
exact one in ``test_sampling.py``; the noise itself here.
"""

import pytest
import torch
from scipy.stats import chisquare

import hf_specdec
from hf_specdec import registry
from hf_specdec.coupling import CoupledNoise, gumbel, position_key
from hf_specdec.hub_cache import write_cached_repo
from test_syncs import METHODS, V, method, _target
from tiny import prompts, tiny_model

pytestmark = pytest.mark.device  # pytest --device cuda runs these there (docs/gpu.md)

NEW = 24
WARP = dict(temperature=0.8, top_p=0.9)


def _inputs(bsz):
    ids, mask = prompts(3, length=16, seed=5)
    ids[:, -6:] = ids[:, -12:-6]  # something to copy for the lookup methods
    return ids[:bsz], mask[:bsz]


def _run(model, custom, bsz, **kw):
    ids, mask = _inputs(bsz)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, eos_token_id=None,
                         pad_token_id=0, custom_generate=custom, return_dict_in_generate=True, **{**WARP, **kw})
    return out.sequences.tolist(), out.speculative_stats


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("name", METHODS)
def test_coupled_output_equals_plain(target, name, bsz):
    ref, ref_stats = _run(target, hf_specdec.decoding_method("plain"), bsz, seed=11)
    out, stats = _run(target, method(name, target), bsz, seed=11)
    assert stats["sampling"] == ref_stats["sampling"] == "coupled"
    assert stats["seed"] == 11
    assert out == ref
    assert stats["proposed_drafts"] > 0, "the method must have drafted"


@pytest.mark.parametrize("name", ["prompt_lookup", "eagle3", "assisted"])
def test_adaptive_schedules_repeat_and_seeds_differ(target, name):
    """The adaptive schedules (draft lengths from measured timings): the same seed, the same text."""
    custom = method(name, target)
    custom.defaults.pop("draft_length_schedule", None)  # the method's default: adaptive
    plain = hf_specdec.decoding_method("plain")
    torch.manual_seed(0)
    a, stats = _run(target, custom, 3)
    torch.manual_seed(0)
    b, _ = _run(target, custom, 3)
    assert a == b
    assert _run(target, plain, 3, seed=stats["seed"])[0] == a  # the reported seed gives the call again
    assert _run(target, custom, 3, seed=stats["seed"] + 1)[0] != a


def test_generator_gives_the_seed(target):
    plain = hf_specdec.decoding_method("plain")
    a, _ = _run(target, plain, 1, generator=torch.Generator().manual_seed(5))
    b, _ = _run(target, method("prompt_lookup", target), 1, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    c, _ = _run(target, plain, 1, generator=gen)
    d, _ = _run(target, plain, 1, generator=gen)  # the generator moved on: the next call differs
    assert a == b == c != d


# ---- torch.manual_seed before the call: the call's seed is its first draw, nothing else of it moves the generator
def _under_manual_seed(model, custom, **kw):
    """The call's sequences and seed under ``torch.manual_seed(3)``, and torch's next global draw after the call."""
    torch.manual_seed(3)
    out, stats = _run(model, custom, 1, **kw)
    return out, stats["seed"], torch.rand(()).item()


@pytest.mark.parametrize("name", METHODS)
def test_manual_seed_gives_plains_text_first_and_later_calls(target, name):
    """Drafters given as modules (MTP's binds its target's head at every call, a draw before the fix)."""
    ref = _under_manual_seed(target, hf_specdec.decoding_method("plain"))
    custom = method(name, target)
    assert _under_manual_seed(target, custom) == ref
    assert _under_manual_seed(target, custom) == ref


def _in_call_drafters(tmp_path, hub, target):
    """method -> (its options, the drafter as the call names it: a folder or a Hub id, loaded by the call)."""
    from eagle3_fixtures import random_weights, speculators_files
    from test_syncs import HIDDEN, _dflash, _eagle3, _medusa, _mtp

    write_cached_repo(hub, "RedHatAI/Tiny-speculator.eagle3", speculators_files(random_weights(), aux_ids=[0, 1, 2]))
    saved = {}
    for name, module in (("eagle3", _eagle3()), ("dflash", _dflash()), ("medusa", _medusa()), ("mtp", _mtp(target)),
                         ("assisted", tiny_model("llama", seed=7, hidden=HIDDEN))):
        module.save_pretrained(tmp_path / name)
        saved[name] = str(tmp_path / name)
    return {
        "eagle3_published": ("eagle3", {}, "RedHatAI/Tiny-speculator.eagle3"),  # converted in memory: draws
        "eagle3": ("eagle3", {}, saved["eagle3"]),
        "dflash": ("dflash", {}, saved["dflash"]),
        "medusa": ("medusa", {"medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0]]}, saved["medusa"]),
        "mtp": ("mtp", {}, saved["mtp"]),
        "assisted": ("assisted", {"draft_vocab": list(range(0, V, 3))}, saved["assisted"]),  # a head built per call
    }


IN_CALL = ["eagle3_published", "eagle3", "dflash", "medusa", "mtp", "assisted"]


@pytest.mark.parametrize("form", ["callable", "folder"])
@pytest.mark.parametrize("case", IN_CALL)
def test_manual_seed_with_drafters_loaded_in_the_call(target, tmp_path, hub, case, form):
    """A drafter loaded by the call itself (its modules initialised, a published layout converted), then reused by
    the next call: both give plain's seed and text, and leave the global generator where plain leaves it."""
    name, opts, source = _in_call_drafters(tmp_path, hub, target)[case]
    if form == "callable":
        custom, kw = hf_specdec.decoding_method(name, drafter=source, **opts), {}
        plain = hf_specdec.decoding_method("plain")
    else:
        custom, kw = hf_specdec.custom_generate_path(name), dict(trust_remote_code=True, drafter=source, **opts)
        plain = hf_specdec.custom_generate_path("plain")
    ref = _under_manual_seed(target, plain, **({"trust_remote_code": True} if form == "folder" else {}))
    registry.REGISTRY.drafters.clear()
    first = _under_manual_seed(target, custom, **kw)
    assert len(registry.REGISTRY.drafters.entries) == 1, "the first call loaded the drafter"
    assert first == ref
    assert _under_manual_seed(target, custom, **kw) == ref


def test_manual_seed_rejection_sampling_repeats(target):
    """Rejection sampling draws from a generator seeded by the call's seed: under torch.manual_seed the call repeats
    (a constant schedule) and the global generator moves on by the seed's draw alone."""
    ref = _under_manual_seed(target, hf_specdec.decoding_method("plain"))
    custom = method("eagle3", target)
    a = _under_manual_seed(target, custom, speculative_sampling="rejection")
    assert a == _under_manual_seed(target, custom, speculative_sampling="rejection")
    assert a[1:] == ref[1:]


def test_prefix_dependent_processors_walk_on_the_host(target):
    """A repetition penalty depends on the ids before each node: the host walk, the same text as plain."""
    for bsz in (1, 3):
        ref, _ = _run(target, hf_specdec.decoding_method("plain"), bsz, seed=2, repetition_penalty=1.3)
        for name in ("eagle3", "medusa", "prompt_lookup"):
            out, stats = _run(target, method(name, target), bsz, seed=2, repetition_penalty=1.3)
            assert out == ref, name
            assert stats["proposed_drafts"] > 0


def test_scores_are_the_processed_scores(target):
    ids, mask = _inputs(3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True, eos_token_id=None,
              pad_token_id=0, return_dict_in_generate=True, output_scores=True, output_logits=True, seed=4, **WARP)
    ref = target.generate(custom_generate=hf_specdec.decoding_method("plain"), **kw)
    out = target.generate(custom_generate=method("eagle3", target), **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    for a, b in zip(out.scores, ref.scores):
        assert torch.allclose(a, b, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        assert torch.allclose(a, b, atol=1e-4)
    assert all(torch.isinf(s).any() for s in out.scores)  # top-p's mask: processed, not raw


def test_rejection_is_still_there(target):
    torch.manual_seed(0)
    _, stats = _run(target, method("eagle3", target), 1, speculative_sampling="rejection")
    assert stats["sampling"] == "rejection"
    a, _ = _run(target, method("eagle3", target), 1, speculative_sampling="rejection", seed=3)
    b, _ = _run(target, method("eagle3", target), 1, speculative_sampling="rejection", seed=3)
    assert a == b  # seed= seeds torch's generator for the call (a constant schedule repeats)


def test_greedy_ignores_the_seed(target):
    ids, mask = _inputs(3)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, custom_generate=hf_specdec.decoding_method("plain"), seed=3)
    assert out.tolist() == ref.tolist()


def test_bad_sampling_options_name_the_cause(target):
    with pytest.raises(ValueError, match="speculative_sampling must be 'coupled' or 'rejection', got 'gumbel'"):
        hf_specdec.decoding_method("plain", speculative_sampling="gumbel")
    with pytest.raises(ValueError, match="seed must be int, got str"):
        hf_specdec.decoding_method("plain", seed="7")
    with pytest.raises(ValueError, match="generator must be Generator, got int"):
        hf_specdec.decoding_method("plain", generator=7)
    from test_syncs import _medusa

    typical = hf_specdec.decoding_method("medusa", drafter=_medusa(), acceptance="typical")
    with pytest.raises(ValueError, match="typical.*does not combine with speculative_sampling='coupled'"):
        _run(target, typical, 1, speculative_sampling="coupled")
    assert _run(target, typical, 1)[1]["sampling"] == "typical"  # its own rule by default


# ---- the noise
def test_noise_blocks_reuse_positions_exactly():
    noise = CoupledNoise(seed=123, batch_size=2, vocab=50, device="cpu")
    for starts, width in [([0, 0], 1), ([1, 0], 4), ([2, 3], 2), ([2, 3], 6), ([7, 5], 1), ([8, 6], 3)]:
        block = noise.block(starts, width)
        assert block.shape == (2, width, 50)
        for b in range(2):
            for j in range(width):
                direct = gumbel(torch.tensor([position_key(123, b, starts[b] + j)]), 50)[0]
                assert torch.equal(block[b, j], direct)
    made = noise.positions_made
    assert made <= 2 * (6 + 8 + 3)  # every (row, position) at most once: never remade after it was
    noise.block([8, 6], 3)
    noise.block([8, 6], 2)
    assert noise.positions_made == made


def test_gumbel_max_is_an_exact_sample():
    """argmax(log p + g) over many (seed, row, position) keys is distributed as p (chi-square)."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    keys = torch.tensor([position_key(seed, row, t) for seed in range(4) for row in range(50) for t in range(100)])
    picks = (p.log() + gumbel(keys, 6)).argmax(-1)
    counts = torch.bincount(picks, minlength=6).double()
    assert chisquare(counts.numpy(), (p.double() * len(keys)).numpy()).pvalue > 1e-3
    g = gumbel(keys, 6)
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772) < 0.02  # the Gumbel's mean: Euler's constant


def test_noise_is_the_hash_in_any_chunking():
    """The CPU's chunked noise equals the reference hash, entry by entry (pure-Python arithmetic)."""
    from hf_specdec.coupling import _fmix, _vocab_keys

    keys = torch.tensor([[position_key(9, b, t) for t in range(3)] for b in range(2)])
    g = gumbel(keys, 40000)  # 2 positions per chunk: several chunks
    vk = _vocab_keys(40000, "cpu").tolist()
    for b in range(2):
        for t in range(3):
            for v in (0, 1, 12345, 39999):
                u = ((_fmix(int(keys[b, t]) ^ vk[v]) >> 9) + 0.5) * 2.0 ** -23
                expected = -torch.log(-torch.log(torch.tensor(u, dtype=torch.float32)))
                assert abs(float(g[b, t, v]) - float(expected)) < 1e-5
