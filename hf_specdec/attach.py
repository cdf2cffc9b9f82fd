"""A model folder that decodes speculatively wherever it is loaded: ``hf-specdec attach``.

transformers gives a model folder the power to replace its model's ``generate``: ``from_pretrained(folder,
trust_remote_code=True)`` on a folder holding ``custom_generate/generate.py`` makes that file's ``generate`` the
model's own (``functools.partial(generate, model=model)``). :func:`attach` writes such a file, recording one method,
its options and its drafter, so that every code path built on ``generate()`` — user code, ``pipeline()``,
``transformers serve`` — speculates without an edit:

    $ hf-specdec attach ./my-model --method eagle3 --drafter ./my-eagle3-drafter -o tree_top_k=4

    >>> model = AutoModelForCausalLM.from_pretrained("./my-model", trust_remote_code=True)
    >>> out = model.generate(**inputs, max_new_tokens=64)  # eagle3, output identical to plain decoding

What the folder gains, all under ``custom_generate/``: ``generate.py`` (a dozen lines: the method, its options and
where its drafter is, as literals, and a call into this module), ``requirements.txt`` (the hf_specdec version it
needs; transformers checks it at load time) and, for a drafter given as a local folder, a copy of it in ``drafter/``
(so the folder is self-contained: move it, upload it, it still finds its drafter). A drafter given as a Hub id is
named, not copied; a method whose drafter ships with hf_specdec for this target (SmolLM2-135M-Instruct) needs none.
Loaded without ``trust_remote_code=True`` the folder is a plain model folder: nothing of it runs.

A call may still choose: ``custom_generate=`` (another method, or a callable) replaces the attached method for that
call, and the attached method's options given to ``generate()`` override the recorded ones. A call asking for what
speculative decoding does not do (beam search, ``num_return_sequences > 1``, contrastive search, DoLa, continuous
batching with ``cache_implementation="paged"``, per-step attentions) runs with transformers' own ``generate()``, with a warning (once per reason): code written for the model
keeps working. :func:`detach` (``hf-specdec
attach FOLDER --remove``) removes what :func:`attach` wrote.
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from . import registry

GENERATE_FILE = "custom_generate/generate.py"
DRAFTER_FOLDER = "custom_generate/drafter"  # a drafter copied into the folder
_MARK = "from hf_specdec.attach import generate_attached"  # how a custom_generate/ written by hf_specdec is known
_SAID: set[str] = set()  # calls run without speculation, each reason warned about once
logger = logging.getLogger("hf_specdec")

_TEMPLATE = '''"""hf_specdec speculative decoding attached to this model folder (`hf-specdec attach`).

Loaded with `from_pretrained(folder, trust_remote_code=True)`, transformers makes `generate` below the model's own
generate: the method recorded here decodes every call, with output identical to plain decoding. The decoding loop is
the installed `hf_specdec` package's (requirements.txt); `hf-specdec attach FOLDER --remove` removes this folder.
"""

{mark}

ATTACHED = {attached}


def generate(*args, model, **kwargs):
    return generate_attached(ATTACHED, model, *args, **kwargs)
'''


def _folder(model_dir) -> Path:
    folder = Path(model_dir).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a saved model folder (no config.json): attach writes into a folder "
                                "written by save_pretrained (or a downloaded model's folder).")
    return folder


def attached(model_dir) -> dict | None:
    """What :func:`attach` recorded in ``model_dir`` (``{"method", "options", "drafter", "hf_specdec"}``), or
    ``None`` when the folder carries no hf_specdec ``custom_generate/``."""
    path = Path(model_dir).expanduser() / GENERATE_FILE
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ATTACHED" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _ours(folder: Path) -> bool:
    path = folder / GENERATE_FILE
    return path.is_file() and "from hf_specdec" in path.read_text(encoding="utf-8", errors="replace")


def _plain(value, name: str):
    """``value`` as a literal that ``generate.py`` can hold (str, int, float, bool, None, lists and dicts of them)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, name) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, name) for k, v in value.items()}
    raise ValueError(f"Option {name}={value!r} ({type(value).__name__}) cannot be recorded in a model folder: attach "
                     "records strings, numbers, booleans and lists of them. Pass it to generate() instead.")


