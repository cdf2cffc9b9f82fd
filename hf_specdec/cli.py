"""The ``hf-specdec`` command."""
import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hf-specdec")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install-hub-cache", help="place the method folders in the local Hugging Face cache")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--org", default="hf_specdec")
    args = parser.parse_args(argv)
    if args.command == "install-hub-cache":
        from .hub_cache import install_hub_cache
        install_hub_cache(args.cache_dir, org=args.org)
    return 0


if __name__ == "__main__":
    sys.exit(main())
