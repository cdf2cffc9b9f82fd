"""MTP training on a tiny target: a short post-hoc run of a sequential module and of parallel heads (the target
frozen) learns, saves a half-precision folder without the target's weights, and decodes losslessly; the
parallel-heads loss against a plain computation; the CLI wiring."""

import json

import torch

import hf_specdec
from hf_specdec import training
from hf_specdec.modeling.mtp import ParallelMTPConfig, ParallelMTPHeads, block_config_for
from hf_specdec.training.mtp import parallel_heads_loss
from hf_specdec.training.trainer import TrainConfig
from test_training import conversations, tok  # noqa: F401 (fixtures: the tiny chat template and conversations)
from tiny import prompts, tiny_model


def _decodes_losslessly(target, folder):
    ids, mask = prompts(3, length=12)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw,
                          custom_generate=hf_specdec.decoding_method("mtp"), drafter=str(folder))
    assert torch.equal(out, ref)


def test_train_mtp_learns_and_decodes(tmp_path, tok, conversations):  # noqa: F811
    target = tiny_model("llama", layers=2, hidden=32)
    cfg = TrainConfig(epochs=30, batch_size=4, grad_accum=1, save_every=1000, log_every=5, lr=1e-2, warmup_ratio=0.0)
    module, metrics = training.train_mtp(target, tok, tmp_path / "m", depths=2, draft_vocab=48, samples=8,
                                         max_length=64, config=cfg, progress=False)
    log = [json.loads(line) for line in (tmp_path / "m" / "log.jsonl").read_text().splitlines()]
    # the tiny target's distributions are nearly flat (the soft loss's floor is near its start): agreement shows it
    assert log[-1]["loss"] < log[0]["loss"] and log[-1]["acc0"] > max(0.8, log[0]["acc0"] + 0.3)
    assert {"loss1", "acc1", "tau_chain"} <= set(log[-1])
    folder = tmp_path / "m" / "final"
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "hf_specdec_mtp" and saved["dtype"] == "float16"
    assert saved["block_config"]["model_type"] == "llama" and saved["draft_vocab_size"] == 48
    assert (folder / "model.safetensors").stat().st_size < 80_000  # the target's embedding and head are not stored
    assert all(p.grad is None for p in target.parameters())
    _decodes_losslessly(target, folder)


def test_train_parallel_heads_learns_and_decodes(tmp_path, tok, conversations):  # noqa: F811
    target = tiny_model("llama", layers=3, hidden=32)
    cfg = TrainConfig(epochs=30, batch_size=4, grad_accum=1, save_every=1000, log_every=5, lr=1e-2, warmup_ratio=0.0)
    heads, _ = training.train_parallel_mtp(target, tok, tmp_path / "p", heads=2, draft_vocab=48, samples=8,
                                           max_length=64, config=cfg, progress=False)
    log = [json.loads(line) for line in (tmp_path / "p" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] and log[-1]["acc1"] > log[0]["acc1"] + 0.2
    assert isinstance(heads, ParallelMTPHeads) and heads.num_modules == 2
    _decodes_losslessly(target, tmp_path / "p" / "final")


def test_parallel_heads_loss_is_the_soft_cross_entropy():
    target = tiny_model("llama", layers=3)
    heads = ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(target.config, 2), num_modules=2,
                                               vocab_size=96, draft_vocab_size=48))
    heads.set_draft_vocabulary(torch.arange(0, 96, 2))
    heads.init_from_target(target)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 9))
    out = target(ids, output_hidden_states=True)
    valid = torch.ones(2, 9, dtype=torch.bool)
    loss_mask = torch.zeros(2, 9, dtype=torch.uint8)
    loss_mask[:, 3:] = 1
    in_draft = torch.zeros(96, dtype=torch.bool)
    in_draft[heads.token_map] = True
    argmax = out.logits.argmax(-1)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "valid": valid, "last": out.hidden_states[-1],
             "exit": out.hidden_states[-2], "target_argmax": argmax}
    loss, metrics = parallel_heads_loss(heads, in_draft, batch)
    # plain: head i at position t counts when token t + 2 + i is under the loss mask and the target's argmax at
    # t + 1 + i is a draft token
    normed = heads(batch["exit"], torch.arange(9).expand(2, 9))
    head = target.lm_head.weight[heads.token_map]
    total = 0.0
    for i in range(2):
        terms = []
        for b in range(2):
            for t in range(9 - 2 - i):
                if loss_mask[b, t + 2 + i] and in_draft[argmax[b, t + 1 + i]]:
                    p = torch.softmax(batch["last"][b, t + 1 + i] @ head.T, -1)
                    terms.append(-(p * torch.log_softmax(normed[b, t, i] @ head.T, -1)).sum())
        total = total + torch.stack(terms).mean()
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-5)
    assert {"loss0", "loss1", "acc0", "acc1", "tau_chain"} <= set(metrics)


def test_cli_train_mtp_wiring(monkeypatch, tmp_path):
    """`hf-specdec train mtp` and `train mtp-parallel` reach their trainers with the options given."""
    from hf_specdec import cli

    seen = {}
    monkeypatch.setattr(cli.train, "_load_model", lambda *a, **k: (object(), object()))
    monkeypatch.setattr(training, "train_mtp", lambda *a, **k: (seen.setdefault("mtp", k), {})[::-1])
    monkeypatch.setattr(training, "train_parallel_mtp", lambda *a, **k: (seen.setdefault("parallel", k), {})[::-1])
    assert cli.main(["train", "mtp", "--out", str(tmp_path / "m"), "--depths", "2", "--draft-vocab", "512"]) == 0
    assert (seen["mtp"]["depths"], seen["mtp"]["draft_vocab"]) == (2, 512)
    assert cli.main(["train", "mtp-parallel", "--out", str(tmp_path / "p"), "--heads", "4"]) == 0
    assert seen["parallel"]["heads"] == 4
