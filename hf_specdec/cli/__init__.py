"""The ``hf-specdec`` command: demo, generate, bench, methods, convert, export, train, regenerate, attach,
install-hub-cache, publish-hub. Method names, their options, drafter flags, converters and exporters come from the
registry (:mod:`hf_specdec.registry`).

Here: the parser (:func:`build_parser`) and :func:`main`; each command's options and what it runs are in a module of
its own (:mod:`~hf_specdec.cli.methods`, :mod:`~hf_specdec.cli.demo`, :mod:`~hf_specdec.cli.bench`,
:mod:`~hf_specdec.cli.generate`, :mod:`~hf_specdec.cli.convert` with ``export``, :mod:`~hf_specdec.cli.train` with
``regenerate`` and ``data``, :mod:`~hf_specdec.cli.hub`), what they share in :mod:`~hf_specdec.cli.common`.

Conventions shared by every subcommand:

* methods are given comma-separated, ``--methods prompt_lookup,eagle3``; an unknown name is refused with the list
  of the available ones before anything loads;
* ``--help`` shows every option's choices and default; ``hf-specdec --version`` prints the versions of hf_specdec,
  torch and transformers;
* a user error raised by the library (a ``ValueError`` such as an unknown method or option, a missing file, a
  missing package) is printed as ``hf-specdec: error: <message>`` and the command exits with status 2, without a
  traceback; ``HF_SPECDEC_DEBUG=1`` lets the exception propagate with its traceback.

Example::

    $ hf-specdec demo
    $ hf-specdec demo --thorough
    $ hf-specdec demo --methods prompt_lookup,eagle3 --repeats 3
    $ hf-specdec bench --limit 5 --methods plain_kernels,prompt_lookup --background-load both
    $ hf-specdec --version
    hf_specdec 0.1.0 (torch 2.13.0, transformers 5.24.0, Python 3.11.7)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from .. import registry  # noqa: F401  (cli.registry, as before the commands had modules of their own)
from ..dtypes import DTYPES  # noqa: F401  (cli.DTYPES, the same)
from . import bench, convert, demo, generate, hub, methods, train
from .common import CommandError, _split_methods  # noqa: F401  (cli._split_methods, the same)

DEBUG_ENV = "HF_SPECDEC_DEBUG"  # set to 1: library errors keep their traceback
USER_ERRORS = (ValueError, OSError, ImportError, RuntimeError)  # what the CLI reports as "hf-specdec: error: ..."


def version_line() -> str:
    """``hf_specdec <version> (torch <version>, transformers <version>, Python <version>)``."""
    import torch
    import transformers

    from .. import __version__

    return (f"hf_specdec {__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()})")


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help, except for flags, options without a default (their help says
    what happens instead) and help that already names its default."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in help_text or default is None or default is False
                or default is argparse.SUPPRESS or default == []):
            return help_text
        return help_text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-specdec`` argument parser (every subcommand; choices and defaults shown by ``--help``)."""
    parser = argparse.ArgumentParser(prog="hf-specdec", formatter_class=_HelpFormatter,
                                     description="Lossless speculative decoding for transformers.",
                                     epilog=f"{DEBUG_ENV}=1 shows the traceback of an error.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of hf_specdec, torch and transformers, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help_text):
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)

    for group in (methods, demo, bench, generate, convert, train, hub):  # in the order --help lists them
        group.add_commands(add)
    return parser


def main(argv=None) -> int:
    """Run ``hf-specdec`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    A user error raised by the library (:data:`USER_ERRORS`) is printed as ``hf-specdec: error: <message>`` and
    raises :class:`CommandError` (``SystemExit(2)``), as argparse does for a bad argument; with
    ``HF_SPECDEC_DEBUG=1`` the exception itself propagates, traceback and all.

    Example:
        >>> main(["generate", "hi", "-o", "nonsense"])  # doctest: +SKIP
        hf-specdec: error: --option: 'nonsense': method options are given as KEY=VALUE.
        SystemExit: 2
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        message = str(err) or type(err).__name__
        if not isinstance(err, (ValueError, OSError)):  # a RuntimeError or ImportError may be a bug: say how to see
            message += f" ({DEBUG_ENV}=1 shows the traceback)"
        print(f"hf-specdec: error: {message}", file=sys.stderr)
        raise CommandError(message) from None
    except KeyboardInterrupt:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print("hf-specdec: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
