"""The method registry: one record per speculative decoding method, read by everything that names a method.

A :class:`Method` says what a method is called, its options (name, type, default, one-line doc), how it builds its
proposer, how its drafter is loaded or converted and which drafter ships for a known target. The ``custom_generate``
entry points and the callable form (:mod:`hf_specdec.entry`), the method folders (:mod:`hf_specdec.folders`), the
CLI's ``generate`` / ``demo`` / ``bench`` / ``convert``, the README's method table and the error messages for an
unknown method or option all read it; a method's defaults are written only in its record.

The built-in records live beside their proposers (``hf_specdec/proposers/<method>.py``, attribute ``METHOD``). A
method of your own is one :func:`register` call::

    from hf_specdec.registry import Method, Option, register

    register(Method(
        name="my_lookup",
        summary="n-grams of a document the user passes",
        build=lambda target, opts: MyLookupProposer(opts["document"], opts["width"]),
        options=(Option("document", str, None, "the text to copy from"), Option("width", int, 4, "drafts per step")),
    ))
    model.generate(**inputs, custom_generate=hf_specdec.decoding_method("my_lookup"), document=text)
    model.generate(**inputs, custom_generate=hf_specdec.custom_generate_path("my_lookup"), trust_remote_code=True,
                   document=text)
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .adaptive import Rules
from .placement import drafter_device

BUILTIN_MODULES = ("plain", "prompt_lookup", "suffix", "lookahead", "draft_model", "universal", "eagle3", "dflash", "medusa",
                   "layerskip", "mtp", "gemma4_assistant", "auto")  # hf_specdec.proposers modules with a METHOD
DRAFTERS_DIR = Path(__file__).parent / "drafters"  # drafters trained by this project, shipped with the package


@dataclass(frozen=True)
class Option:
    """One keyword argument of a method (given to ``generate`` or ``decoding_method``).

    ``default=None`` means "not set": the method decides (and the doc says how). ``choices`` restricts the values.
    ``generation_setting``: the name is also a transformers generation setting (``GenerationConfig`` field); when the
    call does not give it, the entry points read it from the call's generation config (``generate()`` keywords,
    ``generation_config=``, the model's own), as transformers would.
    """

    name: str
    type: type | tuple[type, ...]
    default: Any
    doc: str
    choices: tuple = ()
    generation_setting: bool = False

    def check(self, method: str, value):
        """``value`` if it is valid for this option (``None``: the default), else a ``ValueError`` naming why."""
        if value is None:
            return self.default
        if self.choices and value not in self.choices:
            allowed = " or ".join(repr(c) for c in self.choices)
            raise ValueError(f"{self.name} must be {allowed}, got {value!r}.")
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        if object not in types and not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{method}: {self.name} must be {names}, got {type(value).__name__} {value!r}.")
        return value

    def parse(self, text: str):
        """The value of a command-line string (``--option name=text``, ``bench`` method strings)."""
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        if text.lower() in ("none", ""):
            return None
        if int in types:
            return int(text)
        if float in types:
            return float(text)
        if bool in types:
            return text.lower() in ("1", "true", "yes")
        return text

    @property
    def type_name(self) -> str:
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        return " | ".join("any" if t is object else t.__name__ for t in types)


SCHEDULE = Option("draft_length_schedule", str, "adaptive",
                  "'adaptive': draft lengths follow the measured costs and acceptance; 'constant': always the most",
                  choices=("adaptive", "constant"))

ROUNDING = Option("rounding", str, None,
                  "half precision on the CPU: 'auto' (default) bit-identical to the target's own one-token steps where "
                  "this CPU's products allow (probed: speculative_stats['exact_bits']), else as 'fast'; 'exact' "
                  "bit-identical on every CPU (slower where it is needed), 'fast' identical up to rounding",
                  choices=("auto", "exact", "fast"))
COMPILE = Option("compile", bool, None,
                 "torch.compile the target's verification forward (CUDA graphs on a GPU): a static KV cache and tree "
                 "sizes padded to 1, 2, 4, ... 64 nodes, then multiples of 64; compiles once per model and size "
                 "(minutes on a CPU), pays back over many calls (docs: hf_specdec/compiled.py)")
SAMPLING = Option("speculative_sampling", str, None,
                  "with do_sample=True: 'coupled' (default) the Gumbel-max coupling, the text a function of the seed "
                  "and the same for every method and draft length (identical to method 'plain'); 'rejection' exact "
                  "speculative sampling (accepts more drafts, not repeatable under the adaptive schedule)",
                  choices=("coupled", "rejection"))
SEED = Option("seed", int, None,
              "the seed of a sampled call (default: one draw from torch's global generator, so torch.manual_seed "
              "before the call repeats it; speculative_stats['seed'] reports it)")
GENERATOR = Option("generator", torch.Generator, None,
                   "a torch.Generator the call draws its seed from (instead of torch's global one)")
ADAPTIVE_RULES = Option("adaptive_rules", Rules, None,
                        "a hf_specdec.adaptive.Rules with some adaptive rules switched off, for ablations (default: "
                        "every rule on); the output is the same, only the speed changes")
LOOP_OPTIONS = (ROUNDING, COMPILE, SAMPLING, SEED, GENERATOR, ADAPTIVE_RULES)  # options of the loop, taken by every method (not
# passed to its proposer)


@dataclass(frozen=True)
class Shorthand:
    """A short form of a method's options for ``bench`` method strings: ``NAME[:ARG]`` (``ARG`` documented by
    ``arg``); ``options(arg)`` turns the text after the colon (``""`` when absent) into options."""

    arg: str
    options: Callable[[str], dict]


@dataclass(frozen=True)
class DrafterSpec:
    """How a method's drafter is given and where it comes from.

    Args:
        doc: what the drafter is ("an EAGLE-3 drafter").
        hint: how to pass it, for the error when it is missing.
        load: ``load(path_or_repo_id, target) -> module`` on the target's device and dtype.
        accepts: model classes accepted as objects (``None``: any ``nn.Module``).
        check: ``check(target, drafter)`` raises when the drafter does not fit the target (objects and loaded).
        convert: ``convert(source, out, revision=, target=, layout=, dtype=)`` for ``hf-specdec convert``.
        layouts: the published layouts ``convert`` reads (``--layout``).
        export: ``export(drafter_or_path, out, verifier=, speculative_tokens=, dtype=) -> Exported`` for
            ``hf-specdec export``: the drafter written in the layout a serving engine loads (the speculators format
            ``vllm serve <folder>`` reads, or the engine's own), which ``convert`` reads back.
        shipped: target model id -> folder under ``hf_specdec/drafters`` trained by this project.
        flag: the CLI option naming it for ``demo`` / ``bench`` (default: ``--<method>``).
        required: the method cannot run without one.
        default_when: for a drafter that is not required, ``default_when(options)`` says whether the shipped one
            drafts when none is given (``None``: never).
        example: how the method folder's README passes one (the rest of the ``generate`` call's line).
        train: ``train(target, tokenizer, out_dir, cli_args, common) -> (drafter, metrics)`` for
            ``hf-specdec train <train_name>`` (``common``: the trainer keywords every drafter shares).
        train_name: the name ``hf-specdec train`` knows it by (default: the method's).
        more_training: other ``hf-specdec train`` recipes of the method, by name: ``(what it trains, train)`` with
            ``train`` called as above (LayerSkip's recipe, which trains the target itself).
    """

    doc: str
    hint: str
    load: Callable[[Any, Any], torch.nn.Module]
    accepts: type | tuple[type, ...] | None = None
    check: Callable[[Any, Any], None] | None = None
    convert: Callable | None = None
    layouts: tuple[str, ...] = ()
    export: Callable | None = None
    shipped: Mapping[str, str] = field(default_factory=dict)
    flag: str | None = None
    required: bool = True
    default_when: Callable[[dict], bool] | None = None
    example: str = 'drafter="path/or/hub-id")'
    train: Callable | None = None
    train_name: str | None = None
    more_training: Mapping[str, tuple[str, Callable]] = field(default_factory=dict)

    @classmethod
    def published(cls, model_cls, convert: Callable, layouts: tuple[str, ...], **fields) -> "DrafterSpec":
        """The drafter of a method with a network of its own (``model_cls``): given as a model, a folder hf_specdec
        converted, or a published checkpoint (repo id or folder) in one of ``layouts``, converted in memory with
        ``convert`` (:func:`hf_specdec.conversions.common.load_converted_or_published`)."""
        from .conversions.common import load_converted_or_published

        fields.setdefault("hint", f"pass drafter=<{model_cls.__name__}, converted folder, or a published repo id / "
                                  "folder>")
        return cls(load=functools.partial(load_converted_or_published, model_cls=model_cls, convert=convert),
                   accepts=model_cls, convert=convert, layouts=layouts, **fields)


@dataclass(frozen=True, repr=False)
class Method:
    """One speculative decoding method.

    Args:
        name: what ``custom_generate="hf_specdec/<name>"``, ``decoding_method(name)`` and the CLI call it.
        summary: what it drafts from, one line (README table, CLI help, errors).
        build: ``build(target, options) -> Proposer``; ``options`` holds every option (defaults filled in) and
            ``"drafter"``: the loaded drafter module (or ``None``).
        options: its keyword arguments.
        drafter: how its drafter is given, if it has one.
        shorthands: short forms for ``bench`` method strings, by name (its own name and variants such as
            ``eagle3_chain``).
        description: a paragraph for the method folder's README (default: ``summary``).
        reference: drafts nothing (``plain``): the reference the methods are compared against, left out of the
            demo's comparison.
        router: chooses another method from the call's arguments (``auto``) and drafts nothing of its own: left out
            of the demo's comparison.
    """

    name: str
    summary: str
    build: Callable[[Any, dict], Any]
    options: tuple[Option, ...] = ()
    drafter: DrafterSpec | None = None
    shorthands: Mapping[str, Shorthand] = field(default_factory=dict)
    description: str = ""
    reference: bool = False
    router: bool = False

    def __repr__(self) -> str:
        return f"Method({self.name!r})"

    @property
    def all_options(self) -> tuple[Option, ...]:
        """Its own options and the loop's (:data:`LOOP_OPTIONS`)."""
        return self.options + LOOP_OPTIONS

    def option(self, name: str) -> Option:
        return {o.name: o for o in self.all_options}[name]

    @property
    def drafter_flag(self) -> str | None:
        """The command-line option naming its drafter in ``demo`` / ``bench`` (``None``: no drafter)."""
        return None if self.drafter is None else (self.drafter.flag or self.name)

    @property
    def train_name(self) -> str | None:
        """What ``hf-specdec train`` calls its drafter (``None``: no trainer)."""
        return None if self.drafter is None or self.drafter.train is None else (self.drafter.train_name or self.name)

    @property
    def trainers(self) -> dict[str, tuple[str, Callable]]:
        """Every ``hf-specdec train`` recipe of the method: name -> ``(what it trains, train)``."""
        if self.drafter is None:
            return {}
        found = {self.train_name: (self.drafter.doc, self.drafter.train)} if self.train_name else {}
        return {**found, **self.drafter.more_training}

    def parse_option(self, text: str) -> tuple[str, Any]:
        """``"KEY=VALUE"`` (a command-line string) -> ``(key, value)`` of one of its options."""
        key, sep, value = text.partition("=")
        if not sep:
            raise ValueError(f"{text!r}: method options are given as KEY=VALUE.")
        if key not in {o.name for o in self.all_options}:
            raise ValueError(_unknown_options_message(self, [key]))
        return key, self.option(key).parse(value)

    @property
    def option_names(self) -> list[str]:
        return [o.name for o in self.all_options] + (["drafter"] if self.drafter else [])

    def resolve(self, given: dict) -> dict:
        """Every option's value (``given`` first, ``None`` meaning not given), checked; ``"drafter"`` as given."""
        unknown = sorted(k for k in set(given) - set(self.option_names) if given[k] is not None)
        if "drafter" in unknown:
            users = [m.name for m in methods() if m.drafter is not None]
            raise ValueError(f"The {self.name!r} method takes no drafter/assistant_model: it drafts from "
                             f"{self.summary}. Methods that draft with a model: {', '.join(users)} (e.g. "
                             "custom_generate='hf_specdec/assisted').")
        unknown = [k for k in unknown if k != "drafter"]
        if unknown:
            raise ValueError(_unknown_options_message(self, unknown))
        opts = {o.name: o.check(self.name, given.get(o.name)) for o in self.all_options}
        if self.drafter is not None:
            opts["drafter"] = given.get("drafter")
        return opts


def _unknown_options_message(method: Method, unknown: list[str]) -> str:
    """Names the unknown options, the method owning each (if another does), the nearest match of a misspelt one
    (among this method's options, every method's and the generation settings) and this method's options."""
    import difflib

    from transformers import GenerationConfig

    owners = {k: [m.name for m in methods() if k in m.option_names] for k in unknown}
    elsewhere = "; ".join(f"{k} is an option of {', '.join(v)}" for k, v in owners.items() if v)
    ours, settings = method.option_names, list(GenerationConfig().to_dict())
    candidates = list(dict.fromkeys(ours + settings + all_option_names()))  # ties: this method's, then settings
    nearest = {}
    for k in unknown:
        score, best = max((difflib.SequenceMatcher(None, k, c).ratio(), -i, c) for i, c in enumerate(candidates))[::2]
        if not owners[k] and score >= 0.75:
            nearest[k] = best
    guesses = "; ".join(f"{k} is a generation setting: give it to generate()" if k == v else f"{k}: did you mean {v}"
                        + ("" if v in ours else " (a generation setting)" if v in settings else " (another method's)")
                        + "?" for k, v in nearest.items())
    return (f"Got unknown method option(s) {', '.join(unknown)} for {method.name!r}"
            + (f" ({elsewhere})" if elsewhere else "") + (f" ({guesses})" if guesses else "")
            + f"; the options of {method.name!r} are {', '.join(ours) or 'none'} "
            "(generation settings such as top_k go to generate()).")


class UnknownMethodError(ValueError):
    """A method name that is not registered."""


# ------------------------------------------------------------------------------------------------------- records
class Registry:
    """The registered methods, and what loading their drafters keeps: one instance (:data:`REGISTRY`) serves the
    module's functions (:func:`register`, :func:`get`, :func:`load_drafter`...); every piece of state lives here.

    ``methods``: name -> record, the built-in records first (filled on first use, from :data:`BUILTIN_MODULES`);
    ``drafters``: the last few drafters loaded from a path or Hub id (:class:`DrafterCache`); ``said_shipped``: the
    (method, target) pairs whose shipped default drafter was announced (said once)."""

    def __init__(self, builtin_modules: tuple[str, ...] = BUILTIN_MODULES):
        self.builtin_modules = builtin_modules
        self.methods: dict[str, Method] = {}
        self.builtin: tuple[str, ...] = ()  # names of the built-in methods: empty until every record is in .methods
        self.lock = threading.RLock()  # around every change (re-entrant: a module imported under it may register)
        self.said_shipped: set[tuple[str, str]] = set()
        self.drafters = DrafterCache()

    def load_builtin(self) -> None:
        """Fill the registry with the built-in records, once; threads that come meanwhile wait for it to be full
        (the names are published last, so the lock-free check never sees a half-filled registry)."""
        if self.builtin:
            return
        with self.lock:
            if self.builtin:
                return
            records = [importlib.import_module(f"hf_specdec.proposers.{module}").METHOD
                       for module in self.builtin_modules]
            for record in records:
                self.methods.setdefault(record.name, record)
            self.builtin = tuple(record.name for record in records)

    def register(self, method: Method, replace: bool = False) -> Method:
        self.load_builtin()
        with self.lock:
            if method.name in self.methods and not replace:
                raise ValueError(f"A method named {method.name!r} is already registered (pass replace=True to "
                                 "replace it).")
            taken = {s: m.name for m in self.methods.values() if m.name != method.name for s in m.shorthands}
            clash = [s for s in method.shorthands if s in taken or (s in self.methods and s != method.name)]
            if clash:
                raise ValueError(f"Method {method.name!r}: the names {clash} are already used by other methods.")
            self.methods[method.name] = method
        return method

    def unregister(self, name: str) -> None:
        self.load_builtin()
        with self.lock:
            self.methods.pop(name, None)

    def records(self) -> list[Method]:
        self.load_builtin()
        return list(self.methods.values())

    def get(self, name: str) -> Method:
        self.load_builtin()
        record = self.methods.get(name)  # one read: a concurrent unregister() cannot slip between a check and it
        if record is None:
            raise UnknownMethodError(f"Unknown speculative decoding method {name!r}. "
                                     f"Available: {', '.join(sorted(self.methods))}.")
        return record

    def say_shipped_once(self, method: str, target_id: str) -> bool:
        """True the first time ``(method, target_id)`` is asked (also when threads ask at once)."""
        with self.lock:
            first = (method, target_id) not in self.said_shipped
            self.said_shipped.add((method, target_id))
        return first


def builtin_methods() -> list[str]:
    """The names of the methods built into hf_specdec (their folders ship in the package)."""
    REGISTRY.load_builtin()
    return list(REGISTRY.builtin)


def register(method: Method, replace: bool = False) -> Method:
    """Add ``method`` to the registry (``replace=True`` to replace a record of the same name)."""
    return REGISTRY.register(method, replace)


def unregister(name: str) -> None:
    """Remove the method ``name`` (a no-op when it is not registered)."""
    REGISTRY.unregister(name)


def methods() -> list[Method]:
    """Every registered method, built-in ones first in their README order."""
    return REGISTRY.records()


def available_methods() -> list[str]:
    """The names of every registered method, sorted."""
    return sorted(m.name for m in methods())


def get(name: str) -> Method:
    """The record of ``name``; an unknown name raises ``ValueError`` listing the registered methods."""
    return REGISTRY.get(name)


def all_option_names() -> list[str]:
    """Every option name of any registered method (``drafter`` included), in first-seen order."""
    return list(dict.fromkeys(name for m in methods() for name in m.option_names))


def parse_spec(spec: str) -> tuple[Method, dict]:
    """A method string ``NAME[:ARG][:KEY=VALUE...]`` (``bench --methods``; ``NAME`` a method or one of its
    shorthands, ``ARG`` the shorthand's argument) -> ``(method, options)``."""
    name, *parts = spec.split(":")
    owner = next((m for m in methods() if name in m.shorthands), None)
    if owner is None:
        owner = get(name)
    opts = {}
    args = [p for p in parts if "=" not in p]
    if name in owner.shorthands:
        if len(args) > 1:
            raise ValueError(f"{spec!r}: {name} takes one argument ({owner.shorthands[name].arg}).")
        opts.update(owner.shorthands[name].options(args[0] if args else ""))
    elif args:
        raise ValueError(f"{spec!r}: {name} takes options as KEY=VALUE ({', '.join(owner.option_names)}).")
    opts.update(owner.parse_option(part) for part in parts if "=" in part)
    return owner, opts


# ------------------------------------------------------------------------------------------------------ drafters
def shipped_drafter(method: str | Method, target=None) -> Path | None:
    """The folder of the drafter this project trained and ships with the package for ``target``, if there is one.

    ``target`` is a target id (e.g. ``"HuggingFaceTB/SmolLM2-135M-Instruct"``), a loaded model (recognised by its
    config and vocabulary, :func:`hf_specdec.identity.identify`, not by its path) or ``None`` for the embedded
    default model.

    Example:
        >>> hf_specdec.shipped_drafter("eagle3")  # doctest: +SKIP
        PosixPath('.../hf_specdec/drafters/smollm2-135m-instruct-eagle3')
    """
    from . import identity
    from .default_model import MODEL_ID

    record = method if isinstance(method, Method) else get(method)
    target_id = MODEL_ID if target is None else target if isinstance(target, str) else identity.identify(target)
    if record.drafter is None or target_id not in record.drafter.shipped:
        return None
    return shipped_folder(record.drafter.shipped[target_id])


def shipped_folder(name: str) -> Path | None:
    """``hf_specdec/drafters/<name>``, if it holds a drafter (a checkout may lack the shipped weights)."""
    folder = DRAFTERS_DIR / name
    return folder if (folder / "config.json").is_file() else None


SHIPPED_PREFIX = "hf_specdec/drafters/"  # how the README names the shipped drafters; read from any directory


def drafter_source(source) -> str:
    """Where a drafter given as a path or Hub id is read from: an existing local folder; ``hf_specdec/drafters/<name>``
    (a shipped drafter, from any working directory); else a Hub repo id, fetched (or found in the local Hub cache)
    here. A missing path, a file, or an incomplete weight file is reported as such (:mod:`hf_specdec.conversions`)."""
    from .conversions.common import WEIGHT_PATTERNS, check_weight_files, resolve_source

    text = os.fspath(source)
    posix = text.replace("\\", "/")
    if not Path(text).expanduser().exists() and posix.startswith(SHIPPED_PREFIX):
        name = posix[len(SHIPPED_PREFIX):].strip("/")
        folder = shipped_folder(name)
        if folder is None:
            shipped = sorted(p.name for p in DRAFTERS_DIR.iterdir() if (p / "config.json").is_file()) \
                if DRAFTERS_DIR.is_dir() else []
            raise FileNotFoundError(f"{text} does not exist: hf_specdec ships no drafter {name!r} (shipped: "
                                    f"{', '.join(shipped) or 'none in this install'}).")
        text = str(folder)
    folder = resolve_source(text, allow_patterns=["*.json", "*.txt", "*.model"] + WEIGHT_PATTERNS)
    check_weight_files(folder)
    return str(folder)


def _default_drafter(record: Method, target):
    """The shipped drafter for ``target`` when ``drafter=`` was not given (said once per method and target)."""
    from . import identity

    target_id = identity.identify(target)
    folder = shipped_drafter(record, target_id) if target_id is not None else None
    if folder is None:
        return None
    if REGISTRY.say_shipped_once(record.name, target_id):
        identity.logger.warning(f"hf_specdec: {record.name} uses the drafter shipped for {target_id} "
                                f"({SHIPPED_PREFIX}{folder.name}); pass drafter= to use another.")
    return folder


class DrafterCache:
    """The last few drafters loaded from a path or Hub id, keyed by method, source, target, dtype and device (and a
    local folder's file times, so that a folder rewritten in place is read again).

    Safe across threads: threads asking for the same key at once load it once (:meth:`get_or_load`; the others
    wait for that load), different keys load side by side."""

    def __init__(self, size: int = 4):
        self.size = size
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()
        self.loading: dict = {}  # key -> the lock its loader holds while it loads

    def get(self, key, target):
        with self.lock:
            entry = self.entries.get(key)
            if entry is None or entry[0]() is not target:
                return None
            self.entries.move_to_end(key)
            return entry[1]

    def put(self, key, target, drafter) -> None:
        try:
            ref = weakref.ref(target)
        except TypeError:
            return
        with self.lock:
            self.entries[key] = (ref, drafter)
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)

    def get_or_load(self, key, target, load: Callable[[], Any]):
        """The cached drafter of ``key`` for ``target``, else ``load()``'s, cached."""
        module = self.get(key, target)
        if module is not None:
            return module
        with self.lock:
            loading = self.loading.setdefault(key, threading.Lock())
        try:
            with loading:  # a second thread with this key waits here, then finds the first one's drafter
                module = self.get(key, target)
                if module is None:
                    module = load()
                    self.put(key, target, module)
                return module
        finally:
            with self.lock:
                if self.loading.get(key) is loading:
                    del self.loading[key]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


REGISTRY = Registry()  # the registry every entry point reads


def _source_key(source) -> tuple:
    path = Path(source)
    if path.is_dir():
        stamps = tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in path.iterdir() if f.is_file()))
        return (str(path.resolve()), stamps)
    return (str(source), None)


