"""``hf-specdec methods``: the registered methods, their options and defaults (or the README's table; or the method
folders and docs pages rewritten from the records)."""

from __future__ import annotations

from .. import registry


def add_commands(add) -> None:
    """Adds the ``methods`` command through :func:`~hf_specdec.cli.build_parser`'s ``add``."""
    p = add("methods", "list the methods, their options and defaults")
    p.add_argument("--markdown", action="store_true", help="print the README's method table instead")
    p.add_argument("--write-folders", action="store_true",
                   help="rewrite the built-in methods' custom_generate folders from their records")
    p.add_argument("--write-docs", action="store_true",
                   help="rewrite the generated block (call, drafter, options) of docs/methods/<method>.md from the "
                        "records (in a checkout of the repository)")
    p.set_defaults(func=_methods)


def _methods(args) -> int:
    if args.write_folders:
        from ..folders import write_builtin_folders

        for folder in write_builtin_folders():
            print(f"wrote {folder}")
        return 0
    if args.write_docs:
        from ..folders import write_method_docs

        for page in write_method_docs():
            print(f"wrote {page}")
        return 0
    if args.markdown:
        print(registry.markdown_table())
        return 0
    print("\n\n".join(registry.describe(m) for m in registry.methods()))
    return 0
