"""The benchmark harness end to end on a tiny model (correctness of the report, not speed)."""

import json

import pytest
import torch

from hf_specdec.bench import batch_markdown, batch_sweep, build_methods, fp32_baseline, markdown, run_bench
from hf_specdec.bench import data
from hf_specdec.bench.data import DATASETS, DEFAULT_DATASETS, load
from tiny import one_thread, tiny_model, word_tokenizer


def _chat_tokenizer(width: int = 30):
    tok = word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'][:" + str(width) + "] }}{% endfor %}"
    return tok


def test_datasets_load_offline():
    for ds in DATASETS:
        if ds == "summaries" and not data.lee_articles():
            continue  # needs gensim: test_summaries_set covers it
        prompts = load(ds, limit=3)
        assert len(prompts) == 3 and all(p.text for p in prompts)
    assert len(load("mtbench")) == 80 and len(load("humaneval")) == 164
    copy = load("copy", limit=4)
    assert any("Rename the variable" in p.text for p in copy)
    assert set(DEFAULT_DATASETS) < set(DATASETS) and "summaries" not in DEFAULT_DATASETS


def test_demo_set_starts_with_the_quick_demos_prompts():
    from hf_specdec.demo import QUICK_PROMPTS, demo_prompts

    prompts = load("demo")
    assert [p.text for p in prompts[:2]] == [demo_prompts()[i][1] for i in QUICK_PROMPTS]
    assert prompts[0].id == "copy1" and len(prompts) == len(demo_prompts())
    assert "replacing 'Sunday' with 'Saturday'" in load("demo", limit=1)[0].text


def test_summaries_set(monkeypatch):
    """Long summarisation prompts: whole articles, each used once, about SUMMARY_CHARS characters, the instruction
    last; a seeded draw; a clear error without gensim."""
    articles = [f"Article {i}: " + "word " * (200 + 10 * i) for i in range(60)]
    monkeypatch.setattr(data, "lee_articles", lambda: list(articles))
    prompts = load("summaries")
    assert 3 <= len(prompts) <= 10 and len({p.id for p in prompts}) == len(prompts)
    used = []
    for p in prompts:
        body, _, instruction = p.text.rpartition("\n\n")
        assert instruction == data.SUMMARY_INSTRUCTION == "Summarise the text above."
        assert data.SUMMARY_CHARS <= len(body) < data.SUMMARY_CHARS + 2 * max(map(len, articles))
        parts = body.split("\n\n")
        assert all(part in articles for part in parts)
        used += parts
    assert len(used) == len(set(used))  # no article twice
    assert [p.text for p in load("summaries", limit=2)] == [p.text for p in prompts[:2]]
    assert load("summaries", seed=1)[0].text != prompts[0].text
    monkeypatch.setattr(data, "lee_articles", lambda: [])
    with pytest.raises(RuntimeError, match="gensim"):
        load("summaries")


def test_unknown_method_or_missing_drafter():
    with pytest.raises(ValueError, match="Unknown benchmark method"):
        build_methods(["nope"])
    with pytest.raises(ValueError, match="--drafter"):
        build_methods(["assisted"])


