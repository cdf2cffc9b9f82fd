"""Private transformers names are reached through ``hf_specdec/_transformers*.py`` only.

The library's sources (hf_specdec/, modeling/, conversions/) are parsed; outside ``hf_specdec/_transformers.py`` (and
``_transformers_frames.py``, which reads ``generate()``'s frames) none may import a name that neither ``transformers``
nor ``transformers.generation`` exports, nor touch an underscore attribute that transformers defines (on its models,
configs, generation configs, caches and candidate generators) or sets on its objects.
"""

import ast
from pathlib import Path

import torch
import transformers
import transformers.generation
from transformers import (
    Cache,
    DynamicCache,
    DynamicLayer,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    StaticCache,
    StaticLayer,
)
from transformers.generation import CandidateGenerator

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("hf_specdec", "modeling", "conversions") for p in sorted((ROOT / folder).rglob("*.py"))]
ALLOWED = {ROOT / "hf_specdec" / "_transformers.py", ROOT / "hf_specdec" / "_transformers_frames.py"}

# set on instances by transformers (not visible on the classes), or internal without an underscore
INSTANCE_NAMES = {"_pad_token_tensor", "_eos_token_tensor", "_bos_token_tensor", "_decoder_start_token_tensor",
                  "_attn_implementation_internal", "_experts_implementation_internal", "_name_or_path",
                  "_weight_conversions", "cumulative_length", "_is_user_defined", "_mask_length"}


def private_attributes() -> set[str]:
    names = set(INSTANCE_NAMES)
    for cls in (PreTrainedModel, GenerationMixin, PretrainedConfig, GenerationConfig, Cache, DynamicCache, StaticCache,
                DynamicLayer, StaticLayer, CandidateGenerator):
        names |= {n for n in dir(cls) if n.startswith("_") and not n.startswith("__")}
    return names - set(dir(torch.nn.Module))  # torch's own (_parameters, _modules, hooks) are not transformers'


def is_public(name: str) -> bool:
    return hasattr(transformers, name) or hasattr(transformers.generation, name)


def _reads_instance_dict(node) -> bool:
    """``vars(x)`` or ``x.__dict__``."""
    return ((isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars")
            or (isinstance(node, ast.Attribute) and node.attr == "__dict__"))


def _named_strings(node) -> list[ast.Constant]:
    """String constants used as attribute names: ``getattr(x, "_a")`` (has/set/delattr), ``"_a" in vars(x)``,
    ``x.__dict__.pop("_a")``."""
    strings = []
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in {"getattr", "hasattr", "setattr", "delattr"}:
            strings = node.args[1:2]
        elif isinstance(node.func, ast.Attribute) and _reads_instance_dict(node.func.value):
            strings = node.args[:1]
    elif isinstance(node, ast.Compare) and any(_reads_instance_dict(c) for c in node.comparators):
        strings = [node.left]
    return [s for s in strings if isinstance(s, ast.Constant) and isinstance(s.value, str)]


def offences(path: Path, private: set[str], root: Path = ROOT) -> list[str]:
    found = []
    where = f"{path.relative_to(root)}"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers."):
            found += [f"{where}:{node.lineno} imports {node.module}.{a.name}" for a in node.names if not is_public(a.name)]
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.startswith("transformers.") and a.name != "transformers.generation"]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{where}:{node.lineno} uses .{node.attr}")
        found += [f"{where}:{s.lineno} uses {s.value!r}" for s in _named_strings(node) if s.value in private]
    return found


def test_private_transformers_names_only_in_transformers_module():
    private = private_attributes()
    assert {"_pad_token_tensor", "_assisted_decoding", "_supports_logits_to_keep"} <= private
    found = [o for path in SOURCES if path not in ALLOWED for o in offences(path, private)]
    assert not found, "private transformers names outside hf_specdec/_transformers.py:\n" + "\n".join(found)


def test_the_scan_sees_what_it_forbids(tmp_path):
    """The scan itself: each kind of reach is found."""
    source = tmp_path / "x.py"
    source.write_text(
        "from transformers.masking_utils import sdpa_mask\n"
        "from transformers.cache_utils import DynamicCache\n"  # public: exported by transformers
        "import transformers.integrations\n"
        "pad = generation_config._pad_token_tensor\n"
        "config._attn_implementation_internal = 'sdpa'\n"
        "layer.cumulative_length.fill_(3)\n"
        "getattr(config, '_attn_implementation', None)\n"
        "'_get_candidate_generator' in vars(model)\n"
        "self._cache = {}\n"  # an attribute of our own
        "data.get('_name_or_path')\n"  # a config.json field
    )
    found = offences(source, private_attributes(), root=tmp_path)
    assert sorted(f.split(" ", 1)[0] for f in found) == [f"x.py:{i}" for i in (1, 3, 4, 5, 6, 7, 8)], found


def test_transformers_module_documents_every_name():
    """One comment line per private import in hf_specdec/_transformers.py, and a docstring per accessor, each with
    the versions it was checked with."""
    path = ROOT / "hf_specdec" / "_transformers.py"
    lines = path.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers."):
            assert "checked:" in lines[node.lineno - 2], f"{node.module}: no comment line above it"
        elif isinstance(node, ast.FunctionDef):
            assert "Checked:" in (ast.get_docstring(node) or ""), node.name
    from hf_specdec import _transformers

    assert set(_transformers.__all__) <= set(vars(_transformers))
