"""The CPU verification kernels: same results as the model's own code path, installed only for one call."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_specdec
from hf_specdec import kernels
from hf_specdec.kernels import ATTN_NAME, VerifyKernels
from hf_specdec.runner_choice import runner_for
from oracles import OracleChain, OracleTree
from tiny import ARCHS, prompts, tiny_model


class _Attn(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("mask_kind", ["float", "bool"])
@pytest.mark.parametrize("q_len", [2, 5])
def test_packed_attention_matches_repeated_heads(mask_kind, q_len):
    torch.manual_seed(0)
    bsz, kv_heads, past, dim = 2, 2, 11, 8
    query = torch.randn(bsz, 6, q_len, dim)
    key = torch.randn(bsz, kv_heads, past + q_len, dim)
    value = torch.randn(bsz, kv_heads, past + q_len, dim)
    allowed = torch.rand(bsz, 1, q_len, past + q_len) > 0.3
    allowed[..., 0] = True
    mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo().min)
    module = _Attn().eval()
    ref, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    out, _ = kernels._packed_sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
    assert out.shape == ref.shape == (bsz, q_len, 6, dim)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_packed_attention_falls_back_where_it_does_not_apply():
    torch.manual_seed(0)
    module = _Attn().eval()
    query, key, value = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    ref, _ = sdpa_attention_forward(module, query, key, value, None)
    out, _ = kernels._packed_sdpa(module, query, key, value, None)  # one query token, no mask
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_transposed_product_matches_linear(rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(40, 24), torch.randn(40), torch.randn(rows, 24)
    torch.testing.assert_close(kernels._mm_t(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert kernels._mm_t(x, weight, None).is_contiguous()


def test_linear_choice_is_measured_then_kept():
    choice = kernels._LinearChoice()
    weight, x = torch.randn(64, 16), torch.randn(3, 16)
    for _ in range(2 * kernels._TRIALS):
        torch.testing.assert_close(choice(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    key = next(iter(choice.times))
    assert key[:2] == ((64, 16), 3) and [len(t) for t in choice.times[key]] == [kernels._TRIALS] * 2
    assert key in choice.choice


def test_installed_for_one_call_and_only_for_verification():
    model = tiny_model("llama")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with VerifyKernels(model) as k:
        assert k.linears and all("forward" in m.__dict__ for m in linears)
        with k.verifying(1):  # a one-token step: linears only (a batch's rows; one row keeps F.linear), no attention
            assert k.active and model.config._attn_implementation == "sdpa"
        with k.verifying(4):
            assert k.active and model.config._attn_implementation == ATTN_NAME
        assert not k.active and model.config._attn_implementation == "sdpa"
    assert all("forward" not in m.__dict__ for m in linears)


def test_hooked_modules_are_left_alone():
    model = tiny_model("llama")
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda *a: None)
    with VerifyKernels(model) as k:
        assert head not in k.linears and "forward" not in head.__dict__
    handle.remove()
    with VerifyKernels(model, enabled=False) as k:
        assert not k.linears and not k.configs


@pytest.fixture(params=[True, False], ids=["transposed", "linear"])
def forced(request, monkeypatch):
    monkeypatch.setattr(kernels._LinearChoice, "force", request.param)  # every runner's timing cache
    return request.param


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_lossless_with_kernels_forced(arch, forced, monkeypatch):
    calls = []
    real = kernels._packed_sdpa

    def spy(*args, **kwargs):
        calls.append(args[1].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "_packed_sdpa", spy)  # what the registered attention calls
    m = tiny_model(arch)
    ids, mask = prompts(3, length=12, seed=3)
    kw = dict(max_new_tokens=20, eos_token_id=None, do_sample=False)
    ref = m.generate(input_ids=ids, attention_mask=mask, **kw)
    out = m.generate(input_ids=ids, attention_mask=mask, custom_generate=hf_specdec.decoding_method(OracleTree(ref)),
                     **kw)
    assert torch.equal(out, ref)
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    assert (min(calls) >= 2) if arch != "gpt2" else not calls  # only verification forwards, only GQA models


def test_drafter_linears_use_the_kernels_in_every_forward(forced, monkeypatch):
    """A drafter's linears take the faster product also for one row (drafting is speculation's own cost); layers it
    shares with the target keep the target's verification-only rule except inside a proposal (``drafting``);
    everything is restored after the call."""
    target = tiny_model("llama")
    drafter = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    drafter.append(target.get_output_embeddings())  # shared with the target (a student's head)
    x = torch.randn(1, 32)
    with torch.no_grad():
        ref = drafter[1](drafter[0](x))
        with VerifyKernels(target, drafters=[drafter, None]) as k:
            assert drafter[0] in k.linears and drafter[1] in k.linears
            assert k.linears.count(drafter[2]) == 1  # patched once, as the target's
            seen = len(k.choice.times)
            out = drafter[1](drafter[0](x))  # outside any verification forward
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            if k.choice.force is None:
                assert len(k.choice.times) > seen
            h = torch.randn(3, target.config.hidden_size)
            calls = []
            choice = k.choice
            monkeypatch.setattr(k, "choice", lambda *a, **kw: calls.append(1) or choice(*a, **kw))
            drafter[2](h)  # the shared head outside a proposal: the target's rule (F.linear)
            assert not calls
            with k.drafting():  # inside a proposal it is drafting cost
                torch.testing.assert_close(drafter[2](h), F.linear(h, drafter[2].weight), rtol=1e-5, atol=1e-5)
            assert calls
    assert all("forward" not in m.__dict__ for m in drafter.modules())



def test_padded_plain_decoding_is_plain_decoding():
    """The kernel-matched baseline computes one row as two rows of (W @ x.T).T: the same greedy tokens as the
    model's own kernels, on for the block only."""
    from hf_specdec.kernels import padded_plain_decoding

    model = tiny_model("llama")
    ids = torch.tensor([[5, 9, 3, 17, 2]])
    plain = model.generate(ids, max_new_tokens=10, do_sample=False)
    with padded_plain_decoding(model):
        assert any("forward" in m.__dict__ for m in model.modules())
        padded = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(plain, padded)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_padded_plain_decoding_in_bf16_keeps_plain_decodings_attention_and_prefill():
    """bf16, the real model's head shape and a prompt of more than 32 tokens: the kernel-matched baseline changes the
    one-row products only (bit-identical on this CPU), not the prefill or the attention, so its logits are plain
    decoding's."""
    from hf_specdec.kernels import padded_plain_decoding

    model = tiny_model("llama", layers=2, hidden=576, num_attention_heads=9, num_key_value_heads=3).to(torch.bfloat16)
    ids, mask = prompts(1, length=40, seed=3)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    plain = model.generate(input_ids=ids, attention_mask=mask, **kw)
    with padded_plain_decoding(model):
        padded = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, padded.logits))


