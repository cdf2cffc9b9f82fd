"""What trainers save with a drafter: a half-precision copy of its weights (:func:`_half_copy`) and the id of the
target its config records (:func:`_target_id`)."""

from __future__ import annotations

import json
from pathlib import Path


def _half_copy(save_dtype):
    """A ``save_model`` for :func:`.trainer.train` that writes a ``save_dtype`` copy (integer buffers such as a
    ``token_map`` unchanged; the config says what the file holds); the weights being trained stay fp32."""
    def save(m, folder):
        m.save_pretrained(folder, state_dict={k: (v.to(save_dtype) if v.is_floating_point() else v)
                                              for k, v in m.state_dict().items()})
        _record_dtype(folder, save_dtype)
    return save


def _record_dtype(folder, dtype) -> None:
    """Make a saved config name the dtype its weights file holds (``save_pretrained`` writes the dtype of the
    weights in memory: fp32 while training)."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _target_id(target) -> str | None:
    """The id a drafter's config records for its target: a known target's Hub id (recognised by its config and
    vocabulary, wherever its files are), else the path or id it was loaded from."""
    from ..identity import identify

    return identify(target) or getattr(target.config, "name_or_path", None) or None
