"""benchmarks/gpu.py (the loop at a fixed acceptance length) in its CPU form, ``--tiny``, and the replay proposer it
runs: the report's shape and the replay's exact acceptance, never a timing."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec.bench.oracle import ReplayProposer
from hf_specdec.syncs import SyncCounter

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("hf_specdec_gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(gpu):
    """The --tiny target and every drafter, float32 on the CPU."""
    model, perm = gpu.build_target(gpu.target_config(tiny=True), torch.device("cpu"), torch.float32)
    drafters = gpu.build_drafters(model, gpu.METHODS, True, torch.device("cpu"), torch.float32)
    return model, perm, drafters


def test_tiny_run_reports_every_method(gpu, tmp_path):
    assert gpu.main(["--tiny", "--max-new-tokens", "16", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert result["schema"] == "hf_specdec.gpu_bench/1" and result["config"]["greedy_is_permutation"] is True
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"stock", "stock_compiled", *gpu.METHODS} and not result["skipped"]
    for name, row in rows.items():
        assert row["identical"] is True, name  # lossless, and the replay kept to the reference
        for key in ("ms_per_step", "target_ms_per_step", "draft_ms_per_step", "host_ms_per_step", "tokens_per_s",
                    "speedup", "ideal_speedup", "efficiency", "syncs_per_step", "tau", "speedup_vs_compiled",
                    "launches_per_step", "warmup_seconds"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (name, key)
        assert row["syncs"] >= 0 and sum(row["syncs_by_name"].values()) == row["syncs"]
        assert row["graphs_recorded_timed"] == 0, name  # no CUDA here: counted, never recorded
        assert row["steps"] == len(row["verify_sizes"]) and row["cuda_syncs_per_step"] is None  # CPU
    assert rows["stock"]["tau"] == rows["stock_compiled"]["tau"] == 1.0 and rows["stock"]["ideal_speedup"] == 1.0
    assert all(row["launches_per_step"] > 0 for row in rows.values())
    assert rows["stock"]["draft_ms_per_step"] == 0.0
    # tau 3 (the --tiny default): two drafts accepted per step, but where the budget or a plain step cuts it
    for name in gpu.METHODS:
        assert 1.0 < rows[name]["tau"] <= 3.0, name
        if name not in gpu.LOOKUP:
            assert rows[name]["draft_ms_per_step"] > 0.0, name  # the real drafter ran
    assert all(rows[name]["tau"] == 3.0 for name in gpu.LOOKUP)  # the prompt held the continuation: every step
    assert all(set(map(int, rows[n]["accept_histogram"])) <= {0, 1, 2} for n in gpu.METHODS if n != "hf_assisted")
    assert set(result["cost_curve_ms"]) >= {"1"}
    table = (tmp_path / "gpu_bench.md").read_text()
    assert "| method | τ | verify size | ms/step |" in table and "| host ms/step | syncs/step |" in table
    assert "cuda syncs/step" not in table and "| hf_assisted |" in table


def test_refuses_without_cuda(gpu, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", "unused"]) == 2
    message = capsys.readouterr().err
    assert "no CUDA device" in message and "--tiny" in message


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--tau", "7", "--methods", "medusa"], "--tau 7: medusa accepts at most 5 drafts per step"),
    (["--tiny", "--methods", "eagle3,nope"], "unknown method"),
    (["--tiny", "--tau", "0"], "every value must be >= 1"),
])
def test_bad_arguments_name_the_fix(gpu, capsys, argv, message):
    with pytest.raises(SystemExit):
        gpu.parse_args(argv)
    assert message in capsys.readouterr().err


def _replayed(gpu, model, drafters, name, accept, prompt, new_tokens):
    reference = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    opts = gpu.proposer_options(name, accept + 1, None, tiny=True)
    inner = hf_specdec.build_proposer(name, model, drafter=drafters[name], **opts)
    replay = ReplayProposer(inner, reference, accept, model.config.vocab_size)
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                         custom_generate=hf_specdec.decoding_method(replay))
    return reference, out


@pytest.mark.parametrize("name", ["eagle3", "medusa", "dflash", "mtp"])
def test_replay_accepts_exactly_the_chosen_number(gpu, tiny, name):
    """Trees (EAGLE-3's dynamic one, Medusa's static one) and chains: every step that drafts accepts exactly
    ``accept`` drafts (fewer only where the length budget cuts the tree), and the output is the reference."""
    model, _, drafters = tiny
    prompt = torch.arange(5, 17)[None]
    accept = 2
    reference, out = _replayed(gpu, model, drafters, name, accept, prompt, 20)
    assert torch.equal(out.sequences, reference)
    hist = {int(k): v for k, v in out.speculative_stats["accept_histogram"].items()}
    assert max(hist) == accept and hist[accept] >= sum(hist.values()) - 2


def test_replay_rewrites_a_tree_on_the_device(gpu, tiny):
    """The rewrite keeps the tree's shape, puts the reference on one deepest path and wrong tokens on every other
    node, and reads no tensor value on the host."""
    from hf_specdec.tree import DraftTree

    model, _, _ = tiny
    reference = torch.tensor([[7, 8, 9, 10, 11, 12, 13]])
    inner = hf_specdec.build_proposer("prompt_lookup", model)
    replay = ReplayProposer(inner, reference, accept=2, vocab_size=model.config.vocab_size)

    class State:  # what replace reads: the committed length (root = token 9 at index 2) and the device
        lengths = [3]
        device = torch.device("cpu")

    replay._ref = torch.cat([reference, reference.new_zeros(1, 8)], dim=1)
    # root 0; depth 1: nodes 1, 2; node 2 has the deeper subtree (3 -> 4), node 1 a leaf; node 5 a child of 3
    tree = DraftTree.from_rows(torch.tensor([9]), [[50, 51, 52, 53, 54]], [[0, 0, 2, 3, 3]])
    with SyncCounter() as syncs:
        new = replay.replace(State, tree)
    assert syncs.count == 0
    assert torch.equal(new.parents, tree.parents) and torch.equal(new.valid, tree.valid)
    # node 2 (depth 1) -> 10, node 3 (depth 2) -> 11; node 1 wrong at depth 1, nodes 4, 5 wrong at depth 3
    assert new.tokens.tolist() == [[9, 11, 10, 11, 13, 13]]


def test_compiled_rows(gpu, tmp_path, monkeypatch):
    """--compile on: each method's row with compile=True, lossless; its target forwards are counted from the loop's
    stats (the compiled forward passes no hook), their time left in the host column. Dynamo's eager backend (the
    same graphs; inductor's code generation, seconds per verification size here, is tested in test_compile.py)."""
    from hf_specdec.compiled import CompiledRunner

    monkeypatch.setattr(CompiledRunner, "backend", "eager")
    assert gpu.rows_of(["eagle3", "hf_assisted"], "both") == ["eagle3", "eagle3+compile", "hf_assisted"]
    assert gpu.rows_of(["eagle3"], "on") == ["eagle3+compile"] and gpu.rows_of(["eagle3"], "off") == ["eagle3"]
    assert gpu.main(["--tiny", "--max-new-tokens", "16", "--compile", "on", "--methods", "prompt_lookup",
                     "--out", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "gpu_bench.json").read_text())["rows"]}
    assert set(rows) == {"stock", "stock_compiled", "prompt_lookup+compile"}
    row = rows["prompt_lookup+compile"]
    assert row["identical"] is True and row["tau"] == 3.0 and row["target_ms_per_step"] is None
    assert row["warmup_seconds"] > 0 and row["launches_per_step"] > 0


@pytest.mark.extended  # the default suite is at its 10-minute limit
def test_batches(gpu, tmp_path):
    """--batch 1,3: a row per method and size, each size over stock at that size, every row the target's greedy
    output for its batch (the replay keeps tau 3 in every row of the batch)."""
    assert gpu.main(["--tiny", "--max-new-tokens", "16", "--batch", "1,3", "--methods", "prompt_lookup",
                     "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_bench.json").read_text())["rows"]
    assert {(r["method"], r["batch"]) for r in rows} == {
        (m, b) for m in ("stock", "stock_compiled", "prompt_lookup") for b in (1, 3)}
    assert all(r["identical"] for r in rows)
    assert all(r["tau"] == 3.0 for r in rows if r["method"] == "prompt_lookup")
    assert "τ = 3, batch 3" in (tmp_path / "gpu_bench.md").read_text()
