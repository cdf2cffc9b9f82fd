"""bfloat16 as a first-class dtype: the resolver's CPU fallback, every method on a bf16 target, drafters following
the target's dtype, and the demo's match reporting in half precision (tiny models, offline)."""

import warnings

import pytest
import torch

import hf_specdec
from hf_specdec import cli, dtypes, registry
from tiny import OWN_TARGETS, one_thread, prompts, tiny_drafter, tiny_model, word_tokenizer

LAYERS = 3
NEW = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():  # bf16 at tiny shapes: no waiting on a thread pool (tiny.one_thread)
        yield


# ------------------------------------------------------------------------------------------------- the resolver
def test_half_precision_is_kept_where_the_cpu_has_kernels_for_it(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_supports", lambda dtype: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dtypes.resolve_dtype("bfloat16") == torch.bfloat16
        assert dtypes.resolve_dtype(torch.float16, "cpu") == torch.float16
        assert dtypes.resolve_dtype(None) == dtypes.resolve_dtype("float32") == torch.float32
    # the check reads the processor's flags: either feature will do, and each dtype has its own
    monkeypatch.undo()
    monkeypatch.setattr(dtypes, "_cpu_flags", lambda: frozenset({"sse2", "amx_bf16"}))
    assert dtypes.cpu_supports(torch.bfloat16) and not dtypes.cpu_supports(torch.float16)
    monkeypatch.setattr(dtypes, "_cpu_flags", lambda: frozenset({"avx512_fp16"}))
    assert dtypes.cpu_supports(torch.float16) and not dtypes.cpu_supports(torch.bfloat16)
    monkeypatch.setattr(dtypes, "_cpu_flags", lambda: None)  # no /proc/cpuinfo flags: torch's own check
    assert dtypes.cpu_supports(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("name, feature", [("bfloat16", "AVX512-BF16 or AMX-BF16"),
                                           ("float16", "AVX512-FP16 or AMX-FP16")])
def test_without_the_processor_feature_it_warns_and_uses_float32(monkeypatch, name, feature):
    monkeypatch.setattr(dtypes, "cpu_supports", lambda dtype: False)
    with pytest.warns(UserWarning, match=f"{name} needs a CPU with {feature}.*using float32 instead"):
        assert dtypes.resolve_dtype(name) == torch.float32
    with pytest.warns(UserWarning, match=feature):
        assert dtypes.resolve_dtype(getattr(torch, name), "auto" if not torch.cuda.is_available() else "cpu") \
            == torch.float32
    with warnings.catch_warnings():  # other devices: as asked, no check
        warnings.simplefilter("error")
        assert dtypes.resolve_dtype(name, "cuda") == dtypes.resolve_dtype(name, torch.device("cuda:1")) \
            == getattr(torch, name)


def test_unknown_dtypes_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="Unknown dtype 'fp8': the dtypes are float32, float16, bfloat16"):
        dtypes.resolve_dtype("fp8")
    with pytest.raises(ValueError, match="Unsupported dtype float64: the dtypes are float32, float16, bfloat16"):
        dtypes.resolve_dtype(torch.float64)
    assert cli.DTYPES == dtypes.DTYPES


# -------------------------------------------------------------------------------------- every method in bf16
@pytest.fixture(scope="module")
def bf16_target_and_folders(tmp_path_factory):
    """A bf16 tiny target and, per method with a drafter, a folder of a drafter saved in float32."""
    target = tiny_model("llama", layers=LAYERS)
    root = tmp_path_factory.mktemp("drafters")
    folders = {}
    for m in registry.methods():
        if m.drafter is not None and m.name not in OWN_TARGETS:
            tiny_drafter(m.name, target).save_pretrained(root / m.name)
            folders[m.name] = str(root / m.name)
    return target.to(torch.bfloat16), folders


@pytest.mark.parametrize("method", [m.name for m in registry.methods() if m.name not in OWN_TARGETS])
def test_every_method_generates_on_a_bfloat16_target(bf16_target_and_folders, method):
    """Greedy generate() on a bf16 target, one row and a left-padded batch of two, the drafter (saved in float32)
    loaded in the target's dtype; outputs are identical to plain decoding only up to rounding, so not compared."""
    target, folders = bf16_target_and_folders
    opts = {}
    if method in folders:
        drafter = registry.load_drafter(method, folders[method], target)
        floats = {p.dtype for p in drafter.parameters() if p.is_floating_point()}
        assert floats == {torch.bfloat16}, (method, floats)
        opts["drafter"] = drafter
    for batch in (1, 2):
        ids, mask = prompts(batch, 12)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, return_dict_in_generate=True,
                              custom_generate=hf_specdec.decoding_method(method, **opts))
        assert out.sequences.shape == (batch, ids.shape[1] + NEW)
        assert out.sequences.dtype == torch.long and out.speculative_stats["target_forward_passes"] >= 1


