"""Kernel launches per step (hf_specdec.launches): the count's rules, its determinism, and every method's count.

Counts are properties of the code path, never of timing: a call counted twice gives the same figures. Issue 51's
bound, at most 40 launches per target forward under ``compile=True``, is held here for two methods whose compilation
is quick on a CPU, and for every method at batch 1 and 8 with ``pytest --extended``; ``python tests/test_launches.py``
prints every method's figures, eager and compiled.
"""

import pytest
import torch

import hf_specdec
from hf_specdec.compiled import CompiledRunner
from hf_specdec.launches import DYNAMIC, LaunchCounter, step_range
from test_syncs import METHODS, NEW, _inputs, _target, method


def test_views_and_allocations_start_no_kernel_and_a_compiled_region_counts_one():
    x, w = torch.randn(4, 6), torch.ones(5, 6)
    region = torch.compile(lambda t: (t * 2 + 1).sin().sum(), backend="eager")
    region(x)  # compiled before counting
    with LaunchCounter() as launches:
        x.add(1)  # outside the steps: counted apart
        with step_range():
            torch.empty(3).fill_(1.0)  # an allocation (none), a fill (one)
            torch.nn.functional.linear(x, w)  # linear = t (a view) + matmul = mm: one
            x[:, 1:].transpose(0, 1).contiguous()  # views, then one copy
        with step_range():
            region(x)  # one, whatever runs inside
            with step_range(DYNAMIC + "f"):  # one more, a region compiled with dynamic shapes (counted apart too)
                region(x)
    assert launches.steps == 2
    assert dict(launches.by_name) == {"aten::fill_": 1, "aten::mm": 1, "aten::copy_": 1, "compiled region": 2}
    assert launches.launches == 5 and launches.per_step() == 2.5
    assert launches.outside == 1 and dict(launches.dynamic) == {"f": 1}


def test_step_range_costs_nothing_without_a_profiler():
    assert type(step_range()).__name__ == "nullcontext"


def count(name: str, bsz: int = 1, compile: bool = False, calls: int = 1,
          sample: bool = False) -> tuple[list[LaunchCounter], dict]:
    """The launches of ``calls`` successive greedy calls of ``name`` on a fresh target (after a first call measured
    the runner's costs), and the last call's stats. Later calls on one target may count a little less: the CPU
    kernels check a product on its first uses before they trust it. ``sample``: coupled sampling with warpers and a
    fixed seed (every call takes the first one's paths), its text the ``plain`` method's."""
    model = _target()
    ids, mask = _inputs(bsz)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
              return_dict_in_generate=True, custom_generate=method(name, model))
    if sample:
        kw.update(do_sample=True, temperature=0.8, top_k=20, seed=3)
    if compile:
        kw["compile"] = True
    model.generate(**kw)  # warm-up: calibration, first-use imports (and compilation)
    counters = []
    for _ in range(calls):
        with LaunchCounter() as launches:
            out = model.generate(**kw)
        counters.append(launches)
    if sample:
        plain = model.generate(**{**kw, "custom_generate": hf_specdec.decoding_method("plain"), "compile": False})
        assert out.speculative_stats["sampling"] == "coupled" and torch.equal(out.sequences, plain.sequences)
    else:
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=None)
        assert torch.equal(out.sequences, plain), f"{name} (compile={compile}) differs from plain greedy"
    return counters, out.speculative_stats


@pytest.mark.parametrize("name", ["prompt_lookup", "hybrid", "suffix"])
def test_a_call_counts_one_range_per_verification_and_the_same_every_time(name, steady_clock):
    """Under a clock that reads the same every run (hybrid drafting and the draft lengths follow measured times), a
    call on a fresh target counts the same every time (after the first in the process, which may fill a module's
    caches)."""
    count(name)
    (first,), stats = count(name)
    (again,), _ = count(name)
    assert first.steps == stats["target_forward_passes"] - 1  # every step after the prefill
    assert first.launches > 0 and first.outside > 0  # the prefill and the call's set-up lie outside the steps
    assert (again.steps, again.launches, again.by_name) == (first.steps, first.launches, first.by_name)


@pytest.fixture()
def eager_backend(monkeypatch):
    monkeypatch.setattr(CompiledRunner, "backend", "eager")


# under compile=True the step's parts run as fixed-shape regions (a CUDA graph each on a GPU); the dynamic regions a
# compiled step may still run: a draft model's feed of more rows than the feeds' buckets (the prompt's) and coupled
# sampling's uniforms (one elementwise kernel over the step's new positions: docs/gpu.md)
DYNAMIC_LEFT = {"_fixed_feed_inputs", "uniforms_of"}


def _at_most_40(name, bsz, sample=False):
    (eager,), _ = count(name, bsz, sample=sample)
    (compiled,), _ = count(name, bsz, compile=True, sample=sample)
    assert compiled.by_name["compiled region"] >= 4 * compiled.steps  # verify, mask, rule, commit (+ drafting)
    assert compiled.per_step() <= 40, compiled.by_name.most_common(8)
    assert compiled.per_step() < eager.per_step() / 2
    assert set(compiled.dynamic) <= DYNAMIC_LEFT, compiled.dynamic


@pytest.mark.parametrize("name,bsz", [("prompt_lookup", 1)])
def test_compiled_steps_launch_at_most_40(name, bsz, eager_backend):
    """compile=True (dynamo's graphs, counted as inductor's would be): the verification forward, the drafters'
    proposal, the tree's mask, the greedy rule and the cache commit are compiled regions of one launch each, at fixed
    shapes (no dynamic region but :data:`DYNAMIC_LEFT`: on a GPU a dynamic region launches each of its kernels); the
    step launches at most 40 (issue 51's bound), far fewer than eagerly, and decodes as plain greedy does. Every method
    at batch 1 and a padded batch of 8 (LayerSkip's resumed verification among them) under ``--extended``."""
    _at_most_40(name, bsz)


@pytest.mark.extended
@pytest.mark.parametrize("bsz", [1, 8])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_compiled_launches_at_most_40(name, bsz, eager_backend):
    """Every method at batch 1 and a padded batch of 8 (``pytest --extended``: several minutes of compilation)."""
    _at_most_40(name, bsz)


@pytest.mark.extended
@pytest.mark.parametrize("bsz", [1, 8])
@pytest.mark.parametrize("name", ["prompt_lookup", "eagle3", "mtp", "layerskip"])
def test_coupled_sampling_compiled_launches_at_most_40(name, bsz, eager_backend):
    """Coupled sampling under compile=True: its rule (verify.coupled_rule, walked to a power-of-2 depth) and its
    noise's uniforms (coupling.uniforms_of) compiled regions too; the text the plain method's for the seed."""
    _at_most_40(name, bsz, sample=True)


if __name__ == "__main__":  # the figures: python tests/test_launches.py
    for bsz in (1, 8):
        for name in METHODS:
            for compiled in (False, True):
                (launches,), _ = count(name, bsz, compile=compiled)
                dynamic = sum(launches.dynamic.values()) / max(launches.steps, 1)
                print(f"batch {bsz} {name:14s} {'compiled' if compiled else 'eager':8s} {launches.per_step():7.1f} "
                      f"launches/step, {dynamic:4.2f} dynamic regions ({launches.steps} steps; most: "
                      f"{launches.by_name.most_common(3)}; dynamic: {dict(launches.dynamic)})")
