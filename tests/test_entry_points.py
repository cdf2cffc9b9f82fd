"""Every way a user reaches the loop: folder by relative / absolute path, the offline Hub cache, a callable,
pipelines (batched too), streamers, transformers' own assisted loop."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import pipeline

import hf_specdec
from hf_specdec.candidate_generators import (
    DraftModelCandidateGenerator,
    PromptLookupCandidateGenerator,
    in_transformers_loop,
)
from hf_specdec.hub_cache import install_hub_cache, publish
from tiny import EOS, prompts, tiny_model, word_tokenizer

REPO = Path(__file__).resolve().parents[1]
GEN = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def drafter():
    return tiny_model("llama", seed=3)


def test_every_method_has_a_folder():
    for method in hf_specdec.available_methods():
        folder = Path(hf_specdec.custom_generate_path(method))
        assert (folder / "custom_generate" / "generate.py").is_file()
        assert (folder / "custom_generate" / "requirements.txt").is_file()
        readme = (folder / "README.md").read_text()
        assert f'custom_generate="hf_specdec/{method}"' in readme
        assert (REPO / "hf_specdec" / method).resolve() == folder.resolve()


@pytest.mark.parametrize("method", ["prompt_lookup", "assisted", "suffix"])
def test_repo_relative_folder_positional_and_keyword(target, drafter, method, monkeypatch):
    monkeypatch.chdir(REPO)
    ids, mask = prompts(1, 12)
    ref = target.generate(ids, **GEN)
    extra = {"assistant_model": drafter} if method == "assisted" else {}
    out = target.generate(ids, custom_generate=f"hf_specdec/{method}", trust_remote_code=True, **GEN, **extra)
    assert torch.equal(out, ref)
    out = target.generate(input_ids=ids, attention_mask=mask, custom_generate=f"hf_specdec/{method}",
                          trust_remote_code=True, **GEN, **extra)
    assert torch.equal(out, ref)


def test_absolute_path_from_another_directory(target, drafter, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ids, mask = prompts(3, 12)
    ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
    out = target.generate(input_ids=ids, attention_mask=mask, **GEN, trust_remote_code=True,
                          custom_generate=hf_specdec.custom_generate_path("assisted"), drafter=drafter,
                          num_speculative_tokens=3)
    assert torch.equal(out, ref)


def test_a_model_folder_carrying_a_method_folder(target, tmp_path):
    """A saved model folder with a method's ``custom_generate/`` in it, loaded with ``trust_remote_code=True``:
    transformers makes that folder's function the model's own ``generate``, and a plain call, positional or by
    keyword, speculates with output identical to the folder loaded without it (issue 52's seam; ``hf-specdec attach``
    is to write such folders)."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    target.save_pretrained(folder)
    shutil.copytree(Path(hf_specdec.custom_generate_path("prompt_lookup")) / "custom_generate",
                    folder / "custom_generate")
    attached = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = prompts(2, 12)
    ids[:, -6:] = ids[:, -12:-6]  # something to copy
    ref = plain.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert torch.equal(attached.generate(ids, attention_mask=mask, **GEN), ref)
    out = attached.generate(input_ids=ids, attention_mask=mask, **GEN, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.speculative_stats["method"] == "prompt_lookup"


def test_callable(target, drafter):
    ids, mask = prompts(2, 12)
    ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
    out = target.generate(input_ids=ids, attention_mask=mask, **GEN,
                          custom_generate=hf_specdec.decoding_method("assisted"), drafter=drafter)
    assert torch.equal(out, ref)
    out = target.generate(input_ids=ids, attention_mask=mask, **GEN, prompt_lookup_num_tokens=4,
                          custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert torch.equal(out, ref)


def test_drafter_by_path(target, tmp_path):
    small = tiny_model("llama", seed=9, layers=1)
    small.save_pretrained(tmp_path / "draft")
    ids, mask = prompts(1, 12)
    ref = target.generate(ids, **GEN)
    out = target.generate(ids, **GEN, custom_generate=hf_specdec.custom_generate_path("assisted"),
                          trust_remote_code=True, drafter=str(tmp_path / "draft"))
    assert torch.equal(out, ref)


def test_install_hub_cache_layout(tmp_path):
    snaps = install_hub_cache(tmp_path, verbose=False)
    assert len(snaps) == len(hf_specdec.available_methods())
    for method in hf_specdec.available_methods():
        repo = tmp_path / f"models--hf_specdec--{method}"
        commit = (repo / "refs" / "main").read_text()
        gen = repo / "snapshots" / commit / "custom_generate" / "generate.py"
        assert gen.is_file() and "generate_with_method" in gen.read_text()
        assert (repo / "snapshots" / commit / "README.md").is_file()
    # idempotent
    assert install_hub_cache(tmp_path, verbose=False) == snaps


def test_hub_repo_id_offline_from_any_directory(tmp_path):
    """The exact call custom_generate="hf_specdec/prompt_lookup" outside the repository: transformers' own OSError
    (raised before any hf_specdec code runs; the README names it and the fix), then, after `hf-specdec
    install-hub-cache`, resolved from the local Hub cache, offline."""
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1",
               HF_MODULES_CACHE=str(tmp_path / "modules"), PYTHONPATH=str(REPO / "tests"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    said = "`hf_specdec/prompt_lookup` does not contain a `custom_generate` subdirectory"
    readme = (REPO / "README.md").read_text()
    assert "OSError: " + said.replace("prompt_lookup", "eagle3") in " ".join(readme.split())
    assert "hf-specdec install-hub-cache" in readme
    # the README's first custom_generate example (the quick start opens with attach, which needs no argument)
    first = readme.split("### `model.generate(custom_generate=...)`")[1].split("```python")[1].split("```")[0]
    assert "custom_generate_path(" in first and 'custom_generate="hf_specdec/' not in first
    script = (  # one process: the call refused, `hf-specdec install-hub-cache`, the same call resolved
        "import torch\n"
        "from hf_specdec.cli import main\n"
        "from tiny import tiny_model, prompts\n"
        "m = tiny_model('llama')\n"
        "ids, mask = prompts(1, 12)\n"
        "try:\n"
        "    m.generate(ids, max_new_tokens=2, trust_remote_code=True, custom_generate='hf_specdec/prompt_lookup')\n"
        "except OSError as err:\n"
        "    print('refused:', err)\n"
        "main(['install-hub-cache'])\n"
        "ref = m.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)\n"
        "for method in ('prompt_lookup', 'assisted'):\n"
        "    kw = {'assistant_model': m} if method == 'assisted' else {}\n"
        "    out = m.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, trust_remote_code=True,\n"
        "                     custom_generate='hf_specdec/' + method, **kw)\n"
        "    assert torch.equal(out, ref), method\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"refused: {said}" in res.stdout and res.stdout.rstrip().endswith("ok"), res.stdout[-2000:]


def test_publish_dry_run(capsys):
    repos = publish(org="someone", dry_run=True)
    assert repos == [f"someone/{m}" for m in hf_specdec.available_methods()]
    assert "would upload" in capsys.readouterr().out


def _pipe(target):
    tok = word_tokenizer()
    return pipeline("text-generation", model=target, tokenizer=tok), tok


def test_pipeline_single_and_batched(target, drafter):
    pipe, tok = _pipe(target)
    texts = ["abcdefabcdef", "hello world! hello", "xyz"]
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    ref = pipe(texts, **kw)
    out = pipe(texts, **kw, custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True)
    assert out == ref
    ref_b = pipe(texts, batch_size=3, **kw)
    out_b = pipe(texts, batch_size=3, **kw, custom_generate=hf_specdec.custom_generate_path("assisted"),
                 trust_remote_code=True, assistant_model=drafter)
    assert out_b == ref_b
    single = pipe(texts[0], **kw, custom_generate=hf_specdec.custom_generate_path("prompt_lookup"),
                  trust_remote_code=True)
    assert single == ref[0]
    with pytest.raises(ValueError, match="draft_length_schedule"):  # proves the call went through hf_specdec
        pipe(texts[0], **kw, custom_generate=hf_specdec.custom_generate_path("prompt_lookup"),
             trust_remote_code=True, draft_length_schedule="bogus")


def test_pipeline_suffix_with_a_shared_cache(target):
    pipe, tok = _pipe(target)
    texts = ["abcdefabcdef", "hello world! hello", "xyz"]
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    ref = pipe(texts, batch_size=3, **kw)
    cache = hf_specdec.SuffixCache(max_sequences=16)
    for _ in range(2):  # the second round drafts from the first round's outputs
        out = pipe(texts, batch_size=3, **kw, custom_generate=hf_specdec.custom_generate_path("suffix"),
                   trust_remote_code=True, suffix_cache=cache)
        assert out == ref
    assert cache.num_sequences == 6


def test_pipeline_assistant_at_construction(target, drafter):
    tok = word_tokenizer()
    pipe = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter)
    kw = dict(max_new_tokens=10, do_sample=False)
    plain = pipeline("text-generation", model=target, tokenizer=tok)("abcabcabc", **kw)
    out = pipe("abcabcabc", **kw, custom_generate=hf_specdec.custom_generate_path("assisted"), trust_remote_code=True)
    assert out == plain


class Recorder:
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


FORMS = {  # the folder form, and the callable (transformers keeps streamer= from it: recovered from generate())
    "folder": lambda: dict(custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True),
    "callable": lambda: dict(custom_generate=hf_specdec.decoding_method("prompt_lookup")),
}


@pytest.mark.parametrize("form", FORMS)
def test_streamer_batch_one(target, form):
    ids, _ = prompts(1, 12)
    plain, spec = Recorder(), Recorder()
    ref = target.generate(ids, **GEN, streamer=plain)
    out = target.generate(ids, **GEN, streamer=spec, **FORMS[form](), draft_length_schedule="constant")
    assert torch.equal(out, ref)
    assert spec.ends == 1 and plain.ends == 1
    # the prompt, then one token per put shaped as plain generate() puts it ([1]): a streamer that counts puts
    # (transformers serve's usage figures) counts tokens
    assert len(spec.puts) == len(plain.puts)
    for a, b in zip(spec.puts, plain.puts):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", FORMS)
def test_streamer_batched_matches_plain_puts(target, form):
    ids, mask = prompts(3, 12)
    plain, spec = Recorder(), Recorder()
    kw = dict(max_new_tokens=14, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw, streamer=plain)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, streamer=spec, **FORMS[form]())
    assert torch.equal(out, ref)
    assert spec.ends == 1
    assert len(spec.puts) == len(plain.puts)
    for a, b in zip(spec.puts, plain.puts):
        assert torch.equal(a, b)


def test_text_streamer(target, capsys):
    from transformers import TextStreamer

    tok = word_tokenizer()
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, **GEN)
    target.generate(ids, **GEN, streamer=TextStreamer(tok, skip_prompt=True),
                    custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True)
    printed = capsys.readouterr().out.strip()
    assert printed == tok.decode(ref[0, ids.shape[1]:]).strip()


def _stop_case(target):
    """Two prompts, a tokenizer and a stop string the first row writes at its sixth new token."""
    tok = word_tokenizer()
    ids, mask = prompts(2, 12, seed=11)
    free = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=EOS,
                           pad_token_id=0)
    return tok, ids, mask, tok.decode(free[0, ids.shape[1] + 5]), free


