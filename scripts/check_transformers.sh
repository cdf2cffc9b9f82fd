#!/usr/bin/env bash
# Run the losslessness tests against another transformers release (default 5.25.0).
#
#   scripts/check_transformers.sh [VERSION] [-- PYTEST ARGS]
#
# Builds (once) a second venv, .venv-transformers-VERSION, that holds only that transformers wheel (installed with
# --no-deps) and an editable install of this checkout; every other package comes from the first venv (.venv, or
# BASE_VENV) through a .pth line, so nothing else is downloaded. Then runs the tests below in it with -x -q.
# `kernels` is not installed (transformers 5.25 depends on it; installed with --no-deps it is missing): the run shows
# that the library, its loaders included, works without it.
set -euo pipefail

version="5.25.0"
if [[ $# -gt 0 && "$1" != "--" ]]; then version="$1"; shift; fi
[[ $# -gt 0 && "$1" == "--" ]] && shift

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${BASE_VENV:-$root/.venv}"
venv="$root/.venv-transformers-$version"

base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ ! -f "$venv/built" ]]; then
    echo "check_transformers: building $venv (transformers $version over $base)" >&2
    rm -rf "$venv"
    "$base/bin/python" -m venv "$venv"
    # its own (older) setuptools out: the editable install below builds with the first venv's
    "$venv/bin/python" -m pip uninstall -q -y setuptools
    # the wheel first, into an empty venv: pip then never sees (or tries to remove) the first venv's transformers
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "transformers==$version"
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # the first venv's packages, after this venv's own (a plain path: the first venv's .pth files, its editable
    # install of hf_specdec among them, are not run)
    echo "$base_site" > "$site/_base_venv.pth"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root"
    touch "$venv/built"
fi
"$venv/bin/python" - "$version" "$root" <<'PY'
import sys
import transformers, hf_specdec, hf_specdec.modeling
assert transformers.__version__ == sys.argv[1], transformers.__version__
assert hf_specdec.__file__.startswith(sys.argv[2]), hf_specdec.__file__
print(f"check_transformers: transformers {transformers.__version__} from {transformers.__file__}", file=sys.stderr)
PY

# the losslessness tests, each method's tests, draft models, the CPU kernels, the private-name scan, the real model
tests=(
    tests/test_lossless.py tests/test_fuzz.py tests/test_entry_points.py tests/test_sampling.py
    tests/test_eagle3.py tests/test_dflash.py tests/test_medusa.py tests/test_layerskip.py tests/test_mtp.py
    tests/test_suffix.py tests/test_lookahead.py tests/test_draft_models.py tests/test_kernels.py
    tests/test_transformers_names.py tests/test_errors.py tests/test_smollm2.py
)
# the converters' tests: their own code loads transformers models (the checkpoints they compare with), which 5.25
# without `kernels` refuses unless told (USE_HUB_KERNELS=NO, transformers' switch); the library's own loaders are
# checked without it above
conversions=(tests/test_mtp_conversions.py tests/test_medusa_conversions.py)
cd "$root"
export HF_HUB_OFFLINE=1
"$venv/bin/python" -m pytest -x -q "${tests[@]}" "$@"
USE_HUB_KERNELS=NO "$venv/bin/python" -m pytest -x -q "${conversions[@]}" "$@"
