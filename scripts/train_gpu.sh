#!/usr/bin/env bash
# The GPU route of docs/training.md: build the ShareGPT corpus (every usable conversation, the held-out split, the
# frozen target's features) and train EAGLE-3 on it, on one GPU, inside a time budget. Every stage resumes: run the
# same command again (or on another machine, with the corpus folder copied) to go on.
#
#   scripts/train_gpu.sh [OUT]            (default OUT: runs/gpu)
#
# Environment (all optional):
#   BUDGET_MINUTES  wall-clock minutes for everything (default 14: a 15-minute device lease)
#   ANSWERS         original | regenerated (default original: see docs/training.md, "Which answers")
#   LIMIT           training conversations (default: all ~17,000)
#   HELDOUT         held-out conversations evaluated (default 200)
#   INIT_FROM       a drafter folder to continue from (default: from scratch)
#   BATCH, LR, EPOCHS, TTT   batch size (default 16), peak learning rate (5e-4), passes (4), training-time-test steps
#   HF_SPECDEC      the command (default: hf-specdec; e.g. "python3 -m hf_specdec.cli")
#   MODEL           a target path or Hub id (default: the embedded SmolLM2-135M-Instruct)
#
# At the end the drafter is cut into pieces of at most 15 MiB in OUT/pieces (the device tool brings back files of
# at most 16 MiB): join them with `cat OUT/pieces/model.safetensors.part-* > model.safetensors`.
set -euo pipefail

OUT=${1:-runs/gpu}
BUDGET=${BUDGET_MINUTES:-14}
ANSWERS=${ANSWERS:-original}
HF=${HF_SPECDEC:-hf-specdec}
START=$(date +%s)
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} PYTHONUNBUFFERED=1

args=()
[ -n "${LIMIT:-}" ] && args+=(--limit "$LIMIT")
[ -n "${MODEL:-}" ] && args+=(--target "$MODEL")
echo "== corpus ($ANSWERS answers) -> $OUT/corpus"
$HF data build --out "$OUT/corpus" --answers "$ANSWERS" --heldout-limit "${HELDOUT:-200}" --batch-size 256 "${args[@]}"

data=train.json
[ "$ANSWERS" = regenerated ] && data=train-regen.json
left=$(python3 -c "import time; print(round(max(1.0, $BUDGET - (time.time() - $START) / 60 - 1.5), 2))")
echo "== EAGLE-3 training, $left minutes -> $OUT/eagle3"
train=(--data "$OUT/corpus/$data" --features "$OUT/corpus/features-train"
       --eval-features "$OUT/corpus/features-heldout" --eval-every 1000 --samples 100000000 --max-length 384
       --batch-size "${BATCH:-16}" --grad-accum 1 --lr "${LR:-5e-4}" --epochs "${EPOCHS:-4}" --save-every 500
       --max-minutes "$left")
[ -n "${INIT_FROM:-}" ] && train+=(--init-from "$INIT_FROM")
[ -n "${MODEL:-}" ] && train+=(--target "$MODEL")
$HF train eagle3 --out "$OUT/eagle3" "${train[@]}"

mkdir -p "$OUT/pieces"
split -b 15M "$OUT/eagle3/final/model.safetensors" "$OUT/pieces/model.safetensors.part-"
cp "$OUT/eagle3/final/config.json" "$OUT/eagle3/log.jsonl" "$OUT/pieces/"
echo "== done in $(( ($(date +%s) - START) / 60 )) min; pieces in $OUT/pieces:"
ls -l "$OUT/pieces"
