"""Draft models that share the target's embeddings and head: saved without them, rebuilt from the target."""

import json

import pytest
import torch
from safetensors.torch import load_file

import hf_specdec
from hf_specdec import load_draft_model, save_draft_model
from tiny import prompts, tiny_model


def _student(target_arch="llama", tie=True, seed=1):
    target = tiny_model(target_arch, layers=3, tie_word_embeddings=tie)
    student = tiny_model(target_arch, layers=1, seed=seed, tie_word_embeddings=tie)
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        student.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    return target, student


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_rebuilds_the_embeddings_from_the_target(tmp_path, tie):
    target, student = _student(tie=tie)
    save_draft_model(student, tmp_path / "s", dtype=torch.float32)
    stored = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in stored)
    assert json.loads((tmp_path / "s" / "config.json").read_text())["hf_specdec_shares_target_embeddings"]
    loaded = load_draft_model(tmp_path / "s", target)
    ids, _ = prompts(2, 9)
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits)
    ref = target.generate(ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=None)
    out = target.generate(ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=None,
                          custom_generate=hf_specdec.decoding_method("assisted"), drafter=str(tmp_path / "s"))
    assert torch.equal(out, ref)


def test_half_precision_weights_are_small_and_cast_to_the_target_dtype(tmp_path):
    target, student = _student()
    save_draft_model(student, tmp_path / "s")
    assert all(v.dtype == torch.float16 for v in load_file(str(tmp_path / "s" / "model.safetensors")).values())
    assert load_draft_model(tmp_path / "s", target).dtype == torch.float32


def test_plain_folders_load_with_from_pretrained(tmp_path):
    target, student = _student()
    student.save_pretrained(tmp_path / "plain")
    loaded = load_draft_model(tmp_path / "plain", target)
    ids, _ = prompts(1, 6)
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits)


def test_a_student_of_another_target_is_refused(tmp_path):
    _, student = _student()
    save_draft_model(student, tmp_path / "s")
    other = tiny_model("llama", layers=2, hidden=48)
    with pytest.raises(ValueError, match="hidden_size"):
        load_draft_model(tmp_path / "s", other)
    bigger = tiny_model("llama", layers=2, vocab=160)
    with pytest.raises(ValueError, match="vocab_size"):
        load_draft_model(tmp_path / "s", bigger)


def test_truncated_or_mismatched_weights_are_refused(tmp_path):
    target, student = _student()
    save_draft_model(student, tmp_path / "s")
    weights = tmp_path / "s" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is incomplete or corrupt.*download it again"):
        load_draft_model(tmp_path / "s", target)
    save_draft_model(tiny_model("llama", layers=2), tmp_path / "two")
    cfg = json.loads((tmp_path / "two" / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (tmp_path / "two" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unexpected"):
        load_draft_model(tmp_path / "two", target)
    (tmp_path / "s" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_draft_model(tmp_path / "s", target)


def test_demo_takes_trained_drafter_folders(tmp_path):
    from hf_specdec.demo import available_demo_methods
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
    from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads

    target, student = _student()
    save_draft_model(student, tmp_path / "student")
    Eagle3Drafter(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=96, num_target_layers=3)).save_pretrained(tmp_path / "eagle3")
    DFlashDrafter(DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size=96, block_size=4, mask_token_id=95,
                               target_layer_ids=[0, 1], num_target_layers=3)).save_pretrained(tmp_path / "dflash")
    MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=96, medusa_num_heads=2)).save_pretrained(tmp_path / "medusa")
    methods = available_demo_methods(target, eagle3=str(tmp_path / "eagle3"), dflash=str(tmp_path / "dflash"),
                                     medusa=str(tmp_path / "medusa"), drafter=tmp_path / "student")
    assert set(methods) == {"prompt_lookup", "suffix", "lookahead", "eagle3", "dflash", "assisted", "medusa", "layerskip"}
    ids, _ = prompts(1, 8)
    ref = target.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    for name, opts in methods.items():
        out = target.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                              custom_generate=hf_specdec.decoding_method(name, **opts))
        assert torch.equal(out, ref), name


def test_draft_vocabulary_is_saved_loaded_and_scores_only_its_tokens(tmp_path):
    """A student saved with a draft vocabulary drafts only those tokens: its restricted head gives the full head's
    logits there, and the output still equals the target's."""
    from hf_specdec.proposers.draft_model import DraftModelProposer, restricted_head

    target, student = _student()
    vocab = torch.arange(0, 96, 3)
    save_draft_model(student, tmp_path / "s", dtype=torch.float32, draft_vocab=vocab.flip(0))
    loaded = load_draft_model(tmp_path / "s", target)
    assert torch.equal(loaded.hf_specdec_draft_vocab, vocab)  # sorted on save
    assert torch.equal(DraftModelProposer(loaded).vocab, vocab)
    assert DraftModelProposer(loaded, draft_vocab="full").head is None
    head, ids = restricted_head(loaded, vocab)
    x = torch.randn(2, student.config.hidden_size)
    torch.testing.assert_close(head(x), loaded.get_output_embeddings()(x)[:, vocab])
    ids_in, mask = prompts(3, 9)
    ref = target.generate(ids_in, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    out = target.generate(ids_in, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                          custom_generate=hf_specdec.decoding_method("assisted"), drafter=str(tmp_path / "s"),
                          num_speculative_tokens=2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.speculative_stats["proposed_drafts"] > 0


def test_bad_draft_vocabularies_are_refused(tmp_path):
    from hf_specdec.proposers.draft_model import DraftModelProposer

    target, student = _student()
    for bad in ([], [0, 96], [-1, 3]):
        with pytest.raises(ValueError, match="draft_vocab must be"):
            DraftModelProposer(student, draft_vocab=bad)
    with pytest.raises(ValueError, match="'full'"):
        DraftModelProposer(student, draft_vocab="most")
    student.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-caps"):
        DraftModelProposer(student, draft_vocab=[1, 2])
    del student.config.final_logit_softcapping
    save_draft_model(student, tmp_path / "s", draft_vocab=[1, 500])
    with pytest.raises(ValueError, match="draft_vocab must be"):
        DraftModelProposer(load_draft_model(tmp_path / "s", target))