def test_bench_end_to_end(tmp_path):
    model = tiny_model("llama", vocab=96)
    tok = _chat_tokenizer(40)
    drafter = tiny_model("llama", seed=4)
    methods = build_methods(["prompt_lookup", "hf_prompt_lookup:3", "oracle:2", "assisted", "hf_assisted"], drafter)
    result = run_bench(model, tok, methods, ["gsm8k", "copy"], limit=1, max_new_tokens=8, batch_size=1,
                       drafter=drafter, out=str(tmp_path), memory_check=2, progress=False)
    assert result["schema"] == "hf_specdec.bench/1"
    names = {r["method"] for r in result["summary"]}
    assert names == {"plain", "prompt_lookup", "hf_prompt_lookup:3", "oracle:2", "assisted", "hf_assisted"}
    assert all(r["mismatches"] == 0 for r in result["summary"])
    oracle = [r for r in result["summary"] if r["method"] == "oracle:2"]
    assert all(r["tau"] > 2 for r in oracle)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["summary"] and saved["runs"] and saved["cost_curve_ms"]
    assert "| gsm8k | prompt_lookup |" in markdown(result)
    assert set(result["memory_check"]) == names
    # per-step overheads: host reads per step (one counted call per method and dataset) and host time per step
    assert set(result["syncs"]) == {"gsm8k", "copy"} and set(result["syncs"]["gsm8k"]) == names
    for counts in result["syncs"]["gsm8k"].values():
        assert counts["count"] >= 0 and counts["steps"] >= 1 and counts["per_step"] == counts["count"] / counts["steps"]
        assert sum(counts["by_name"].values()) == counts["count"]
    assert result["syncs"]["gsm8k"]["oracle:2"]["steps"] < result["syncs"]["gsm8k"]["plain"]["steps"]
    for row in result["summary"]:
        assert row["syncs_per_step"] == result["syncs"][row["dataset"]][row["method"]]["per_step"]
        assert row["host_ms_per_step"] is not None
    assert all(r["steps"] == r["target_forwards"] - 1 and r["host_ms_per_step"] is not None for r in result["runs"])
    table = markdown(result)
    assert "| host ms/step | syncs/step |" in table
    with open(tmp_path / "bench.csv") as f:
        header = f.readline().strip().split(",")
    assert {"host_ms_per_step", "syncs_per_step"} <= set(header)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "speedup.png").is_file() and (tmp_path / "forward_cost.png").is_file()


def test_batch_sweep(tmp_path):
    """The batched-throughput sweep: one run per batch size on the same prompts, tokens/s against plain batched
    generate() at each size, every output compared with it."""
    model = tiny_model("llama", vocab=96)
    tok = _chat_tokenizer(40)
    tok.padding_side = "left"
    methods = build_methods(["plain_kernels", "prompt_lookup", "suffix"])
    sweep = batch_sweep(model, tok, methods, ["copy"], [2, 1], limit=2, max_new_tokens=6, out=str(tmp_path),
                        progress=False, rounds=2)
    assert sweep["batch_sizes"] == [1, 2]
    rows = {(r["method"], r["batch"]): r for r in sweep["summary"]}
    assert set(rows) == {(m, b) for m in ("plain", "plain_kernels", "prompt_lookup", "suffix") for b in (1, 2)}
    assert all(r["mismatches"] == 0 and r["tokens_per_s"] > 0 for r in rows.values())
    assert all(rows[("plain", b)]["vs_plain"] == 1.0 and "vs_kernels" in rows[("suffix", b)] for b in (1, 2))
    # two rounds: max(2, 2 * B) prompts, so two batches per size, each method's ratio paired with plain's per batch
    assert all(rows[("suffix", b)]["batches"] == 2 and rows[("plain", b)]["vs_plain_median"] == 1.0 for b in (1, 2))
    table = batch_markdown(sweep)
    assert "B=2 tok/s (× plain)" in table and "| suffix |" in table and "lowest median × plain" in table
    assert json.loads((tmp_path / "batch.json").read_text())["batch_sizes"] == [1, 2]
    assert (tmp_path / "batch.md").is_file() and (tmp_path / "batch2" / "bench.json").is_file()


def test_bench_eagle3_methods():
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

    model = tiny_model("llama", layers=4)
    tok = _chat_tokenizer()
    drafter = Eagle3Drafter(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=96, num_target_layers=4)).eval()
    methods = build_methods(["eagle3:3-2-6", "eagle3_chain:2"], eagle3=drafter)
    result = run_bench(model, tok, methods, ["gsm8k"], limit=2, max_new_tokens=6, progress=False)
    assert {r["method"] for r in result["summary"]} == {"plain", "eagle3:3-2-6", "eagle3_chain:2"}
    assert all(r["mismatches"] == 0 for r in result["summary"])
    with pytest.raises(ValueError, match="--eagle3"):
        build_methods(["eagle3"])


def test_bench_dflash_methods():
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter

    model = tiny_model("llama", layers=4)
    tok = _chat_tokenizer()
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96,
                                         block_size=4, mask_token_id=95, target_layer_ids=[0, 2],
                                         num_target_layers=4)).eval()
    methods = build_methods(["dflash", "dflash_fixed:3"], dflash=drafter)
    result = run_bench(model, tok, methods, ["gsm8k"], limit=2, max_new_tokens=6, progress=False)
    assert {r["method"] for r in result["summary"]} == {"plain", "dflash", "dflash_fixed:3"}
    assert all(r["mismatches"] == 0 for r in result["summary"])
    with pytest.raises(ValueError, match="--dflash"):
        build_methods(["dflash"])