def _copy_drafter(source, into: Path) -> None:
    """The drafter at ``source`` (a folder, a shipped ``hf_specdec/drafters/<name>`` or a Hub id) copied into
    ``into``: the files of its folder, not its subfolders (training checkpoints)."""
    folder = Path(registry.drafter_source(source))
    into.mkdir(parents=True)
    copied = 0
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            shutil.copyfile(path, into / path.name)
            copied += 1
    if not copied:
        raise FileNotFoundError(f"The drafter folder {folder} holds no files.")


def attach(model_dir: str | os.PathLike, method: str, *, drafter: str | os.PathLike | None = None,
           copy_drafter: bool | None = None, force: bool = False, **options: Any) -> Path:
    """Make the saved model folder ``model_dir`` decode with ``method`` wherever it is loaded with
    ``trust_remote_code=True``; returns the folder's ``custom_generate/``.

    ``drafter``: a local folder (copied into ``custom_generate/drafter/`` unless ``copy_drafter=False``, which
    records its absolute path), a shipped ``hf_specdec/drafters/<name>`` (copied) or a Hub repo id (named, fetched
    when the folder is first used; ``copy_drafter=True`` copies it now). Without one, a method that needs a drafter
    uses the one hf_specdec ships for this target, else it is refused here. ``options``: the method's options (as
    ``generate()`` takes them), checked now. Attaching again replaces what an earlier :func:`attach` wrote; a
    ``custom_generate/`` of another origin is kept unless ``force=True``.

    Example:
        >>> hf_specdec.attach("./smollm2", "eagle3", tree_top_k=4)  # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained("./smollm2", trust_remote_code=True)  # doctest: +SKIP
        >>> model.generate(**inputs, max_new_tokens=64)  # speculative, identical to plain  # doctest: +SKIP
    """
    from . import __version__
    from .conversions.common import could_be_repo_id
    from .folders import write_file

    folder = _folder(model_dir)
    record = registry.get(method)
    if drafter is not None and not isinstance(drafter, (str, os.PathLike)):
        raise ValueError("attach records a drafter by folder or Hub id, not a loaded model: save it first "
                         "(drafter.save_pretrained(folder)) and pass the folder.")
    record.resolve({**options, "drafter": drafter})  # an unknown option, a bad value, a drafter it takes none of
    options = {k: _plain(v, k) for k, v in options.items() if v is not None}
    if drafter is None and record.drafter is not None and record.drafter.required:
        from transformers import AutoConfig

        from .identity import identify

        target_id = identify(AutoConfig.from_pretrained(folder))  # None: shipped_drafter's None is the default model
        if target_id is None or registry.shipped_drafter(record, target_id) is None:
            raise ValueError(f"Method {method!r} needs a drafter ({record.drafter.doc}), and hf_specdec ships none for "
                             f"the model in {folder}: pass --drafter PATH_OR_HUB_ID (drafter=).")
    custom = folder / "custom_generate"
    if custom.exists() and not _ours(folder) and not force:
        raise FileExistsError(f"{custom} exists and was not written by hf_specdec (another custom generate method): "
                              "remove it, or pass --force (force=True) to replace it.")

    staging = folder / f".custom_generate.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        where = None
        if drafter is not None:
            text = os.fspath(drafter)
            local = Path(text).expanduser().is_dir() or text.replace("\\", "/").startswith(registry.SHIPPED_PREFIX)
            if copy_drafter if copy_drafter is not None else local:
                _copy_drafter(text, staging / Path(DRAFTER_FOLDER).name)
                where = {"copied": Path(DRAFTER_FOLDER).name}
            elif Path(text).expanduser().exists():
                where = {"path": str(Path(text).expanduser().resolve())}
            elif could_be_repo_id(text):
                where = {"hub": text}
            else:
                raise FileNotFoundError(f"The drafter {text} does not exist (looked from {os.getcwd()}), and it cannot "
                                        "be a Hub repo id.")
        facts = {"method": method, "options": options, "drafter": where, "hf_specdec": __version__}
        write_file(staging / "generate.py", _TEMPLATE.format(mark=_MARK, attached=repr(facts)))
        write_file(staging / "requirements.txt", f"hf_specdec>={__version__}\n")
        old = folder / f".custom_generate.{os.getpid()}.old"
        if custom.exists():
            os.replace(custom, old)
        os.replace(staging, custom)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return custom


