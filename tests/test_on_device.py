"""Every method on every attention backend, batch 1 and a padded batch of 3: greedy output identical to the target's
own ``generate(do_sample=False)`` with the same backend (fp32), and no crash in half precision.

On the CPU this runs eager attention (sdpa is what every other test runs; flex_attention is tested on the CPU for five
methods in tests/test_attention_backends.py: torch 2.13's inductor fails to compile some CPU flex kernels these trees
need). ``pytest --device cuda`` runs the same tests on a
GPU with the tiny models there (docs/gpu.md), flex at both batch sizes, and the half-precision runs (bf16 on sdpa,
eager and flex at batch 1 and 3: they must finish and give as many tokens as plain decoding; bit-identity is not
claimed in half precision). The drafters are tests/test_syncs.py's: tiny and random, so they draft and are mostly
rejected, which is the hard case for the loop's cache and masks.
"""

import pytest
import torch

import tiny
from test_syncs import METHODS, _inputs, _target, method

pytestmark = pytest.mark.device

NEW = 20
BACKENDS = ["sdpa", "eager", "flex_attention"]
_TARGETS = {}


def _target_with(backend: str, dtype=torch.float32):
    key = (backend, dtype)
    if key not in _TARGETS:
        target = _target().to(dtype)
        target.set_attn_implementation(backend)
        _TARGETS[key] = target
    return _TARGETS[key]


def _skip_on_the_cpu(backend: str, bsz: int):
    if tiny.DEVICE.type != "cpu":
        return
    if backend == "sdpa":
        pytest.skip("sdpa on the CPU: every other test of the suite (tests/test_syncs.py holds these methods)")
    if backend == "flex_attention":  # tests/test_attention_backends.py runs flex on the CPU for five methods
        pytest.skip("torch 2.13's inductor fails to compile some of the CPU flex_attention kernels these trees need "
                    "(a C++ compile error, in plain decoding's shapes too for padded batches)")


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_on_every_backend_is_lossless(name, backend, bsz):
    _skip_on_the_cpu(backend, bsz)
    target = _target_with(backend)
    ids, mask = _inputs(bsz)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    ref = target.generate(**kw)
    out = target.generate(**kw, custom_generate=method(name, target), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref), (name, backend, bsz)
    assert out.speculative_stats["target_forward_passes"] <= NEW


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_in_bf16_on_the_device(name, backend, bsz):
    """Issue 51: LayerSkip in bf16 on an H200 died in cuDNN's attention (misaligned address). Every method, bf16,
    every backend: the call finishes with as many tokens as plain decoding."""
    if tiny.DEVICE.type == "cpu":
        pytest.skip("half precision on the CPU: tests/test_dtypes.py; this runs under pytest --device cuda")
    target = _target_with(backend, torch.bfloat16)
    ids, mask = _inputs(bsz)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    ref = target.generate(**kw)
    drafters = method(name, target)
    out = target.generate(**kw, custom_generate=drafters)
    assert out.shape == ref.shape