def test_bench_batched(tmp_path):
    model = tiny_model("qwen2")
    tok = _chat_tokenizer()
    methods = build_methods(["prompt_lookup", "oracle:3"])
    result = run_bench(model, tok, methods, ["mtbench"], limit=4, max_new_tokens=6, batch_size=2, progress=False)
    assert all(r["mismatches"] == 0 for r in result["summary"])
    assert {r["prompts"] for r in result["summary"]} == {2}


def test_bench_kernel_matched_baseline():
    """'plain_kernels' is plain greedy decoding with the loop's CPU kernel trick: same tokens as plain decoding, its
    patch undone after every call, and every method gets its speedup over it in the same run."""
    model = tiny_model("llama")
    tok = _chat_tokenizer()
    methods = build_methods(["plain_kernels", "prompt_lookup"])
    result = run_bench(model, tok, methods, ["gsm8k"], limit=2, max_new_tokens=6, progress=False)
    rows = {r["method"]: r for r in result["summary"]}
    assert set(rows) == {"plain", "plain_kernels", "prompt_lookup"}
    assert all(r["mismatches"] == 0 for r in rows.values())
    assert all(r["speedup_vs_kernels"] > 0 for r in rows.values())
    assert "vs plain_kernels" in markdown(result) and "| gsm8k | prompt_lookup |" in markdown(result)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_unknown_method_lists_the_methods_and_baselines():
    from hf_specdec.registry import UnknownMethodError

    with pytest.raises(UnknownMethodError, match="Unknown benchmark method 'nope:3'.*eagle3_chain.*plain_kernels, "
                                                 "oracle:K, hf_prompt_lookup:K, hf_assisted"):
        build_methods(["prompt_lookup", "nope:3"])
    with pytest.raises(ValueError, match="background_load must be one of off, on, both"):
        run_bench(tiny_model("llama"), _chat_tokenizer(), [], ["gsm8k"], limit=1, max_new_tokens=2,
                  progress=False, background_load="sometimes")


def _gone(pid: int) -> bool:
    import multiprocessing
    import os

    from hf_specdec.bench.load import PROCESS_NAME

    alive = [p for p in multiprocessing.active_children() if p.name == PROCESS_NAME]
    return not alive and not os.path.exists(f"/proc/{pid}")


def test_background_load_stops_on_an_error():
    from hf_specdec.bench.load import background_load

    with pytest.raises(KeyboardInterrupt):
        with background_load() as procs:
            assert len(procs) == 1 and procs[0].is_alive() and procs[0].daemon
            raise KeyboardInterrupt
    assert not procs[0].is_alive() and _gone(procs[0].pid)


def test_bench_with_and_without_background_load(tmp_path):
    """background_load="both": every prompt runs quiet and loaded; the report has both sets of figures side by side
    and the load process is gone afterwards (nothing is timed here)."""
    import csv

    model = tiny_model("llama")
    tok = _chat_tokenizer()
    methods = build_methods(["plain_kernels", "prompt_lookup"])
    result = run_bench(model, tok, methods, ["gsm8k"], limit=2, max_new_tokens=6, out=str(tmp_path), progress=False,
                       background_load="both")
    assert result["background_load"]["mode"] == "both" and result["background_load"]["pids"]
    assert all(_gone(pid) for pid in result["background_load"]["pids"])
    assert sorted(r["loaded"] for r in result["runs"]) == [False] * 6 + [True] * 6
    assert all(r["identical"] for r in result["runs"])
    rows = {r["method"]: r for r in result["summary"]}
    assert set(rows) == {"plain", "plain_kernels", "prompt_lookup"}
    lookup = rows["prompt_lookup"]
    for key in ("tau", "proposed_drafts", "speedup_median", "speedup_vs_kernels", "mismatches"):
        assert lookup[key] is not None and lookup[f"{key}_loaded"] is not None
    assert lookup["proposed_drafts"] >= lookup["accepted_drafts"] >= 0 and lookup["mismatches_loaded"] == 0
    assert rows["plain"]["proposed_drafts"] is None  # no speculative_stats
    table = markdown(result)
    for header in ("| τ | τ loaded |", "| proposed drafts | proposed drafts loaded |", "| speedup loaded |",
                   "| vs plain_kernels loaded |", "Background load:"):
        assert header in table
    with open(tmp_path / "bench.csv") as f:
        saved = list(csv.DictReader(f))
    assert {"tau", "tau_loaded", "speedup_median", "speedup_median_loaded", "proposed_drafts",
            "proposed_drafts_loaded"} <= set(saved[0])
    assert [r["method"] for r in saved] == [r["method"] for r in result["summary"]]