def _method(name):
    from test_syncs import _eagle3

    return {"eagle3": dict(drafter=_eagle3(), num_speculative_tokens=3)}.get(name, {})


STOP_FORMS = {  # every entry form: (target, method, its options, generate's arguments) -> sequences
    "folder": lambda target, m, opts, kw: target.generate(custom_generate=hf_specdec.custom_generate_path(m),
                                                          trust_remote_code=True, **opts, **kw),
    "callable": lambda target, m, opts, kw: target.generate(custom_generate=hf_specdec.decoding_method(m, **opts),
                                                            **kw),
    "generate_with_method": lambda target, m, opts, kw: hf_specdec.generate_with_method(m, target, **opts, **kw),
}


@pytest.mark.parametrize("in_config", [False, True], ids=["argument", "generation_config"])
@pytest.mark.parametrize("form", STOP_FORMS)
@pytest.mark.parametrize("name", ["plain", "prompt_lookup", "eagle3"])
def test_stop_strings_with_the_tokenizer_in_every_form(target, name, form, in_config):
    """``stop_strings`` (as an argument or in a ``GenerationConfig``) with ``tokenizer=``: the output of plain
    ``generate()`` with the same stop strings (the callable form failed with "could not locate a tokenizer")."""
    from transformers import GenerationConfig

    tok, ids, mask, stop, free = _stop_case(target)
    gen = dict(max_new_tokens=20, do_sample=False, eos_token_id=EOS, pad_token_id=0, stop_strings=[stop])
    kw = dict(input_ids=ids, attention_mask=mask, tokenizer=tok,
              **({"generation_config": GenerationConfig(**gen)} if in_config else gen))
    ref = target.generate(**kw)
    assert not torch.equal(ref, free)  # the stop string cut the first row short
    assert torch.equal(STOP_FORMS[form](target, name, _method(name), kw), ref)


