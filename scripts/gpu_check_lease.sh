#!/usr/bin/env bash
# Issue 51's GPU run, prepared for a lent device machine (this project's `device` tool: torch there, transformers
# older than the tested range, no registry, at most 64 MiB of files a call). Two steps:
#
#   scripts/gpu_check_lease.sh pack    here: transformers 5.24's wheel and hf_specdec's (without the shipped drafters)
#                                      into .gpu51/ (git ignores it locally), about 12 MiB
#   scripts/gpu_check_lease.sh run     there (carry .gpu51): installs both into /tmp/site, then within BUDGET_S seconds
#                                      (default 480) `pytest --device cuda` on the losslessness tests (every
#                                      fixed-shape drafter's CUDA graphs included) and `benchmarks/gpu.py --compile both`; logs,
#                                      gpu_bench.json and gpu_bench.md to $OUT
#
# Move the shipped drafters (hf_specdec/drafters/*/model.safetensors) out of the tree for the call: they travel as
# tracked files. A dry run on the CPU: DEVICE=cpu BENCH="--tiny" scripts/gpu_check_lease.sh run.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/gpu51-out}

case "${1:-}" in
pack)
    cd "$here" || exit 1
    grep -qx '/.gpu51/' .git/info/exclude 2>/dev/null || printf '/.gpu51/\n' >> .git/info/exclude
    rm -rf .gpu51 && mkdir -p .gpu51
    python3 -m pip download -q --no-deps -d .gpu51 transformers==5.24.0 || exit 1
    src=$(mktemp -d) && cp -r setup.py README.md hf_specdec modeling conversions "$src"/ || exit 1
    rm -f "$src"/hf_specdec/drafters/*/model.safetensors && find "$src" -name __pycache__ -prune -exec rm -rf {} +
    python3 -m pip wheel -q --no-deps -w .gpu51 "$src" || exit 1
    du -sh .gpu51 && ls .gpu51
    ;;
run)
    device=${DEVICE:-cuda}
    budget=${BUDGET_S:-480}
    mkdir -p "$out"
    [ "$device" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$here"/.gpu51/*.whl || exit 1
    export PYTHONPATH=/tmp/site
    # the tests run from a copy without the source package: the repository's hf_specdec/ would shadow the wheel's
    rm -rf /tmp/gpu51 && mkdir -p /tmp/gpu51 && cp -r "$here/tests" "$here/pytest.ini" "$here/benchmarks" /tmp/gpu51/
    cd /tmp/gpu51 || exit 1
    python3 -c "import torch, transformers, hf_specdec; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'hf_specdec', hf_specdec.__file__)" | tee "$out/versions.txt"
    start=$(date +%s)
    timeout $((budget / 2)) python3 -m pytest -q -p no:cacheprovider --device "$device" tests/test_compile.py \
        tests/test_on_device.py tests/test_coupled.py tests/test_lossless.py -x --durations=10 2>&1 \
        | tail -60 > "$out/pytest.txt"
    echo "pytest exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$out/pytest.txt"
    left=$(( budget - ($(date +%s) - start) - 20 ))
    timeout "$left" python3 benchmarks/gpu.py --compile both --tau 4 --out "$out/bench" ${BENCH:-} \
        --time-limit $((left - 30)) 2>&1 | tail -40 > "$out/bench.txt"
    echo "gpu.py exit ${PIPESTATUS[0]}" | tee -a "$out/bench.txt"
    ls -l "$out" "$out/bench" 2>/dev/null
    ;;
*)
    sed -n 2,13p "$0"; exit 2 ;;
esac