def test_bench_under_background_load_only():
    model = tiny_model("llama")
    methods = build_methods(["prompt_lookup"])
    result = run_bench(model, _chat_tokenizer(), methods, ["gsm8k"], limit=1, max_new_tokens=4, progress=False,
                       background_load="on")
    assert len(result["background_load"]["pids"]) == 1 and _gone(result["background_load"]["pids"][0])
    assert all(r["loaded"] for r in result["runs"])
    assert not any(k.endswith("_loaded") for r in result["summary"] for k in r)  # one condition: the usual keys


def test_bench_without_sync_counting():
    result = run_bench(tiny_model("llama"), _chat_tokenizer(), build_methods(["prompt_lookup"]), ["gsm8k"], limit=1,
                       max_new_tokens=4, progress=False, count_syncs=False)
    assert result["syncs"] == {} and all(r["syncs_per_step"] is None for r in result["summary"])
    assert "| – |" in markdown(result)


def test_bench_repeats_each_prompt():
    """repeats=N: each prompt timed in N rounds (every method and the baseline in each), the summary over all of
    them (the CLI's --repeats: test_cli_bench_in_bfloat16)."""
    methods = build_methods(["plain_kernels", "prompt_lookup"])
    result = run_bench(tiny_model("llama"), _chat_tokenizer(), methods, ["gsm8k"], limit=2, max_new_tokens=4,
                       progress=False, count_syncs=False, repeats=3)
    for name in ("plain", "plain_kernels", "prompt_lookup"):
        mine = [(r["prompt_id"], r["repeat"]) for r in result["runs"] if r["method"] == name]
        assert sorted(mine) == sorted((p.id, k) for p in load("gsm8k", 2) for k in range(3))
    assert all(r["prompts"] == 6 and r["mismatches"] == 0 for r in result["summary"])
    with pytest.raises(ValueError, match="repeats"):
        run_bench(tiny_model("llama"), _chat_tokenizer(), methods, ["gsm8k"], limit=1, max_new_tokens=4,
                  progress=False, repeats=0)


def test_bench_layerskip_and_transformers_early_exit():
    """``layerskip[:E]`` next to transformers' ``assistant_early_exit`` (``hf_early_exit:E``): both lossless, and a
    target forward is counted where the last layer runs (LayerSkip verifies without the model's ``forward``; the early
    exit's drafts run only the first layers, which is no target forward)."""
    model = tiny_model("llama", vocab=96, layers=4)
    tok = _chat_tokenizer(40)
    methods = build_methods(["layerskip:2", "layerskip:2:num_speculative_tokens=3", "hf_early_exit:2"])
    assert methods[2].kwargs == {"assistant_early_exit": 2}
    result = run_bench(model, tok, methods, ["gsm8k"], limit=1, max_new_tokens=12, batch_size=1, progress=False)
    assert all(r["mismatches"] == 0 for r in result["summary"])
    runs = {r["method"]: r for r in result["runs"]}
    fixed = runs["layerskip:2:num_speculative_tokens=3"]
    # (the warm-up call already timed the forward sizes: no calibration forwards in the measured call)
    assert fixed["target_forwards"] == fixed["stats"]["target_forward_passes"]
    assert fixed["tau"] is not None and 1.0 <= fixed["tau"] <= 4.0
    assert runs["hf_early_exit:2"]["target_forwards"] < 12  # drafting forwards of the first layers not counted


@pytest.fixture()
def single_thread():
    with one_thread():  # bf16 at tiny shapes: no waiting on a thread pool (tiny.one_thread)
        yield


