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