def detach(model_dir: str | os.PathLike, force: bool = False) -> bool:
    """Remove what :func:`attach` wrote into ``model_dir`` (its ``custom_generate/``); ``False`` when there was
    nothing. A ``custom_generate/`` that hf_specdec did not write is kept unless ``force=True``."""
    folder = _folder(model_dir)
    custom = folder / "custom_generate"
    if not custom.exists():
        return False
    if not _ours(folder) and not force:
        raise FileExistsError(f"{custom} was not written by hf_specdec: it is left as it is (--force removes it).")
    shutil.rmtree(custom)
    return True


# ----------------------------------------------------------------------------------- the folder's generate, at run time
def _model_folder(model, what: str) -> Path:
    """The folder (or Hub snapshot) ``model`` was loaded from, holding ``what``."""
    from ._transformers import loaded_revision

    name = getattr(model, "name_or_path", None) or getattr(model.config, "name_or_path", None)
    if name and Path(name).is_dir():
        root = Path(name)
    elif name:
        root = _snapshot(name, loaded_revision(model.config), what)
    else:
        root = None
    if root is None or not (root / what).is_dir():
        raise FileNotFoundError(f"The attached method's drafter ({what}) is not beside the model "
                                f"({name or 'a model with no folder'}): the folder's custom_generate/ was used for "
                                "another model (custom_generate=<folder>), or its drafter was removed. Pass drafter= "
                                "to generate(), or attach again.")
    return root / what


@functools.lru_cache(maxsize=16)
def _snapshot(repo_id: str, revision: str | None, what: str) -> Path:
    """The Hub snapshot of ``repo_id`` with its folder ``what`` fetched (or found in the local cache): once per
    repository, revision and folder, not at every call."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=[f"{what}/*"]))
    except Exception as err:  # offline, not found
        raise FileNotFoundError(f"The drafter attached to {repo_id!r} ({what}) could not be fetched: {err}") from err


def generate_attached(attached_facts: dict, model, *args, **kwargs):
    """The body of an attached folder's ``generate``: the recorded method with its options and drafter, the call's
    own arguments first. A call that passes ``custom_generate=`` decodes with that instead (the model class's
    ``generate``)."""
    from ._transformers import GENERATE_RENAMED_KWARGS
    from .entry import generate_with_method, unsupported_call

    kwargs.pop("trust_remote_code", None)  # meant for custom_generate=, which is handled here
    for old, new in GENERATE_RENAMED_KWARGS.items():  # past_key_values= as generate() takes it: its cache=
        if old in kwargs:
            if kwargs.get(new) is not None:
                raise ValueError(f"Pass the cache once: {old}= or {new}=, not both.")
            kwargs[new] = kwargs.pop(old)
    if kwargs.get("custom_generate") is not None:
        return type(model).generate(model, *args, **kwargs)
    kwargs.pop("custom_generate", None)
    method = attached_facts["method"]
    given = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    reason = unsupported_call(model, given, kwargs)
    if reason is not None:  # beam search and the like: what the user's code asked for, run by transformers
        if reason not in _SAID:
            _SAID.add(reason)
            logger.warning(f"hf_specdec: this call runs transformers' own generate(), not {method} (attached to the "
                           f"model): {reason.split('. ')[0]}.")
        return type(model).generate(model, *args, **kwargs)
    for name, value in attached_facts.get("options", {}).items():
        if kwargs.get(name) is None:
            kwargs[name] = value
    where = attached_facts.get("drafter")
    if where and kwargs.get("drafter") is None and kwargs.get("assistant_model") is None:
        if "copied" in where:
            kwargs["drafter"] = str(_model_folder(model, f"custom_generate/{where['copied']}"))
        else:
            kwargs["drafter"] = where.get("path") or where["hub"]
    return generate_with_method(method, model, *args, **kwargs)
