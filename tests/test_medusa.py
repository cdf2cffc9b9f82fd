"""Medusa: the heads against a plain re-implementation of their equations, the static tree, lossless greedy decoding
on every architecture, typical acceptance (opt-in, lossy) and the errors."""

import pytest
import torch

import hf_specdec
from hf_specdec import engine as engine_mod
from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
from hf_specdec.proposers.medusa import MC_SIM_7B_63, check_choices
from hf_specdec.tree import DraftTree
from hf_specdec.verify import accept
from tiny import VOCAB, prompts, tiny_model

H = 32


def _heads(num_heads=3, layers=1, shared=False, draft_vocab=None, seed=0, scale=0.3):
    torch.manual_seed(seed)
    config = MedusaConfig(hidden_size=H, vocab_size=VOCAB, medusa_num_heads=num_heads, medusa_num_layers=layers,
                          shared_layers=shared, draft_vocab_size=draft_vocab)
    heads = MedusaHeads(config).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, scale)
        if draft_vocab:
            heads.token_map.copy_(torch.randperm(VOCAB)[:draft_vocab].sort().values)
    return heads


def _plain_heads(heads, hidden):
    """Head i: x = h; L times x = x + silu(W x + b) (one W per block, or the one shared W); logits = U_i x."""
    cfg = heads.config
    out = []
    for i in range(cfg.medusa_num_heads):
        x = hidden
        layers = heads.blocks[i].layers
        weights = [layers[0]] * cfg.medusa_num_layers if cfg.shared_layers else list(layers)
        for lin in weights:
            x = x + torch.nn.functional.silu(x @ lin.weight.T + lin.bias)
        out.append(x @ heads.lm_heads[i].weight.T)
    return torch.stack(out, dim=-2)


@pytest.mark.parametrize("layers,shared", [(1, False), (2, False), (3, True)])
def test_heads_match_the_plain_equations(layers, shared):
    heads = _heads(num_heads=4, layers=layers, shared=shared)
    hidden = torch.randn(2, 5, H)
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden), _plain_heads(heads, hidden), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(heads(hidden, heads=2), _plain_heads(heads, hidden)[..., :2, :])
    stored = sum(1 for k in heads.state_dict() if k.endswith(".weight") and k.startswith("blocks.0."))
    assert stored == (1 if shared else layers)


def test_save_load_round_trip_auto_class_and_push_to_hub(tmp_path, hub_upload):
    from transformers import AutoModel

    heads = _heads(draft_vocab=40)
    heads.push_to_hub("me/tiny-medusa")
    assert hub_upload["repo"] == "me/tiny-medusa" and {"config.json", "model.safetensors"} <= set(hub_upload["files"])
    heads.save_pretrained(tmp_path)
    again = AutoModel.from_pretrained(tmp_path)
    assert isinstance(again, MedusaHeads)
    h = torch.randn(3, H)
    with torch.no_grad():
        torch.testing.assert_close(again(h), heads(h))
    assert torch.equal(again.token_map, heads.token_map)


def test_choices_are_checked_and_sorted_parent_first():
    assert len(MC_SIM_7B_63) == 63 and max(len(c) for c in MC_SIM_7B_63) == 4
    paths = check_choices(MC_SIM_7B_63, num_heads=5)
    assert paths[:3] == [(0,), (1,), (2,)] and len(paths) == 63
    assert all(len(p) <= 2 for p in check_choices("mc_sim_7b_63", num_heads=2))
    with pytest.raises(ValueError, match="not its parent"):
        check_choices([[0], [1, 0]], 3)
    with pytest.raises(ValueError, match="Unknown medusa_choices"):
        check_choices("mc_sim_13b", 3)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_lossless(arch, bsz):
    target = tiny_model(arch, layers=2, hidden=H)
    ids, mask = prompts(bsz, 12, seed=bsz)
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    for opts in ({"medusa_choices": list(MC_SIM_7B_63[:12])}, {"num_speculative_tokens": 3},
                 {"draft_vocab": 48}):
        vocab = opts.pop("draft_vocab", None)
        out = target.generate(input_ids=ids, attention_mask=mask, **kw, return_dict_in_generate=True,
                              custom_generate=hf_specdec.decoding_method("medusa"),
                              drafter=_heads(draft_vocab=vocab), draft_length_schedule="constant", **opts)
        assert torch.equal(out.sequences, ref), opts
        assert out.speculative_stats["proposed_drafts"] > 0
        assert out.speculative_stats["acceptance"] == "exact"