@pytest.mark.parametrize("folder", [False, True], ids=["callable", "folder"])
def test_stop_sequence_in_a_pipeline(target, folder):
    pipe, tok = _pipe(target)
    texts = ["abcdefabcdef", "hello world! hello"]
    kw = dict(max_new_tokens=12, do_sample=False, return_full_text=False, batch_size=2)
    free = pipe(texts, **kw)
    stop = free[0][0]["generated_text"][4]
    ref = pipe(texts, **kw, stop_sequence=stop)
    assert ref != free
    custom = (dict(custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True) if folder
              else dict(custom_generate=hf_specdec.decoding_method("prompt_lookup")))
    assert pipe(texts, **kw, stop_sequence=stop, **custom) == ref


@pytest.mark.parametrize("method", ["prompt_lookup", "assisted"])
def test_in_transformers_loop(target, drafter, method):
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, **GEN)
    opts = {"drafter": drafter} if method == "assisted" else {}
    out = target.generate(ids, **GEN, custom_generate=in_transformers_loop(method, **opts))
    assert torch.equal(out, ref)
    assert "_get_candidate_generator" not in vars(target)  # nothing left patched
    torch.manual_seed(0)
    out = target.generate(ids, max_new_tokens=16, do_sample=True, eos_token_id=None,
                          custom_generate=in_transformers_loop(method, **opts))
    assert out.shape == ref.shape


def test_candidate_generator_classes(target, drafter):
    ids, _ = prompts(1, 12, repeat=True)
    gen = PromptLookupCandidateGenerator(target, num_output_tokens=4, max_matching_ngram_size=2, adaptive=False,
                                         max_length=40)
    cand, logits = gen.get_candidates(ids)
    assert logits is None and cand.shape[1] > ids.shape[1]
    assert torch.equal(cand[:, : ids.shape[1]], ids)
    gen.update_candidate_strategy(cand[:, : ids.shape[1] + 1], None, 0)
    dgen = DraftModelCandidateGenerator(target, drafter, num_speculative_tokens=3, max_length=40, do_sample=True)
    cand, logits = dgen.get_candidates(ids)
    assert cand.shape[1] == ids.shape[1] + 3 and logits.shape == (1, 3, target.config.vocab_size)
    dgen.update_candidate_strategy(cand[:, : ids.shape[1] + 2], None, 1)
    cand2, _ = dgen.get_candidates(cand[:, : ids.shape[1] + 2])
    assert cand2.shape[1] == ids.shape[1] + 2 + 3
