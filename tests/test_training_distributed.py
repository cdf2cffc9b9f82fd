"""``hf-specdec train eagle3`` under ``accelerate launch`` (2 CPU processes, gloo) gives the loss curve and the
weights of one process taking the same global batch (issue 20): the same samples per optimizer step, losses
normalised over the global batch, one learning-rate schedule, logs and checkpoints written once."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_model, word_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'][0] }}:{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>a:{% endif %}")
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, cwd, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ACCELERATE_CONFIG_FILE", None)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with the gloo backend is unavailable")
def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    target = tmp_path / "target"
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    tiny_model("llama", layers=4, hidden=32).save_pretrained(target)
    tok.save_pretrained(target)
    # conversations of different lengths: the two processes' shards hold different token counts
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}abcabc" + "z" * (i % 5)},
                                                {"from": "gpt", "value": "xyzxyzxyzok" * (1 + i % 4)}]}
               for i in range(16)]
    (tmp_path / "data.json").write_text(json.dumps(records))
    # 12 conversations are kept: 3 micro-batches of 4 per epoch, 2 optimizer steps (the second one short): 4 steps
    # run over 2 epochs, with gradient accumulation, a mid-run checkpoint and the cosine schedule to 0
    common = ["train", "eagle3", "--target", str(target), "--data", str(tmp_path / "data.json"), "--samples", "16",
              "--max-length", "64", "--draft-vocab", "48", "--grad-accum", "2", "--max-steps", "4", "--lr", "1e-3",
              "--log-every", "1", "--save-every", "2"]
    started = time.perf_counter()
    _run([sys.executable, "-m", "hf_specdec.cli", *common, "--out", "one", "--batch-size", "4"], tmp_path)
    # --multi_gpu is accelerate's torchrun launcher; on a machine without GPUs the processes use CPUs and gloo
    # (--cpu alone would start a single process)
    _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
          "--dynamo_backend", "no", "--main_process_port", str(_free_port()), "-m", "hf_specdec.cli", *common,
          "--out", "two", "--batch-size", "2"], tmp_path)
    elapsed = time.perf_counter() - started

    one = [json.loads(line) for line in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    two = [json.loads(line) for line in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]  # written once, by process 0
    for a, b in zip(one, two):
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12)  # one scheduler step per optimizer step
        for key in ("loss", "loss0", "loss6", "acc0", "acc6"):  # the global-batch values
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
    assert two[-1]["loss"] < two[0]["loss"]
    from safetensors.torch import load_file

    for tag in ("checkpoint-2", "checkpoint-4"):  # the fp32 weights being trained
        ref, got = (load_file(str(tmp_path / run / tag / "model.safetensors")) for run in ("one", "two"))
        assert ref.keys() == got.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{tag} {key}: {m}")
        assert (tmp_path / "two" / tag / "done").exists()
        assert sorted(p.name for p in (tmp_path / "two" / tag).glob("random_states_*")) == [
            "random_states_0.pkl", "random_states_1.pkl"]
    final = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert final["fc.weight"].dtype == torch.float16
    print(f"1 vs 2 processes: {elapsed:.1f}s; max relative loss difference "
          f"{max(abs(b['loss'] - a['loss']) / abs(a['loss']) for a, b in zip(one, two)):.2e}")
