"""Thread safety (issue 33): first use of the registry and of every lazily filled cache from many threads at once, and
generate() calls on the same model from several threads (each gets the output plain generate() gives)."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import hf_specdec
from hf_specdec import kernels, registry
from hf_specdec.hub_cache import write_cached_repo
from hf_specdec.kernels import ATTN_NAME, VerifyKernels, _LinearChoice
from hf_specdec.proposers.prompt_lookup import PromptLookupProposer
from hf_specdec.runner_choice import runner_for
from hf_specdec.runners import call_lock
from tiny import prompts, tiny_model

TESTS = os.path.dirname(os.path.abspath(__file__))
KW = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)

# Eight threads, each with its own target, start at once in a fresh process (nothing loaded, nothing measured):
# registry.get, decoding_method / the method folder, and generate(). Each output must be the target's own generate().
FRESH_PROCESS = r"""
import json, sys, threading
sys.path.insert(0, TESTS)
import torch
from eagle3_fixtures import random_weights
from tiny import prompts, tiny_model

import hf_specdec
from hf_specdec import registry
from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

torch.set_num_threads(1)  # eight threads on a few cores: no intra-op pool per thread on top
KW = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)


def eagle_drafter(target):
    weights = random_weights(target_hidden=32, draft_vocab=40, seed=0, scale=0.5)
    config = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=96, draft_vocab_size=40, num_target_layers=4)
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(weights, strict=False)
    return drafter.eval()


eagle_target = tiny_model("llama", seed=4, layers=4)
jobs = [  # (method, target, options, how it is called)
    ("prompt_lookup", tiny_model("llama", seed=0), {}, "callable"),
    ("suffix", tiny_model("qwen2", seed=1), {}, "callable"),
    ("lookahead", tiny_model("qwen3", seed=2), {}, "callable"),
    ("assisted", tiny_model("llama", seed=3), {"drafter": tiny_model("llama", seed=13)}, "callable"),
    ("eagle3", eagle_target, {"drafter": eagle_drafter(eagle_target)}, "callable"),
    ("layerskip", tiny_model("llama", seed=5, layers=4), {"exit_layer": 2}, "callable"),
    ("prompt_lookup", tiny_model("gemma3", seed=6), {}, "folder"),
    ("eagle3", eagle_target_2 := tiny_model("llama", seed=7, layers=4), {"drafter": eagle_drafter(eagle_target_2)},
     "folder"),
]
inputs = [prompts(1, length=12, seed=i) for i in range(len(jobs))]
refs = [m.generate(input_ids=ids, attention_mask=mask, **KW) for (_, m, _, _), (ids, mask) in zip(jobs, inputs)]
fresh = not registry.REGISTRY.builtin  # nothing above filled the registry: the threads see its first use
barrier = threading.Barrier(len(jobs))
results = [None] * len(jobs)


def run(i):
    method, model, opts, how = jobs[i]
    ids, mask = inputs[i]
    barrier.wait()
    try:
        registry.get(method)
        if how == "callable":
            out = model.generate(input_ids=ids, attention_mask=mask, **KW, **opts,
                                 custom_generate=hf_specdec.decoding_method(method))
        else:
            out = model.generate(input_ids=ids, attention_mask=mask, **KW, **opts, trust_remote_code=True,
                                 custom_generate=hf_specdec.custom_generate_path(method))
        results[i] = "ok" if torch.equal(out, refs[i]) else f"{method} ({how}): not the output of generate()"
    except Exception as e:  # reported to the test
        results[i] = f"{method} ({how}): {type(e).__name__}: {e}"


threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"fresh": fresh, "results": results, "package": hf_specdec.__file__}))
"""


def test_first_use_from_eight_threads_in_fresh_processes(tmp_path):
    """Races are probabilistic: two fresh processes (before the fix, two threads calling registry.get('eagle3') at
    once raised UnknownMethodError in every run)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(hf_specdec.__file__)))  # the hf_specdec under test
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for run in range(2):
        proc = subprocess.run([sys.executable, "-c", f"TESTS = {TESTS!r}\n" + FRESH_PROCESS], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["package"] == hf_specdec.__file__
        assert report["fresh"], "the registry was filled before the threads started: the test no longer sees first use"
        assert report["results"] == ["ok"] * 8, (run, report["results"])


# ------------------------------------------------------------------------------------------------- one model
def test_generate_on_the_same_model_from_three_threads():
    """Two speculative calls with different methods and prompts, and a plain generate(), on one model at once: every
    output is the one each call gives alone."""
    model, drafter = tiny_model("llama"), tiny_model("llama", seed=7)
    calls = [
        dict(custom_generate=hf_specdec.decoding_method("prompt_lookup")),
        dict(custom_generate=hf_specdec.decoding_method("assisted"), drafter=drafter),
        {},  # plain generate() while the others hold the kernels
    ]
    inputs = [prompts(b, length=12, seed=b) for b in (1, 2, 3)]
    refs = [model.generate(input_ids=ids, attention_mask=mask, **KW) for ids, mask in inputs]
    for _ in range(3):
        barrier, outs = threading.Barrier(len(calls)), [None] * len(calls)

        def run(i):
            barrier.wait()
            ids, mask = inputs[i]
            outs[i] = model.generate(input_ids=ids, attention_mask=mask, **KW, **calls[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(out is not None and torch.equal(out, ref) for out, ref in zip(outs, refs))


class _Entered(PromptLookupProposer):
    """Prompt lookup that says when a call reached the loop."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Event()

    def prepare(self, model) -> None:
        self.entered.set()
        super().prepare(model)


def test_a_second_call_on_the_same_model_waits_for_the_first():
    model = tiny_model("llama")
    ids, mask = prompts(1, length=12)
    ref = model.generate(input_ids=ids, attention_mask=mask, **KW)
    proposer, outs = _Entered(), []
    thread = threading.Thread(target=lambda: outs.append(model.generate(
        input_ids=ids, attention_mask=mask, **KW, custom_generate=hf_specdec.decoding_method(proposer))))
    with call_lock(model):  # what a running call on the model holds
        thread.start()
        assert not proposer.entered.wait(0.5)
        # re-entrant: a call in the thread that holds it (a drafter decoding with the loop itself) runs
        again = model.generate(input_ids=ids, attention_mask=mask, **KW,
                               custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    thread.join()
    assert proposer.entered.is_set() and torch.equal(outs[0], ref) and torch.equal(again, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_act_only_in_the_thread_that_installed_them(monkeypatch, dtype):
    """While a call's kernels are installed on a model (patched linear layers, the attention switched), a forward of
    that model in another thread computes exactly as without them. (Before: it took the call's products and
    attention; in bf16 the exact attention read transformers' boolean mask of a padded row as an additive one and
    raised.)"""
    model = tiny_model("llama").to(dtype)
    ids, mask = (t[1:] for t in prompts(2, length=12))  # one row with left padding: a 4D mask
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    used = {"products": [], "attention": []}
    mm_t, packed = kernels._mm_t, kernels._packed_sdpa
    monkeypatch.setattr(kernels, "_mm_t", lambda *a: used["products"].append(threading.get_ident()) or mm_t(*a))
    monkeypatch.setattr(kernels, "_packed_sdpa",
                        lambda *a, **k: used["attention"].append(threading.get_ident()) or packed(*a, **k))
    monkeypatch.setattr(_LinearChoice, "force", True)  # the kernels' product wherever they act
    other = []
    with torch.no_grad(), VerifyKernels(model) as k, k.verifying(4):
        assert model.config._attn_implementation == ATTN_NAME
        model(input_ids=ids)  # this thread: the kernels (its loop passes float tree masks, not transformers' own)
        thread = threading.Thread(target=lambda: other.append(model(input_ids=ids, attention_mask=mask).logits))
        thread.start()
        thread.join()
    me = threading.get_ident()
    assert used["products"] and set(used["products"]) == {me}
    assert used["attention"] and set(used["attention"]) == {me}
    assert torch.equal(other[0], ref)


# ---------------------------------------------------------------------------------------------- the caches
def _at_once(n, fn):
    barrier, results, errors = threading.Barrier(n), [None] * n, []

    def run(i):
        barrier.wait()
        try:
            results[i] = fn()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_one_runner_per_model_from_many_threads():
    model = tiny_model("llama")
    runners = _at_once(8, lambda: runner_for(model))
    assert all(r is runners[0] for r in runners)


def test_drafter_cache_loads_a_drafter_once_when_threads_ask_at_once():
    cache, target, loads = registry.DrafterCache(), torch.nn.Linear(1, 1), []

    def load():
        loads.append(1)
        threading.Event().wait(0.05)  # a slow load: the others arrive meanwhile
        return torch.nn.Linear(1, 1)

    drafters = _at_once(8, lambda: cache.get_or_load(("m", "src"), target, load))
    assert len(loads) == 1 and all(d is drafters[0] for d in drafters)
    assert not cache.loading


def test_hub_cache_written_from_threads_at_once(tmp_path):
    files = {"README.md": b"x" * 100_000, "custom_generate/generate.py": b"print(1)\n"}
    snapshots = _at_once(4, lambda: write_cached_repo(tmp_path, "org/name", files))
    assert len(set(snapshots)) == 1
    assert {p.relative_to(snapshots[0]).as_posix(): p.read_bytes() for p in snapshots[0].rglob("*")
            if p.is_file()} == files
    assert not [p for p in tmp_path.rglob(".*") if p.name.endswith((".tmp", ".link"))]


def test_default_model_conversion_is_published_whole(tmp_path):
    """The converted default model appears in one rename; a second converter finding a complete folder keeps it, an
    incomplete one (an interrupted older run) is replaced."""
    from hf_specdec.default_model import _publish

    def converted(name):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_text(name)
        (folder / "tokenizer.json").write_text(name)
        return folder

    folder = tmp_path / "smollm2"
    _publish(converted("first"), folder)
    _publish(second := converted("second"), folder)
    assert (folder / "model.safetensors").read_text() == "first" and second.exists()  # the caller removes it
    (folder / "tokenizer.json").unlink()
    _publish(converted("third"), folder)
    assert (folder / "model.safetensors").read_text() == "third" and (folder / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["second", "smollm2"]


@pytest.mark.parametrize("method", ["eagle3", "suffix"])
def test_registry_register_from_threads_at_once(method):
    """Registering one name from several threads: exactly one wins, the others get the 'already registered' error."""
    record = registry.get(method)
    clone = registry.Method(name=f"threads_{method}", summary=record.summary, build=record.build,
                            options=record.options, drafter=record.drafter)
    try:
        outcomes = []

        def register():
            try:
                registry.register(clone)
                outcomes.append("registered")
            except ValueError as e:
                assert "already registered" in str(e)
                outcomes.append("refused")

        _at_once(8, register)
        assert sorted(outcomes) == ["refused"] * 7 + ["registered"]
        assert registry.get(clone.name) is clone
    finally:
        registry.unregister(clone.name)
