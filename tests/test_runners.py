"""One seam for running the target: the loop reaches the model only through a TargetSession."""

import functools
import inspect

import torch

import hf_specdec
from hf_specdec import engine, kernels, runners
from hf_specdec.runner_choice import runner_for
from hf_specdec.runners import TargetRunner, TargetSession
from oracles import OracleChain, OracleTree
from tiny import prompts, tiny_model

GEN = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)


class CountingSession(TargetSession):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"enter": 0, "exit": 0, "prefill": 0, "verify": 0, "drafting": 0}

    def __enter__(self):
        self.calls["enter"] += 1
        return self

    def __exit__(self, *exc):
        self.calls["exit"] += 1

    def prefill(self, *args):
        self.calls["prefill"] += 1
        return super().prefill(*args)

    def verify(self, state, tree):
        self.calls["verify"] += 1
        return super().verify(state, tree)

    def drafting(self):
        self.calls["drafting"] += 1
        return super().drafting()


class CountingRunner(TargetRunner):
    session_class = CountingSession
    name = "counting"

    def session(self, *args, **kwargs):
        self.last = super().session(*args, **kwargs)
        return self.last


def test_the_loop_runs_the_target_through_the_session():
    model = tiny_model("llama")
    ids, mask = prompts(2, 12)
    ref = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    runner = CountingRunner(model)
    decode = functools.partial(engine.speculative_decode, proposer=OracleChain(ref, k=3), runner=runner)
    out = model.generate(input_ids=ids, attention_mask=mask, **GEN, custom_generate=decode,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    calls = runner.last.calls
    steps = out.speculative_stats["target_forward_passes"] - 1
    assert calls["enter"] == calls["exit"] == calls["prefill"] == 1
    assert calls["verify"] == steps and calls["drafting"] == steps
    assert runner.costs and all(isinstance(k, tuple) for k in runner.costs)  # measured costs live on the runner


def test_the_engine_knows_no_backend():
    source = inspect.getsource(engine).lower()
    assert "kernel" not in source and "environ" not in source


def test_runner_choice_at_the_entry_point(monkeypatch):
    model = tiny_model("llama")
    assert isinstance(runner_for(model), kernels.CpuKernelRunner)
    assert runner_for(model) is runner_for(model)  # kept across calls: its timing cache and measured costs
    kept = runner_for(model)
    runners.PER_MODEL.forget(model)  # what was measured dropped: the next call starts from nothing
    assert runner_for(model) is not kept and runner_for(model) is runner_for(model)
    assert type(runner_for(model, kernels=False)) is TargetRunner
    monkeypatch.setenv(runners.KERNELS_ENV, "0")
    assert type(runner_for(model)) is TargetRunner
    ids, mask = prompts(3, 12, seed=4)
    ref = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    out = model.generate(input_ids=ids, attention_mask=mask, **GEN,
                         custom_generate=hf_specdec.decoding_method(OracleTree(ref)))
    assert torch.equal(out, ref)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_model_is_freed_with_its_kept_runners():
    """The runners kept per model hold it weakly: a model a call ran is freed when its user drops it (a kept runner
    holding it strongly kept every model ever run alive, a notebook's reloaded models on the GPU included)."""
    import gc
    import weakref

    model = tiny_model("llama")
    ids, mask = prompts(1, 8, seed=1)
    model.generate(input_ids=ids, attention_mask=mask, **GEN, custom_generate=hf_specdec.decoding_method("plain"))
    assert runner_for(model).model is model
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_each_cpu_kernel_runner_keeps_its_own_timing_cache():
    a, b = tiny_model("llama"), tiny_model("llama", seed=2)
    ra, rb = runner_for(a), runner_for(b)
    assert ra.choice is not rb.choice
    ids, mask = prompts(1, 12)
    ref = a.generate(ids, **GEN)
    out = a.generate(ids, **GEN, custom_generate=hf_specdec.decoding_method(OracleChain(ref, k=3)))
    assert torch.equal(out, ref)
    assert ra.choice.times and not rb.choice.times
    assert ra.cost_prior is not runner_for(a, kernels=False).cost_prior
