"""The drafter trainers end to end on a tiny target: feature caching, EAGLE-3 training-time test, the distilled
student, checkpoints and resume (correctness of the pipeline, not quality)."""

import json

import pytest
import torch

import hf_specdec
from hf_specdec import training
from hf_specdec.training import data as data_mod
from hf_specdec.training.eagle3 import draft_vocabulary, ttt_loss
from hf_specdec.training.trainer import TrainConfig, latest_checkpoint
from tiny import prompts, tiny_model, word_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'][0] }}:{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>a:{% endif %}")


@pytest.fixture()
def tok():
    t = word_tokenizer()
    t.chat_template = TEMPLATE
    return t


@pytest.fixture()
def conversations(monkeypatch):
    convs = [[{"role": "user", "content": f"q{i}abcabc"}, {"role": "assistant", "content": "xyzxyzxyz" * (1 + i % 3)},
              {"role": "user", "content": "more!"}, {"role": "assistant", "content": f"ok{i}okokok"}]
             for i in range(12)]
    monkeypatch.setattr(data_mod, "read_sharegpt", lambda path=None: convs)
    return convs


def test_tokenize_conversation_masks_assistant_turns(tok, conversations):
    ids, mask = data_mod.tokenize_conversation(tok, conversations[0], max_length=200)
    text = tok.decode([i for i, m in zip(ids, mask) if m])
    assert "xyzxyzxyz" in text and "ok0okokok" in text and "q0" not in text
    assert len(ids) == len(mask)


def test_read_sharegpt_recovers_complete_records(tmp_path):
    records = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
               {"id": "b", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q"},
                                             {"from": "bard", "value": "a"}]}]
    text = json.dumps(records, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-1] + ',\n {"id": "c", "conversations": [{"from": "human", "val')  # truncated like the wheel
    convs = data_mod.read_sharegpt(path)
    assert len(convs) == 2
    assert convs[1] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_draft_vocabulary():
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    d2t, t2d = draft_vocabulary(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 4]
    assert t2d.tolist() == [True, False, True, False, True, False]


def test_train_eagle3_resume_and_generate(tmp_path, tok, conversations):
    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=1, batch_size=2, grad_accum=1, save_every=2, log_every=1, max_steps=3, lr=1e-3)
    drafter, metrics = training.train_eagle3(target, tok, tmp_path / "e3", samples=8, max_length=64, draft_vocab=48,
                                             config=cfg, progress=False)
    assert "acc0" in metrics and metrics["step"] == 3
    assert latest_checkpoint(tmp_path / "e3").name == "checkpoint-3"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "e3" / "final" / "model.safetensors"), "pt") as f:  # shipped in half precision
        assert f.get_tensor("lm_head.weight").dtype == torch.float16 and "embed_tokens.weight" not in f.keys()
    # resume: a longer run continues from the last checkpoint
    cfg.max_steps = 4
    _, metrics = training.train_eagle3(target, tok, tmp_path / "e3", samples=8, max_length=64, draft_vocab=48,
                                       config=cfg, progress=False)
    assert metrics["step"] == 4
    ids, mask = prompts(2, 12)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                          custom_generate=hf_specdec.decoding_method("eagle3"), drafter=str(tmp_path / "e3" / "final"))
    assert torch.equal(out, ref)


def test_ttt_loss_decreases(tok, conversations, tmp_path):
    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=30, batch_size=4, grad_accum=1, save_every=1000, log_every=5, lr=3e-3, warmup_ratio=0.0)
    _, _ = training.train_eagle3(target, tok, tmp_path / "e3", samples=4, max_length=64, draft_vocab=48, config=cfg,
                                 progress=False)
    log = [json.loads(line) for line in (tmp_path / "e3" / "log.jsonl").read_text().splitlines()]
    # the tiny target's distribution is almost flat (its entropy bounds the loss): accuracy shows the learning
    assert log[-1]["acc0"] > log[0]["acc0"] + 0.2 and log[-1]["loss"] < log[0]["loss"]


def test_train_draft_student(tmp_path, tok, conversations):
    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=1, batch_size=2, grad_accum=1, save_every=100, log_every=1, max_steps=2)
    student, metrics = training.train_draft(target, tok, tmp_path / "d", layers=2, samples=6, max_length=64,
                                            config=cfg, progress=False)
    assert student.config.num_hidden_layers == 2 and metrics["step"] == 2
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    out = target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                          custom_generate=hf_specdec.decoding_method("assisted"), drafter=str(tmp_path / "d" / "final"))
    assert torch.equal(out, ref)


def test_ttt_loss_shapes():
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=96, draft_vocab_size=96, num_target_layers=4)
    drafter = Eagle3Drafter(cfg)
    batch = {"input_ids": torch.randint(0, 96, (2, 10)), "loss_mask": torch.ones(2, 10, dtype=torch.uint8),
             "features": torch.randn(2, 10, 96), "last": torch.randn(2, 10, 32),
             "target_argmax": torch.randint(0, 96, (2, 10)), "valid": torch.ones(2, 10, dtype=torch.bool)}
    loss, metrics = ttt_loss(drafter, torch.randn(96, 32), batch, steps=3)
    loss.backward()
    assert set(metrics) == {"acc0", "acc1", "acc2", "loss0", "loss1", "loss2"}
    assert drafter.fc.weight.grad is not None and drafter.embed_tokens.weight.grad is None


def test_regenerated_answers_come_from_the_target(tok, conversations):
    target = tiny_model("llama", layers=2, hidden=32)
    regen = data_mod.regenerate(target, tok, conversations[:3], max_new_tokens=6, batch_size=2, progress=False)
    assert len(regen) >= 1
    for conv in regen:
        assert [t["role"] for t in conv] == ["user", "assistant"]
        prompt = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=False)
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        greedy = target.generate(**enc, max_new_tokens=6, do_sample=False)
        assert tok.decode(greedy[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip() == conv[1]["content"]


def test_train_dflash_and_generate(tmp_path, tok, conversations):
    from hf_specdec.training.dflash import sample_anchors

    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])
    valid = torch.tensor([True] * 7 + [False])
    anchors = sample_anchors(mask, valid, 10)
    assert anchors[anchors >= 0].tolist() == [1, 2, 3, 5]  # label at p+1 must be a real, loss-masked token
    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=20, batch_size=2, grad_accum=1, save_every=1000, log_every=5, lr=3e-3, warmup_ratio=0.0)
    drafter, metrics = training.train_dflash(target, tok, tmp_path / "df", layers=1, block_size=4, samples=6,
                                             max_length=64, config=cfg, num_anchors=4, progress=False)
    log = [json.loads(line) for line in (tmp_path / "df" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    assert drafter.config.target_layer_ids == [1, 1, 0]  # the layer outputs of EAGLE-3's default features
    ids, mask = prompts(2, 12)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                          custom_generate=hf_specdec.decoding_method("dflash"), drafter=str(tmp_path / "df" / "final"))
    assert torch.equal(out, ref)
