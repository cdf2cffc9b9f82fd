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
