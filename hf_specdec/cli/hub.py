"""``hf-specdec install-hub-cache`` and ``hf-specdec publish-hub``: the method folders placed in the local Hugging
Face cache, or uploaded to the Hub."""

from __future__ import annotations

from .common import _method_list, _method_list_help


def add_commands(add) -> None:
    """Adds the ``install-hub-cache`` and ``publish-hub`` commands through
    :func:`~hf_specdec.cli.build_parser`'s ``add``."""
    method_list_help = _method_list_help()

    p = add("install-hub-cache", "place the method folders in the local Hugging Face cache as hf_specdec/<method>")
    p.add_argument("--cache-dir", default=None, help="Hub cache folder (default: $HF_HUB_CACHE)")
    p.add_argument("--org", default="hf_specdec", help="the repositories' owner: <org>/<method>")
    p.add_argument("--methods", type=_method_list, default=None, metavar="M1,M2",
                   help=f"{method_list_help} (default: every registered method)")
    p.set_defaults(func=lambda a: _install(a))

    p = add("publish-hub", "upload the method folders to the Hub (needs network and a token)")
    p.add_argument("--org", default="hf_specdec", help="the repositories' owner: <org>/<method>")
    p.add_argument("--methods", type=_method_list, default=None, metavar="M1,M2",
                   help=f"{method_list_help} (default: every registered method)")
    p.add_argument("--token", default=None, help="a Hub write token (default: the one saved by 'hf auth login')")
    p.add_argument("--private", action="store_true", help="create private repositories")
    p.add_argument("--dry-run", action="store_true", help="print what would be uploaded, upload nothing")
    p.set_defaults(func=lambda a: _publish(a))


def _install(args) -> int:
    from ..hub_cache import install_hub_cache

    install_hub_cache(args.cache_dir, org=args.org, methods=args.methods)
    return 0


def _publish(args) -> int:
    from ..hub_cache import publish

    publish(org=args.org, methods=args.methods, token=args.token, private=args.private, dry_run=args.dry_run)
    return 0
