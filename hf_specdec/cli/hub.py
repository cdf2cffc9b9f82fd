"""``hf-specdec attach``: a model folder that speculates wherever it is loaded (:mod:`hf_specdec.attach`);
``hf-specdec install-hub-cache`` and ``hf-specdec publish-hub``: the method folders placed in the local Hugging Face
cache, or uploaded to the Hub."""

from __future__ import annotations

from .. import registry
from .common import _method_list, _method_list_help


def add_commands(add) -> None:
    """Adds the ``install-hub-cache`` and ``publish-hub`` commands through
    :func:`~hf_specdec.cli.build_parser`'s ``add``."""
    method_list_help = _method_list_help()

    p = add("attach", "make a saved model folder decode with a method wherever it is loaded with "
                      "trust_remote_code=True (generate(), pipeline(), transformers serve)")
    p.add_argument("folder", help="the model folder (save_pretrained output, or a downloaded model's folder)")
    p.add_argument("--method", choices=registry.available_methods(), default=None,
                   help="the speculative decoding method to attach (required unless --remove)")
    p.add_argument("--drafter", default=None,
                   help="the method's drafter: a folder (copied into the model folder), hf_specdec/drafters/<name> "
                        "(copied) or a Hub id (named; fetched at first use) (default: the drafter hf_specdec ships "
                        "for this model, if any)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="a method option, repeatable (hf-specdec methods lists them), e.g. -o tree_top_k=4")
    copy = p.add_mutually_exclusive_group()
    copy.add_argument("--copy-drafter", dest="copy_drafter", action="store_const", const=True, default=None,
                      help="copy a drafter given as a Hub id into the folder too (fetched now)")
    copy.add_argument("--link-drafter", dest="copy_drafter", action="store_const", const=False,
                      help="record a local drafter folder by its absolute path instead of copying it")
    p.add_argument("--remove", action="store_true", help="remove what attach wrote (the folder's custom_generate/)")
    p.add_argument("--force", action="store_true",
                   help="replace (or with --remove, delete) a custom_generate/ that hf_specdec did not write")
    p.set_defaults(func=lambda a: _attach(a))

    p = add("install-hub-cache", "place the method folders in the local Hugging Face cache as hf_specdec/<method>")
    p.add_argument("--cache-dir", default=None, help="Hub cache folder (default: $HF_HUB_CACHE)")
    p.add_argument("--org", default="hf_specdec", help="the repositories' owner: <org>/<method>")
    p.add_argument("--methods", type=_method_list, default=None, metavar="M1,M2",
                   help=f"{method_list_help} (default: every registered method)")
    _folder_arguments(p, "place")
    p.set_defaults(func=lambda a: _install(a))

    p = add("publish-hub", "upload the method folders to the Hub (needs network and a token)")
    p.add_argument("--org", default="hf_specdec", help="the repositories' owner: <org>/<method>")
    p.add_argument("--methods", type=_method_list, default=None, metavar="M1,M2",
                   help=f"{method_list_help} (default: every registered method)")
    p.add_argument("--token", default=None, help="a Hub write token (default: the one saved by 'hf auth login')")
    p.add_argument("--private", action="store_true", help="create private repositories")
    p.add_argument("--dry-run", action="store_true", help="print what would be uploaded, upload nothing")
    _folder_arguments(p, "upload")
    p.set_defaults(func=lambda a: _publish(a))


def _folder_arguments(p, verb: str) -> None:
    p.add_argument("--folder", default=None,
                   help=f"instead of the method folders, {verb} this model folder (after hf-specdec attach) as --repo")
    p.add_argument("--repo", default=None, metavar="OWNER/NAME", help="with --folder: the repository id")


def _attach(args) -> int:
    from ..attach import attach, detach

    if args.remove:
        removed = detach(args.folder, force=args.force)
        print(f"removed {args.folder}/custom_generate" if removed else f"{args.folder} has no custom_generate/")
        return 0
    if args.method is None:
        raise ValueError("attach needs --method METHOD (or --remove).")
    method = registry.get(args.method)
    try:
        opts = dict(method.parse_option(item) for item in args.option)
    except ValueError as err:
        raise ValueError(f"--option: {err}") from None
    custom = attach(args.folder, args.method, drafter=args.drafter, copy_drafter=args.copy_drafter,
                    force=args.force, **opts)
    print(f"attached {args.method} to {args.folder} ({custom}). Load it with trust_remote_code=True, e.g.\n"
          f"  AutoModelForCausalLM.from_pretrained({str(args.folder)!r}, trust_remote_code=True).generate(...)\n"
          f"  pipeline('text-generation', model={str(args.folder)!r}, trust_remote_code=True)\n"
          f"  transformers serve --trust-remote-code  (requests naming the folder as their model)")
    return 0


def _install(args) -> int:
    from ..hub_cache import install_folder, install_hub_cache

    if args.folder is None and args.repo is None:
        install_hub_cache(args.cache_dir, org=args.org, methods=args.methods)
        return 0
    if args.folder is None or args.repo is None:
        raise ValueError("Placing a model folder in the cache takes both --folder and --repo.")
    print(f"installed {args.repo} -> {install_folder(args.folder, args.repo, args.cache_dir)}")
    return 0


def _publish(args) -> int:
    from ..hub_cache import publish

    publish(org=args.org, methods=args.methods, token=args.token, private=args.private, dry_run=args.dry_run,
            folder=args.folder, repo_id=args.repo)
    return 0
