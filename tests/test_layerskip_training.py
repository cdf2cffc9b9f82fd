"""LayerSkip training on a tiny target: the exit adapter (frozen target, its loss against a plain computation,
learning, the saved folder it decodes with) and the LayerSkip recipe (dropout rates, curricula, the early-exit loss
against a plain forward, a short run whose result loads as a plain transformers model)."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import hf_specdec
from hf_specdec import training
from hf_specdec.training.layerskip import (
    curriculum_layers,
    dropout_rates,
    exit_adapter_loss,
    exit_scales,
    layerskip_loss,
)
from hf_specdec.training.trainer import TrainConfig
from test_layerskip import random_adapter
from test_training import conversations, tok  # noqa: F401 (fixtures: the tiny chat template and conversations)
from tiny import prompts, tiny_model


def test_exit_adapter_loss_is_the_soft_cross_entropy():
    target = tiny_model("llama", layers=4)
    adapter = random_adapter(target, draft_vocab=48, scale=0.3)
    torch.manual_seed(1)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 7:] = False
    loss_mask = torch.zeros(2, 9, dtype=torch.uint8)
    loss_mask[:, 4:] = 1
    batch = {"exit": torch.randn(2, 9, 32), "last": torch.randn(2, 9, 32), "valid": valid, "loss_mask": loss_mask,
             "input_ids": torch.randint(0, 96, (2, 9)), "target_argmax": torch.randint(0, 96, (2, 9))}
    loss, metrics = exit_adapter_loss(adapter, batch)
    # plain: position t of row b counts when t + 1 is a real token under the loss mask
    head = target.lm_head.weight[adapter.token_map]
    total, n = 0.0, 0
    for b in range(2):
        out = adapter(batch["exit"][b:b + 1], torch.arange(9)[None])[0]
        for t in range(8):
            if valid[b, t + 1] and loss_mask[b, t + 1]:
                p = torch.softmax(batch["last"][b, t] @ head.T, -1)
                total = total - (p * torch.log_softmax(out[t] @ head.T, -1)).sum()
                n += 1
    torch.testing.assert_close(loss, total / n, rtol=1e-5, atol=1e-6)
    assert 0.0 <= metrics["acc"] <= 1.0 and metrics["tau_chain4"] >= 1.0 and metrics["kl"] >= -1e-5


def test_train_exit_adapter_learns_and_decodes(tmp_path, tok, conversations):  # noqa: F811
    target = tiny_model("llama", layers=4, hidden=32)
    cfg = TrainConfig(epochs=30, batch_size=4, grad_accum=1, save_every=1000, log_every=5, lr=1e-2, warmup_ratio=0.0)
    adapter, metrics = training.train_exit_adapter(target, tok, tmp_path / "a", exit_layer=2, draft_vocab=48,
                                                   samples=8, max_length=64, config=cfg, progress=False)
    log = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["kl"] < 0.5 * log[0]["kl"] and log[-1]["acc"] > log[0]["acc"]
    folder = tmp_path / "a" / "final"
    saved = json.loads((folder / "config.json").read_text())
    assert saved["exit_layer"] == 2 and saved["dtype"] == "float16"  # what the file holds
    assert (folder / "model.safetensors").stat().st_size < 64_000  # the target's head is not stored
    ids, mask = prompts(3, length=12)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw,
                          custom_generate=hf_specdec.decoding_method("layerskip"), drafter=str(folder))
    assert torch.equal(out, ref)


def test_dropout_rates_rise_with_depth():
    rates = dropout_rates(5, 0.2)
    assert rates[0] == 0 and abs(float(rates[-1]) - 0.2) < 1e-6 and bool((rates[1:] > rates[:-1]).all())
    assert torch.allclose(dropout_rates(3, 0.1, "linear"), torch.tensor([0.0, 0.05, 0.1]))


def test_curricula():
    assert curriculum_layers(0, 8, "rotational", every=4) == [0, 4, 7]
    assert curriculum_layers(1, 8, "rotational", every=4) == [3, 7]
    assert curriculum_layers(0, 8, "gradual", total_steps=8) == [7]
    assert curriculum_layers(7, 8, "gradual", total_steps=8) == list(range(8))
    weights = exit_scales([1, 3, 7], 8)
    assert abs(sum(weights.values()) - 1) < 1e-6 and weights[3] > weights[1]
    with pytest.raises(ValueError, match="curriculum"):
        curriculum_layers(0, 8, "random")


def test_layerskip_loss_at_the_last_layer_is_the_models_own_loss():
    model = tiny_model("qwen3", layers=4).eval()
    ids = torch.randint(3, 96, (2, 10))
    batch = {"input_ids": ids, "valid": torch.ones(2, 10, dtype=torch.bool)}
    rates = torch.zeros(4)
    # step 1 with every=8: only the last layer's exit is in the loss
    loss, metrics = layerskip_loss(model, batch, step=1, rates=rates, every=8)
    assert set(metrics) == {"loss_l3"}
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1)),
                               rtol=1e-5, atol=1e-5)
    # an early exit: the model's own head over the first layers (transformers' assistant_early_exit reads the same)
    loss, metrics = layerskip_loss(model, batch, step=0, rates=rates, every=2)
    assert set(metrics) == {"loss_l0", "loss_l2", "loss_l3"}
    model.config.num_hidden_layers = 3
    try:
        with torch.no_grad():
            early = model(ids).logits
    finally:
        model.config.num_hidden_layers = 4
    torch.testing.assert_close(torch.tensor(metrics["loss_l2"]),
                               F.cross_entropy(early[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1)),
                               rtol=1e-4, atol=1e-4)


def test_train_layerskip_recipe_writes_a_plain_model(tmp_path, tok, conversations):  # noqa: F811
    target = tiny_model("llama", layers=4)
    cfg = TrainConfig(max_steps=6, batch_size=2, grad_accum=1, save_every=1000, log_every=2, lr=1e-3)
    model, metrics = training.train_layerskip(target, tok, tmp_path / "r", samples=4, max_length=48, config=cfg,
                                              progress=False, max_dropout=0.2, exit_every=2)
    assert "loss" in metrics
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "r" / "final")
    ids, mask = prompts(1, length=10)
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    ref = loaded.generate(input_ids=ids, attention_mask=mask, **kw)
    out = loaded.generate(input_ids=ids, attention_mask=mask, **kw,
                          custom_generate=hf_specdec.decoding_method("layerskip"), exit_layer=2)
    assert torch.equal(out, ref)


def test_cli_train_layerskip_wiring(monkeypatch, tmp_path):
    """`hf-specdec train layerskip-adapter` and `train layerskip` reach their trainers with the options given."""
    from hf_specdec import cli

    seen = {}
    monkeypatch.setattr(cli.train, "_load_model", lambda *a, **k: (object(), object()))
    monkeypatch.setattr(training, "train_exit_adapter", lambda *a, **k: (seen.setdefault("adapter", k), {})[::-1])
    monkeypatch.setattr(training, "train_layerskip", lambda *a, **k: (seen.setdefault("recipe", k), {})[::-1])
    assert cli.main(["train", "layerskip-adapter", "--out", str(tmp_path / "a"), "--exit-layer", "3", "--no-mlp",
                     "--layers", "2", "--draft-vocab", "512"]) == 0
    adapter = seen["adapter"]
    assert (adapter["exit_layer"], adapter["mlp"], adapter["layers"], adapter["draft_vocab"]) == (3, False, 2, 512)
    assert cli.main(["train", "layerskip", "--out", str(tmp_path / "r"), "--max-dropout", "0.2",
                     "--curriculum", "gradual", "--exit-every", "4"]) == 0
    recipe = seen["recipe"]
    assert (recipe["max_dropout"], recipe["curriculum"], recipe["exit_every"]) == (0.2, "gradual", 4)
    assert "features_dir" not in recipe and "init_from" not in recipe