def load_drafter(method: str | Method, drafter, target, options: dict | None = None):
    """``method``'s drafter for ``target``: a module is checked and returned; a path or Hub id is loaded with the
    method's loader, once per target (a small cache of the last few: later ``generate`` calls reuse it). ``None``:
    the shipped one where the method needs a drafter (or, for an optional one, where ``default_when(options)``)."""
    record = method if isinstance(method, Method) else get(method)
    spec = record.drafter
    wants_default = spec is not None and (spec.required or (
        spec.default_when is not None and spec.default_when(options or {})))
    if drafter is None and wants_default:
        drafter = _default_drafter(record, target)
        if drafter is None and spec.required:
            shipped = f" (drafters ship for {', '.join(spec.shipped)})" if spec.shipped else ""
            raise ValueError(f"The {record.name!r} method needs {spec.doc}: {spec.hint}{shipped}.")
    if drafter is None:
        return None
    if isinstance(drafter, torch.nn.Module):
        if spec.accepts is not None and not isinstance(drafter, spec.accepts):
            raise TypeError(f"The {record.name!r} method needs {spec.doc}, got {type(drafter).__name__}.")
        module = drafter
    elif isinstance(drafter, (str, os.PathLike)):
        drafter = drafter_source(drafter)
        key = (record.name, _source_key(drafter), id(target), str(target.dtype), str(drafter_device(target)))
        module = REGISTRY.drafters.get_or_load(key, target, functools.partial(spec.load, drafter, target))
    else:
        raise TypeError(f"drafter must be {spec.doc} or a path / Hub repo id, got {type(drafter).__name__}.")
    if spec.check is not None:
        spec.check(target, module)
    return module