# ---- half precision: one row's verification rounds as plain decoding's one-token steps (kernels._ExactRows)
def _one_token_attention(query, key, value, allowed):
    """Plain decoding's own call for each query row: one query over its allowed keys, gathered in cache order."""
    groups = query.shape[1] // key.shape[1]
    outs = []
    for i in range(query.shape[2]):
        cols = allowed[i].nonzero()[:, 0]
        outs.append(F.scaled_dot_product_attention(query[:, :, i:i + 1], key[:, :, cols], value[:, :, cols],
                                                   enable_gqa=groups > 1))
    return torch.cat(outs, 2).transpose(1, 2)  # [1, q, H, D]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_exact_half_attention_matches_one_token_steps(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    for past in (1, 15, 16, 17, 100, 255, 513):
        q = 11
        key, value = (torch.randn(1, 3, past + q, 64, generator=gen).to(dtype) for _ in range(2))
        query = torch.randn(1, 9, q, 64, generator=gen).to(dtype)
        if shape == "chain":
            ancestors = torch.ones(q, q, dtype=torch.bool).tril()
        else:  # a random tree in topological order: each node sees its parent's ancestors and itself
            ancestors = torch.eye(q, dtype=torch.bool)
            for i in range(1, q):
                ancestors[i] |= ancestors[int(torch.randint(0, i, (1,), generator=gen))]
        allowed = torch.cat([torch.ones(q, past, dtype=torch.bool), ancestors], 1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
        out = kernels._exact_attention(query, key, value, kernels._ExactRows().plan(mask), None, 3)
        assert torch.equal(out, _one_token_attention(query, key, value, allowed)), past


def _bitwise_roundings(model):
    """The half-precision roundings whose verification must give plain decoding's bits on this CPU: ``"exact"``
    always; ``"auto"`` where the probe says so (:meth:`TargetRunner.exact_bits`: with AMX, yes; with AVX512-BF16
    alone, not once a product is wider than 1024)."""
    return ["exact"] + (["auto"] if runner_for(model).exact_bits("auto") else [])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("oracle", [OracleTree, OracleChain])
def test_half_precision_verification_is_bitwise_plain_decoding(arch, oracle):
    """bf16, one row: every verified position's logits are the bits of the target's own one-token step, so the
    output is plain greedy decoding's whatever the drafts; ``exact_bits`` reports the probe's verdict."""
    model = tiny_model(arch).to(torch.bfloat16)
    ids, mask = prompts(1, length=12, seed=3)
    kw = dict(max_new_tokens=40, eos_token_id=None, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    for rounding in _bitwise_roundings(model):
        out = model.generate(input_ids=ids, attention_mask=mask, **kw,
                             custom_generate=hf_specdec.decoding_method(oracle(ref.sequences), rounding=rounding))
        assert out.speculative_stats["exact_bits"] is True
        assert all(torch.equal(a, b) for a, b in zip(ref.logits, out.logits)), rounding
        assert torch.equal(out.sequences, ref.sequences)


def test_half_precision_layerskip_resumes_from_exact_early_layers():
    """LayerSkip's verification resumes from the activations its drafting computed with the target's own first
    layers: those round as plain decoding's steps too (bf16, one row), so the logits are plain decoding's bits."""
    # the real model's head shape (9 heads over 3 key/value heads of 64) and an MLP wider than 1024, as SmolLM2's
    model = tiny_model("llama", layers=4, hidden=576, num_attention_heads=9, num_key_value_heads=3).to(torch.bfloat16)
    ids, mask = prompts(1, length=12, seed=3)
    kw = dict(max_new_tokens=40, eos_token_id=None, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    for rounding in _bitwise_roundings(model):
        out = model.generate(input_ids=ids, attention_mask=mask, **kw, exit_layer=2, num_speculative_tokens=3,
                             draft_length_schedule="constant", rounding=rounding,
                             custom_generate=hf_specdec.decoding_method("layerskip"))
        assert out.speculative_stats["proposed_drafts"] > 0 and out.speculative_stats["exact_bits"] is True
        assert all(torch.equal(a, b) for a, b in zip(ref.logits, out.logits)), rounding


def test_probe_finds_a_product_that_rounds_unlike_one_row(monkeypatch):
    """The exactness probe's negative control: a verification product off by one part in a hundred is reported
    (``exact_bits`` False, a warning saying so), whatever this CPU's own products do, and ``"auto"`` then runs as
    ``"fast"``; float32 reports ``None``."""
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: real_linear(x, w, b) * (1.01 if x.shape[0] > 1 else 1))
    monkeypatch.setattr(kernels._LinearChoice, "force", False)  # F.linear for every product
    model = tiny_model("llama").to(torch.bfloat16)
    assert runner_for(model).exact_bits("auto") is False
    assert [runner_for(model).rounding_for(r) for r in (None, "auto", "exact", "fast")] == ["fast", "fast", "exact",
                                                                                          "fast"]
    ids, mask = prompts(1, length=12, seed=3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True, custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert out.speculative_stats["exact_bits"] is False
    monkeypatch.undo()
    fp32 = model.float().generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                  return_dict_in_generate=True,
                                  custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert fp32.speculative_stats["exact_bits"] is None
    assert runner_for(model).rounding_for("auto") == "auto"  # float32: no probe, nothing to change


def test_linear_choice_keeps_the_product_that_rounds_as_one_row(monkeypatch):
    """A target layer in half precision: a product whose rows round unlike a one-row F.linear is never used, however
    fast -- not even while the two are timed; where neither product holds, ``"exact"`` computes one row at a time."""
    real_mm, real_linear = kernels._mm_t, F.linear
    weight, x = torch.randn(64, 16).bfloat16(), torch.randn(3, 16).bfloat16()
    one_row = torch.cat([F.linear(x[i:i + 1], weight) for i in range(3)])
    for wrong in ("mm", "linear", "both"):
        with monkeypatch.context() as m:  # the "faster" product is wrong in the bits
            if wrong in ("mm", "both"):
                m.setattr(kernels, "_mm_t", lambda x, w, b: real_mm(x, w, b) * 1.01)
            if wrong in ("linear", "both"):
                m.setattr(F, "linear", lambda x, w, b=None: real_linear(x, w, b) * (1.01 if x.shape[0] > 1 else 1))
            for rounding in ("auto", "exact"):
                choice = kernels._LinearChoice()
                for _ in range(2 * kernels._TRIALS):
                    out = choice(x, weight, None, rounding)
                    assert torch.equal(out, one_row) != (wrong == "both" and rounding == "auto")
                expected = {"mm": "linear", "linear": "mm", "both": "rows" if rounding == "exact" else "linear"}
                assert list(choice.choice.values()) == [expected[wrong]]


@pytest.mark.parametrize("rows", [2, 5, 8, 33])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536)])
def test_exact_products_round_as_one_row(rows, shape):
    """SmolLM2's MLP shapes in bf16, ``rounding="exact"``: every row of every call equals plain decoding's one-row
    product, on any CPU (with AVX512-BF16 alone, the products over several rows of the 1536-wide input round some
    rows otherwise: one row at a time there)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(*shape, generator=gen) / 24).bfloat16()
    choice = kernels._LinearChoice()
    for _ in range(2 * kernels._TRIALS + 1):
        x = torch.randn(rows, shape[1], generator=gen).bfloat16()
        parts = x.split(kernels._MAX_ROWS)  # as VerifyKernels calls it: at most 32 rows at a time
        out = torch.cat([choice(part, weight, None, "exact") for part in parts])
        assert torch.equal(out, torch.cat([F.linear(x[i:i + 1], weight) for i in range(rows)]))