def test_the_tree_is_the_heads_top_k(monkeypatch):
    """Node [i, j] is head 0's i-th best token followed by head 1's j-th best, read on the root's hidden state."""
    target = tiny_model("llama", layers=2, hidden=H)
    heads = _heads(num_heads=2)
    seen = []

    def spy(tree, *args, **kwargs):
        seen.append(tree)
        return accept(tree, *args, **kwargs)

    monkeypatch.setattr(engine_mod, "accept", spy)
    ids, mask = prompts(1, 12)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                          custom_generate=hf_specdec.decoding_method("medusa"), drafter=heads,
                          medusa_choices=[[0], [1], [0, 0], [0, 2]], draft_length_schedule="constant")
    with torch.no_grad():
        hidden = target(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1][:, -1]
        top = heads(hidden).topk(3, dim=-1).indices[0]  # [2 heads, 3]
    tree = seen[0]
    assert tree.tokens[0, 0] == out[0, ids.shape[1]]
    assert tree.tokens[0, 1:].tolist() == [top[0, 0], top[0, 1], top[1, 0], top[1, 2]]
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1]


def test_padded_batch_with_budgets_and_static_cache():
    target = tiny_model("qwen3", layers=2, hidden=H)
    ids, mask = prompts(3, 14, seed=7)
    kw = dict(do_sample=False, eos_token_id=None, max_new_tokens=17)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, custom_generate=hf_specdec.custom_generate_path(
        "medusa"), trust_remote_code=True, drafter=_heads(num_heads=4), cache_implementation="static")
    assert torch.equal(out, ref)


def test_typical_acceptance_is_off_by_default_and_differs_when_on():
    # the rule itself: a draft with q(x) = 0.5 is always typical; exact acceptance keeps it half of the time
    tree = DraftTree.chain(torch.tensor([3]), torch.tensor([[5]]))
    logits = torch.full((1, 2, 8), -30.0)
    logits[0, 0, 5] = logits[0, 0, 6] = 0.0
    logits[0, 1, 2] = 0.0
    prefix = [torch.tensor([3])]
    kept = {"exact": 0, "typical": 0}
    torch.manual_seed(0)
    for _ in range(200):
        kept["exact"] += accept(tree, logits, prefix, [True], None, True).num_accepted[0]
        kept["typical"] += accept(tree, logits, prefix, [True], None, True, typical=(0.09, 0.3)).num_accepted[0]
    assert kept["typical"] == 200 and 60 < kept["exact"] < 140
    with pytest.raises(ValueError, match="sampling rule"):
        accept(tree, logits, prefix, [True], None, False, typical=(0.09, 0.3))

    target = tiny_model("llama", layers=2, hidden=H, scale=1.0)
    ids = prompts(1, 10)[0].repeat(16, 1)
    kw = dict(max_new_tokens=12, do_sample=True, eos_token_id=None, return_dict_in_generate=True,
              custom_generate=hf_specdec.decoding_method("medusa"), drafter=_heads(scale=0.1),
              draft_length_schedule="constant")
    runs = {}
    for rule in ("exact", "typical"):
        torch.manual_seed(1)
        extra = {} if rule == "exact" else {"acceptance": "typical"}
        runs[rule] = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw, **extra)
    assert runs["exact"].speculative_stats["acceptance"] == "exact"
    assert runs["typical"].speculative_stats["acceptance"] == "typical (lossy)"
    assert runs["typical"].speculative_stats["accepted_drafts"] > runs["exact"].speculative_stats["accepted_drafts"]
    with pytest.raises(ValueError, match="sampling rule"):
        target.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False,
                        custom_generate=hf_specdec.decoding_method("medusa"), drafter=_heads(), acceptance="typical")


def test_heads_that_do_not_fit_the_target_are_refused():
    target = tiny_model("llama", layers=2, hidden=H)
    ids = prompts(1, 8)[0]
    wrong_hidden = MedusaHeads(MedusaConfig(hidden_size=48, vocab_size=VOCAB, medusa_num_heads=2))
    wrong_vocab = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=VOCAB + 4, medusa_num_heads=2))
    for heads, match in ((wrong_hidden, "hidden size 48 vs the target's 32"),
                         (wrong_vocab, f"vocabulary {VOCAB + 4} vs the target's {VOCAB}")):
        with pytest.raises(ValueError, match=match):
            target.generate(input_ids=ids, max_new_tokens=3, custom_generate=hf_specdec.decoding_method("medusa"),
                            drafter=heads)
    with pytest.raises(ValueError, match="draft_vocab_size 200 is larger"):
        MedusaConfig(hidden_size=H, vocab_size=VOCAB, draft_vocab_size=200)
    with pytest.raises(ValueError, match="not both"):
        target.generate(input_ids=ids, max_new_tokens=3, custom_generate=hf_specdec.decoding_method("medusa"),
                        drafter=_heads(), num_speculative_tokens=2, medusa_choices=[[0]])


def test_pipeline_batched():
    from transformers import pipeline

    from tiny import word_tokenizer

    target = tiny_model("llama", layers=2, hidden=H)
    pipe = pipeline("text-generation", model=target, tokenizer=word_tokenizer())
    kw = dict(max_new_tokens=8, do_sample=False, return_full_text=False)
    texts = ["abcabcabc", "hello!!"]
    assert pipe(texts, batch_size=2, **kw, custom_generate=hf_specdec.custom_generate_path("medusa"),
                trust_remote_code=True, drafter=_heads()) == pipe(texts, batch_size=2, **kw)