# ---------------------------------------------------------------------------------------------------------- docs
def markdown_table() -> str:
    """The README's method table, from the records: one line per method (what drafts, where its drafter comes from,
    its page ``docs/methods/<method>.md``)."""
    lines = ["| method | drafts from | drafter (where it comes from) | details |", "|---|---|---|---|"]
    for m in methods():
        source = "none needed"
        if m.drafter is not None:
            d = m.drafter
            where = ([f"shipped for {', '.join(t.split('/')[-1] for t in d.shipped)}"] if d.shipped else []) \
                + ([f"published ({' / '.join(d.layouts)})"] if d.layouts else []) \
                + [f"`hf-specdec train {name}`" for name in m.trainers]
            source = ("optional: " if not d.required else "") + d.doc + (": " + ", ".join(where) if where else "")
        page = f"docs/methods/{m.name}.md"
        lines.append(f"| `{m.name}` | {m.summary} | {source} | [{page}]({page}) |")
    return "\n".join(lines)


def describe(method: str | Method) -> str:
    """A method's options as text (``hf-specdec methods``)."""
    m = method if isinstance(method, Method) else get(method)
    lines = [f"{m.name}: {m.summary}"]
    if m.drafter is not None:
        need = " (required)" if m.drafter.required else ""
        shipped = f"; default for {', '.join(m.drafter.shipped)}: the shipped one" if m.drafter.shipped else ""
        lines.append(f"  drafter{need}: {m.drafter.doc}; {m.drafter.hint}{shipped}")
    for o in m.options:
        choices = f" {{{', '.join(map(str, o.choices))}}}" if o.choices else ""
        lines.append(f"  {o.name} ({o.type_name}{choices}, default {o.default!r}): {o.doc}")
    for short, s in m.shorthands.items():
        lines.append(f"  bench: {short}{':' + s.arg if s.arg else ''}")
    return "\n".join(lines)
