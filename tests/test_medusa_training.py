"""Medusa-1 head training on a tiny target: the loss against a plain re-implementation of the reference's
``compute_loss``, learning, the saved folder, resume and continuing from trained heads."""

import json

import torch
import torch.nn.functional as F
from safetensors import safe_open

from hf_specdec import training
from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
from hf_specdec.training.medusa import draft_index, medusa_loss
from hf_specdec.training.trainer import TrainConfig, latest_checkpoint
from test_training import conversations, tok  # noqa: F401 (fixtures: the tiny chat template and conversations)
from tiny import tiny_model


def reference_loss(heads, token_map, batch):
    """``train_legacy.py`` ``compute_loss``, per row: head i's logits at ``[:-(2+i)]`` against the labels ``[2+i:]``,
    ignored where the label is off the loss mask (or outside the draft vocabulary); the heads' means summed."""
    ids, keep = batch["input_ids"], batch["valid"] & batch["loss_mask"].bool()
    to_draft = {int(t): j for j, t in enumerate(token_map)}
    labels = torch.tensor([[to_draft.get(int(t), -100) if k else -100 for t, k in zip(r, m)]
                           for r, m in zip(ids, keep)])
    logits = heads(batch["last"]).float()  # [B, T, K, Vd]
    total = 0.0
    for i in range(heads.config.medusa_num_heads):
        lg = logits[:, : -(2 + i), i].reshape(-1, logits.shape[-1])
        total = total + F.cross_entropy(lg, labels[:, 2 + i:].reshape(-1), ignore_index=-100)
    return total


def test_medusa_loss_is_the_reference_loss():
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=40, medusa_num_heads=3, draft_vocab_size=24))
    token_map = torch.randperm(40)[:24].sort().values
    heads.token_map.copy_(token_map)
    for block in heads.blocks:  # non-zero blocks, so every part of a head is exercised
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    loss_mask = torch.zeros(2, 11, dtype=torch.uint8)
    loss_mask[0, 3:], loss_mask[1, 5:9] = 1, 1
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 9:] = False
    batch = {"input_ids": torch.randint(0, 40, (2, 11)), "loss_mask": loss_mask, "valid": valid,
             "last": torch.randn(2, 11, 16)}
    loss, metrics = medusa_loss(heads, draft_index(token_map, 40), batch)
    torch.testing.assert_close(loss, reference_loss(heads, token_map, batch), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert heads.blocks[2].layers[0].weight.grad is not None
    assert metrics["tau_est"] >= 1.0 and metrics["tau_chain"] >= 1.0
    assert set(metrics) == {f"{k}{i}" for k in ("loss", "acc") for i in range(3)} | {"tau_est", "tau_chain"}


def test_train_medusa_learns_saves_and_resumes(tmp_path, tok, conversations):  # noqa: F811
    target = tiny_model("llama", layers=2, hidden=32)
    cfg = TrainConfig(epochs=40, batch_size=4, grad_accum=1, save_every=20, log_every=5, lr=1e-2, warmup_ratio=0.0)
    heads, metrics = training.train_medusa(target, tok, tmp_path / "m", heads=2, draft_vocab=48, samples=8,
                                           max_length=64, config=cfg, progress=False)
    log = [json.loads(line) for line in (tmp_path / "m" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"] and log[-1]["acc0"] > log[0]["acc0"] + 0.2
    assert metrics["step"] == 80 and latest_checkpoint(tmp_path / "m").name == "checkpoint-80"
    # the saved folder: fp16 heads over the 48 most frequent training tokens, read back by from_pretrained
    with safe_open(str(tmp_path / "m" / "final" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_heads.0.weight").dtype == torch.float16
    loaded = MedusaHeads.from_pretrained(tmp_path / "m" / "final")
    assert loaded.config.draft_vocab_size == 48
    assert loaded.token_map.dtype == torch.long and torch.equal(loaded.token_map, heads.token_map)
    assert loaded.num_heads == 2 and loaded(torch.randn(3, 32)).shape == (3, 2, 48)
    # resume: a longer run continues from its last checkpoint
    cfg.max_steps = 85
    _, metrics = training.train_medusa(target, tok, tmp_path / "m", heads=2, draft_vocab=48, samples=8,
                                       max_length=64, config=cfg, progress=False)
    assert metrics["step"] == 85
    # continue from the trained heads in another folder: same heads, same vocabulary, a better start than scratch
    cfg.max_steps = 5
    again, metrics = training.train_medusa(target, tok, tmp_path / "m2", samples=8, max_length=64, config=cfg,
                                           progress=False, features_dir=tmp_path / "m" / "features",
                                           init_from=tmp_path / "m" / "final")
    assert again.num_heads == 2 and torch.equal(again.token_map, heads.token_map)
    first = json.loads((tmp_path / "m2" / "log.jsonl").read_text().splitlines()[0])
    assert first["acc0"] > log[0]["acc0"] + 0.2
