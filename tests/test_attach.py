"""``hf-specdec attach``: a saved model folder that speculates wherever it is loaded with ``trust_remote_code=True``
(issue 52). Every test loads the attached folder through transformers' own ``from_pretrained`` / ``pipeline`` and
compares with the same folder loaded without ``trust_remote_code`` (plain decoding)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, pipeline

import hf_specdec
from hf_specdec.cli import main
from hf_specdec.hub_cache import publish, write_cached_repo
from tiny import chat_tokenizer, prompts, tiny_drafter, tiny_model, word_tokenizer

REPO = Path(__file__).resolve().parents[1]
GEN = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model folder with a chat tokenizer, and a drafter folder for ``assisted``."""
    root = tmp_path_factory.mktemp("attach")
    target = tiny_model("llama")
    target.generation_config.eos_token_id = None  # runs to max_new_tokens: every call compares full lengths
    target.save_pretrained(root / "model")
    chat_tokenizer().save_pretrained(root / "model")
    tiny_drafter("assisted", target).save_pretrained(root / "draft")
    return root


def _copy(saved, tmp_path, name="model") -> Path:
    folder = tmp_path / name
    shutil.copytree(saved / "model", folder)
    return folder


def _load(folder, remote: bool):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote).eval()


def test_attached_generate_is_the_method_with_its_options_and_copied_drafter(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    custom = hf_specdec.attach(folder, "assisted", drafter=saved / "draft", num_speculative_tokens=1,
                               draft_length_schedule="constant")
    assert (custom / "drafter" / "config.json").is_file() and (custom / "requirements.txt").is_file()
    assert hf_specdec.attached(folder) == {
        "method": "assisted", "options": {"num_speculative_tokens": 1, "draft_length_schedule": "constant"},
        "drafter": {"copied": "drafter"}, "hf_specdec": hf_specdec.__version__}
    moved = tmp_path / "elsewhere" / "model"  # self-contained: the copied drafter travels with the folder
    moved.parent.mkdir()
    shutil.move(folder, moved)
    model, plain = _load(moved, True), _load(moved, False)
    ids, mask = prompts(3, 12)
    ref = plain.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref)  # positional, as transformers allows
    out = model.generate(input_ids=ids, attention_mask=mask, **GEN, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    stats = out.speculative_stats  # one draft per row and step: the recorded options
    assert stats["method"] == "assisted" and stats["proposed_drafts"] <= stats["verify_row_steps"]
    # the call still chooses: another method for this call, the attached method's option overridden
    out = model.generate(input_ids=ids, attention_mask=mask, **GEN, return_dict_in_generate=True,
                         custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert torch.equal(out.sequences, ref) and out.speculative_stats["method"] == "prompt_lookup"
    out = model.generate(input_ids=ids, attention_mask=mask, **GEN, return_dict_in_generate=True,
                         num_speculative_tokens=4)
    stats = out.speculative_stats
    assert torch.equal(out.sequences, ref) and stats["proposed_drafts"] > 2 * stats["verify_row_steps"]


def test_a_conversation_continued_from_its_cache(saved, tmp_path):
    """past_key_values=out.past_key_values (as transformers documents it; generate() itself renames it cache=, a
    folder's generate gets it as written): the next turn equals plain decoding's and prefills only its new tokens."""
    folder = _copy(saved, tmp_path)
    hf_specdec.attach(folder, "assisted", drafter=saved / "draft")
    ids, mask = prompts(2, 12)
    turns = []
    for model in (_load(folder, False), _load(folder, True)):
        first = model.generate(input_ids=ids, attention_mask=mask, **GEN, return_dict_in_generate=True)
        more = torch.cat([first.sequences, ids[:, -4:]], 1)
        again = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        turns.append(model.generate(input_ids=more, attention_mask=again, past_key_values=first.past_key_values,
                                    **GEN, return_dict_in_generate=True))
    assert torch.equal(turns[1].sequences, turns[0].sequences)
    assert turns[1].speculative_stats["cached_tokens"] > 0


def test_sampling_streamers_and_stop_strings(saved, tmp_path):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            pass

    folder = _copy(saved, tmp_path)
    hf_specdec.attach(folder, "prompt_lookup")
    model, plain = _load(folder, True), _load(folder, False)
    tok = word_tokenizer()
    ids, _ = prompts(1, 12)
    streams = [Collect(), Collect()]
    ref = plain.generate(ids, **GEN, streamer=streams[0])
    assert torch.equal(model.generate(ids, **GEN, streamer=streams[1]), ref)
    assert streams[0].tokens == streams[1].tokens == ref[0].tolist()
    stop = tok.decode(ref[0, 16:18])
    kw = dict(GEN, stop_strings=[stop], tokenizer=tok)
    ref = plain.generate(ids, **kw)
    assert ref.shape[1] < 12 + 16 and torch.equal(model.generate(ids, **kw), ref)
    # sampling: the seed repeats, and gives hf_specdec's plain loop's text (coupled sampling)
    sample = dict(max_new_tokens=16, do_sample=True, eos_token_id=None)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model.generate(ids, **sample, return_dict_in_generate=True))
    torch.manual_seed(7)
    ref = plain.generate(ids, **sample, custom_generate=hf_specdec.decoding_method("plain"))
    assert torch.equal(runs[0].sequences, runs[1].sequences) and torch.equal(runs[0].sequences, ref)
    assert runs[0].speculative_stats["method"] == "prompt_lookup"


def test_what_speculation_does_not_do_runs_plain(saved, tmp_path, caplog):
    """Beam search, several sequences, contrastive search: the user's call still works on an attached model (run by
    transformers' own generate, with a warning); the same through custom_generate= is refused with the reason."""
    folder = _copy(saved, tmp_path)
    hf_specdec.attach(folder, "prompt_lookup")
    model, plain = _load(folder, True), _load(folder, False)
    ids, _ = prompts(1, 12)
    beams = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, num_beams=2, num_return_sequences=2)
    assert torch.equal(model.generate(ids, **beams), plain.generate(ids, **beams))
    contrastive = dict(GEN, penalty_alpha=0.6, top_k=4)  # transformers 5 runs it from a Hub repo: its own error
    with pytest.raises(ValueError, match="trust_remote_code"):
        model.generate(ids, **contrastive)
    paged = dict(GEN, cache_implementation="paged")  # transformers' continuous batching (slow to start: not run)
    assert hf_specdec.entry.unsupported_call(model, None, paged) is not None
    for kw in (beams, contrastive, paged):
        with pytest.raises(ValueError, match="beam search|contrastive|continuous batching"):
            plain.generate(ids, **kw, custom_generate=hf_specdec.custom_generate_path("prompt_lookup"),
                           trust_remote_code=True)
    for kw in (beams, contrastive):
        with pytest.raises(ValueError, match="beam search|contrastive"):
            plain.generate(ids, **kw, custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert "runs transformers' own generate(), not prompt_lookup" in caplog.text


def test_pipeline_with_chat_messages(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    hf_specdec.attach(folder, "prompt_lookup", prompt_lookup_num_tokens=4)
    chats = [[{"role": "user", "content": "abcabcabc"}], [{"role": "user", "content": "hello hello"}]]
    kw = dict(max_new_tokens=12, do_sample=False)
    ref = pipeline("text-generation", model=str(folder))(chats, **kw)
    pipe = pipeline("text-generation", model=str(folder), trust_remote_code=True)
    assert pipe(chats, **kw) == ref
    assert pipe(chats, batch_size=2, **kw) == ref
    with pytest.raises(ValueError, match="draft_length_schedule"):  # the call went through hf_specdec
        pipe(chats[0], **kw, draft_length_schedule="bogus")


def test_command_line_attach_and_remove(saved, tmp_path, capsys):
    folder = _copy(saved, tmp_path)
    main(["attach", str(folder), "--method", "assisted", "--drafter", str(saved / "draft"),
          "--link-drafter", "-o", "num_speculative_tokens=2"])
    assert "trust_remote_code=True" in capsys.readouterr().out
    facts = hf_specdec.attached(folder)
    assert facts["options"] == {"num_speculative_tokens": 2}
    assert facts["drafter"] == {"path": str((saved / "draft").resolve())}
    assert not (folder / "custom_generate" / "drafter").exists()
    main(["attach", str(folder), "--method", "suffix"])  # attaching again replaces
    assert hf_specdec.attached(folder)["method"] == "suffix"
    main(["attach", str(folder), "--remove"])
    assert not (folder / "custom_generate").exists() and hf_specdec.attached(folder) is None


def test_attach_refuses_what_would_not_work(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_specdec.attach(tmp_path, "prompt_lookup")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):  # another method's option, named
        hf_specdec.attach(folder, "suffix", prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="takes no drafter"):
        hf_specdec.attach(folder, "prompt_lookup", drafter=saved / "draft")
    with pytest.raises(ValueError, match="needs a drafter.*--drafter"):  # no drafter ships for this tiny model
        hf_specdec.attach(folder, "eagle3")
    with pytest.raises(FileNotFoundError, match="does not exist.*cannot be a Hub repo id"):
        hf_specdec.attach(folder, "assisted", drafter=tmp_path / "no-such-drafter")
    with pytest.raises(ValueError, match="save it first"):
        hf_specdec.attach(folder, "assisted", drafter=tiny_model("llama", layers=1))
    with pytest.raises(ValueError, match="cannot be recorded"):
        hf_specdec.attach(folder, "suffix", suffix_cache=hf_specdec.SuffixCache(max_sequences=4))
    (folder / "custom_generate").mkdir()
    (folder / "custom_generate" / "generate.py").write_text("def generate(model, **kw):\n    return None\n")
    with pytest.raises(FileExistsError, match="not written by hf_specdec"):
        hf_specdec.attach(folder, "prompt_lookup")
    with pytest.raises(FileExistsError, match="not written by hf_specdec"):
        hf_specdec.detach(folder)
    assert hf_specdec.attach(folder, "prompt_lookup", force=True).is_dir()
    assert not list(folder.glob(".custom_generate*"))  # nothing left of the staging


def test_an_attached_model_names_what_it_misses(saved, tmp_path):
    """The copied drafter removed after loading, the cache passed twice: each call refused with the cause and fix."""
    folder = _copy(saved, tmp_path)
    hf_specdec.attach(folder, "assisted", drafter=saved / "draft")
    model = _load(folder, True)
    ids, _ = prompts(1, 12)
    with pytest.raises(ValueError, match="Pass the cache once"):
        model.generate(ids, **GEN, past_key_values=object(), cache=object())
    shutil.rmtree(folder / "custom_generate" / "drafter")
    with pytest.raises(FileNotFoundError, match="not beside the model.*Pass drafter="):
        model.generate(ids, **GEN)
    assert torch.equal(model.generate(ids, **GEN, drafter=str(saved / "draft")), _load(folder, False).generate(ids, **GEN))


def test_hub_round_trip_offline(saved, tmp_path):
    """An attached folder placed in the local Hub cache as a repository (`hf-specdec install-hub-cache --folder`; what
    `publish-hub --folder` uploads), loaded by repo id with HF_HUB_OFFLINE=1: it finds its copied drafter in the cached
    snapshot, or its drafter named by Hub id in the cache, and speculates."""
    folder = _copy(saved, tmp_path)
    hf_specdec.attach(folder, "assisted", drafter=saved / "draft", num_speculative_tokens=3)
    cache = tmp_path / "hub"
    main(["install-hub-cache", "--cache-dir", str(cache), "--folder", str(folder), "--repo", "someone/tiny-assisted"])
    # a drafter named by Hub id: recorded, not copied, fetched (here: found in the cache) when the model is used
    write_cached_repo(cache, "someone/tiny-draft", {p.name: p.read_bytes() for p in (saved / "draft").iterdir()})
    named = _copy(saved, tmp_path, "named")
    hf_specdec.attach(named, "assisted", drafter="someone/tiny-draft")
    assert hf_specdec.attached(named)["drafter"] == {"hub": "someone/tiny-draft"}
    main(["install-hub-cache", "--cache-dir", str(cache), "--folder", str(named), "--repo", "someone/tiny-named"])
    assert publish(folder=named, repo_id="someone/tiny-named", dry_run=True) == ["someone/tiny-named"]
    with pytest.raises(FileNotFoundError, match="hf-specdec attach"):
        publish(folder=saved / "draft", repo_id="someone/x", dry_run=True)
    script = f"""
import torch, sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from transformers import AutoModelForCausalLM
from tiny import prompts
ids, mask = prompts(2, 12)
kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
ref = AutoModelForCausalLM.from_pretrained({str(folder)!r}).generate(**kw)
for repo in ("someone/tiny-assisted", "someone/tiny-named"):
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    out = model.generate(**kw, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref), (out.sequences, ref)
    assert out.speculative_stats["method"].startswith("assisted"), out.speculative_stats
    print("ok", model.name_or_path)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_MODULES_CACHE": str(tmp_path / "mods")}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok someone/tiny-assisted" in res.stdout and "ok someone/tiny-named" in res.stdout