# ------------------------------------------------------------------------------------------------------ demo
def test_demo_runs_in_bfloat16_and_reports_matches(capsys, monkeypatch):
    """``run_demo(dtype="bfloat16")`` loads the model in bf16 and compares with plain decoding in bf16; the rows
    carry their dtype and the matches, and a half-precision line says what identical means there."""
    from hf_specdec import default_model, demo

    model, tok = tiny_model("llama"), word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'][:40] }}{% endfor %}"
    loaded = []
    monkeypatch.setattr(dtypes, "cpu_supports", lambda dtype: True)
    monkeypatch.setattr(default_model, "load_smollm2",
                        lambda dtype=torch.float32, verbose=True: loaded.append(dtype) or (model.to(dtype), tok))
    monkeypatch.setattr(demo, "available_demo_methods", lambda model, drafters=None, only=None, **kw: {
        "prompt_lookup": {}})
    summary, rows = demo.run_demo(max_new_tokens=4, methods=["prompt_lookup"], repeats=1, dtype="bfloat16")
    out = capsys.readouterr().out
    assert loaded == [torch.bfloat16] and demo.HALF_NOTE in out and "in bfloat16" in out
    assert all(r["dtype"] == "bfloat16" and r["matches"] == r["repeats"] * r["same"] for r in rows)
    assert all(0.0 <= s["match_rate"] <= 1.0 and s["dtype"] == "bfloat16" for s in summary.values())


def test_demo_half_precision_mismatch_is_a_match_count_not_a_failure(monkeypatch):
    from hf_specdec import demo

    stats = [{"acceptance_length": 1.5, "proposed_drafts": 6, "accepted_drafts": 2}] * 3
    times = {"plain": [1.0] * 3, "kernels": [0.9] * 3, "m": [0.8] * 3}
    half = demo._row("chat", 0, "m", "m", 8, times, stats, 2, cpu=True, dtype="bfloat16")
    assert not half["same"] and half["matches"] == 2 and "match 2/3" in demo._row_line(half, 5)
    assert "MISMATCH" not in demo._row_line(half, 5)
    exact = demo._row("chat", 0, "m", "m", 8, times, stats, 2, cpu=True)
    assert "MISMATCH" in demo._row_line(exact, 5)

    # the command's exit status: a mismatch fails in float32 only
    assert cli.build_parser().parse_args(["demo", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert cli.build_parser().parse_args(["demo"]).dtype == "float32"
    asked = []
    for row, status in ((half, 0), (exact, 1)):
        monkeypatch.setattr(demo, "run_demo", lambda row=row, **kw: asked.append(kw["dtype"]) or ({}, [row]))
        assert cli.main(["demo", "--dtype", row["dtype"], "--methods", "prompt_lookup"]) == status
    assert asked == ["bfloat16", "float32"]


# ---------------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("fast", [True, False])
def test_cli_generate_goes_through_the_resolver(tmp_path, monkeypatch, capsys, fast):
    from hf_specdec import entry

    tiny_model("llama").save_pretrained(tmp_path / "m")
    word_tokenizer().save_pretrained(tmp_path / "m")
    monkeypatch.setattr(dtypes, "cpu_supports", lambda dtype: fast)
    seen, real = [], entry.generate_with_method
    monkeypatch.setattr(entry, "generate_with_method", lambda name, model, **kw: seen.append(model.dtype) or real(
        name, model, **kw))
    argv = ["generate", "abcabcabc", "--model", str(tmp_path / "m"), "--raw", "--max-new-tokens", "4", "--dtype",
            "bfloat16"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(argv) == 0
    fallback = [str(w.message) for w in caught if "using float32 instead" in str(w.message)]
    assert seen == [torch.bfloat16 if fast else torch.float32] and len(fallback) == (0 if fast else 1)
    assert "[prompt_lookup]" in capsys.readouterr().err