def test_bench_in_bfloat16_against_float32(tmp_path, single_thread):
    """A bf16 target: stock generate() on the same target in float32 runs as 'plain_fp32' on every prompt, every
    method gets its speedup over it and its match rate against plain generate() in bf16, and transformers' assisted
    mode needs its draft model in the target's dtype."""
    model32 = tiny_model("llama")
    model = tiny_model("llama").to(torch.bfloat16)
    drafter = tiny_model("llama", seed=4).to(torch.bfloat16)
    tok = _chat_tokenizer(40)
    methods = build_methods(["prompt_lookup", "hf_prompt_lookup:3", "hf_assisted"], drafter) + [fp32_baseline(model32)]
    result = run_bench(model, tok, methods, ["gsm8k"], limit=2, max_new_tokens=6, drafter=drafter, out=str(tmp_path),
                       progress=False, curve_sizes=[1, 2])
    rows = {r["method"]: r for r in result["summary"]}
    assert set(rows) == {"plain", "prompt_lookup", "hf_prompt_lookup:3", "hf_assisted", "plain_fp32"}
    assert all(r["speedup_vs_fp32"] > 0 and 0.0 <= r["match_rate"] <= 1.0 for r in rows.values())
    assert rows["plain_fp32"]["speedup_vs_fp32"] == 1.0 and rows["plain"]["match_rate"] == 1.0
    assert rows["plain_fp32"]["tau"] is None and rows["plain_fp32"]["efficiency"] is None  # not probed
    assert {(r["method"], r["dtype"]) for r in result["runs"]} == {
        (m, "float32" if m == "plain_fp32" else "bfloat16") for m in rows}
    order = [r["method"] for r in result["runs"]]  # the baseline first, then the methods in rotating order
    assert order[1:5] != order[6:10] and sorted(order[1:5]) == sorted(order[6:10])
    table = markdown(result)
    assert "| vs fp32 stock (median) |" in table and "| match |" in table and "Half precision:" in table
    assert json.loads((tmp_path / "bench.json").read_text())["summary"][0]["match_rate"] is not None
    with pytest.raises(ValueError, match="hf_assisted: the draft model is torch.float32, the target torch.bfloat16"):
        run_bench(model, tok, build_methods(["hf_assisted"], tiny_model("llama", seed=4)), ["gsm8k"], limit=1,
                  max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="plain_fp32 runs a float32 model"):
        fp32_baseline(model)


def test_cli_bench_in_bfloat16(tmp_path, monkeypatch, single_thread):
    """``hf-specdec bench --dtype bfloat16``: the target loads in bf16 and again in float32 for 'plain_fp32', the
    JSON records the dtype, and a mismatch in half precision is a match rate, not exit status 1."""
    from hf_specdec import bench, cli, dtypes

    monkeypatch.setattr(dtypes, "cpu_supports", lambda dtype: True)  # any CPU: the fallback is tested elsewhere
    tiny_model("llama").save_pretrained(tmp_path / "m")
    _chat_tokenizer(40).save_pretrained(tmp_path / "m")
    monkeypatch.setattr(bench, "mismatches", lambda result: 1)
    out = tmp_path / "out"
    assert cli.main(["bench", "--target", str(tmp_path / "m"), "--dtype", "bfloat16", "--methods", "prompt_lookup",
                     "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "4", "--out", str(out),
                     "--repeats", "2"]) == 0
    saved = json.loads((out / "bench.json").read_text())
    assert saved["config"]["dtype"] == "bfloat16" and saved["machine"]["torch"] == torch.__version__
    assert sorted(r["repeat"] for r in saved["runs"] if r["method"] == "prompt_lookup") == [0, 1]
    assert {r["method"] for r in saved["summary"]} == {"plain", "prompt_lookup", "plain_fp32"}
    assert all("speedup_vs_fp32" in r and "match_rate" in r for r in saved["summary"])
    assert "vs fp32 stock" in (out / "bench.md").read_text()


def test_rounding_key_runs_a_method_with_that_half_precision_rounding():
    """``NAME:rounding=fast|auto|exact`` (``exact=0`` / ``exact=1``: older names) is the method's ``rounding`` option;
    a bad value names the choices."""
    methods = build_methods(["prompt_lookup:exact=0", "prompt_lookup:rounding=exact", "prompt_lookup"])
    assert [m.name for m in methods] == ["prompt_lookup:exact=0", "prompt_lookup:rounding=exact", "prompt_lookup"]
    assert [m.kwargs["custom_generate"].defaults.get("rounding") for m in methods] == ["fast", "exact", None]
    with pytest.raises(ValueError, match="rounding must be 'auto' or 'exact' or 'fast'"):
        build_methods(["prompt_lookup:rounding=slow"])