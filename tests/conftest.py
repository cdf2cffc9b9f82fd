import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """A private Hub cache, offline: tests write synthetic published checkpoints into it."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture()
def hub_upload(monkeypatch):
    """``push_to_hub`` without a network: the repository creation and the upload are intercepted; the returned dict
    gets the ``repo`` id and the ``files`` that would have been uploaded (what ``save_pretrained`` wrote)."""
    import types
    from pathlib import Path

    from transformers.utils.hub import PushToHubMixin

    uploaded = {}

    def fake_upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        uploaded["repo"] = repo_id
        uploaded["files"] = sorted(p.name for p in Path(working_dir).iterdir())
        return "https://huggingface.co/fake/commit"

    monkeypatch.setattr("huggingface_hub.HfApi.create_repo",
                        lambda self, repo_id, **k: types.SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(PushToHubMixin, "_upload_modified_files", fake_upload)
    return uploaded


@pytest.fixture(autouse=True)
def _gate_open(request, monkeypatch):
    """Tiny random drafters never pay for their drafts, so the speculation gate (hf_specdec.costs.SpeculationGate)
    would turn a batch's speculation off after a few steps; the proposers' tests need it on. Tests marked
    ``gated`` run with the real gate."""
    if "gated" not in request.keywords:
        from hf_specdec.costs import SpeculationGate

        monkeypatch.setattr(SpeculationGate, "THRESHOLD", 0.0)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", metavar="DEVICE",
                     help="run the losslessness tests (marked 'device': every method at batch 1 and a padded batch, "
                          "every attention backend, coupled sampling, compile) with the tiny models on DEVICE (e.g. "
                          "cuda); the other tests are skipped then (docs/gpu.md)")
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked 'extended' (long: every method compiled, batch 1 and 8; "
                          "docs/development.md)")
    parser.addoption("--jittered-clock", type=int, nargs="?", const=1, default=None, metavar="SEED",
                     help="time.perf_counter jumps ahead at random (up to 50 ms a read), as on a very busy machine: "
                          "a test that passes only with fair timings depends on timing (none may)")


@pytest.fixture(autouse=True)
def _jittered_clock(request, monkeypatch):
    """With ``--jittered-clock``: every read of ``time.perf_counter`` (which the loop's cost model, the proposers'
    back-off and the kernel choice use) adds a random delay, seeded per test."""
    seed = request.config.getoption("--jittered-clock")
    if seed is None:
        return
    import random
    import time

    rng, real, extra = random.Random(f"{seed}:{request.node.nodeid}"), time.perf_counter, [0.0]

    def perf_counter():
        if rng.random() < 0.3:
            extra[0] += rng.uniform(0.0, 0.05)
        return real() + extra[0]

    monkeypatch.setattr(time, "perf_counter", perf_counter)


@pytest.fixture()
def steady_clock(monkeypatch):
    """``time.perf_counter`` advances 1 ms per read, whatever the machine does: measured times are counts of reads,
    the same on every run (for a test of a rule that reads measured times; none may depend on real timing)."""
    import itertools
    import time

    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)


def pytest_configure(config):
    device = config.getoption("--device")
    if device != "cpu":
        import torch

        import tiny

        tiny.DEVICE = torch.device(device)
        if tiny.DEVICE.type == "cuda" and not torch.cuda.is_available():
            raise pytest.UsageError(f"--device {device}: torch sees no CUDA device here.")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--extended"):
        later = pytest.mark.skip(reason="an extended test: pytest --extended runs it")
        for item in items:
            if "extended" in item.keywords:
                item.add_marker(later)
    if config.getoption("--device") == "cpu":
        return
    skip = pytest.mark.skip(reason="a CPU test: --device runs the tests marked 'device' only")
    for item in items:
        if "device" not in item.keywords:
            item.add_marker(skip)
