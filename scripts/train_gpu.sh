#!/usr/bin/env bash
# The GPU route of docs/training.md: the ShareGPT corpus (every usable conversation, the held-out split, the frozen
# target's features, computed batched on the GPU) and the drafters trained on it side by side, one process each, on
# one GPU inside a time budget; then each drafter cut into pieces small enough for a tool that brings files back.
# Every stage resumes: run the same command again (or elsewhere, with OUT copied) to go on.
#
#   scripts/train_gpu.sh [OUT]            (default OUT: runs/gpu)
#
# Environment (all optional):
#   BUDGET_MINUTES  wall-clock minutes for everything (default 14: a 15-minute device lease)
#   METHODS         drafters trained side by side (default "eagle3"; e.g. "eagle3 dflash mtp"): the host's
#                   launches, not the GPU, bound each one; each gets its share of the host's cores (THREADS)
#   CORPUS          a corpus folder tokenized elsewhere (`hf-specdec data build --tokens-only`; its corpus.json and
#                   tokens-*.npz are copied into OUT/corpus): then no ShareGPT file is needed here, only features
#   ANSWERS         original | regenerated (default original: see docs/training.md, "Which answers")
#   LIMIT           training conversations (default: all ~14,700 usable ones)
#   HELDOUT         held-out conversations evaluated (default 200)
#   INIT_FROM       a drafter folder to continue from (one method only; default: from scratch)
#   BATCH, EPOCHS   batch size (default 16), passes at most (default 20: the time decides, see --fit-minutes)
#   THREADS         CPU threads of each training process (default: the cores / the methods)
#   LR_<method>     peak learning rate per method (defaults: eagle3 5e-4, dflash 5e-4, mtp 1e-3, medusa 1e-3)
#   HF_SPECDEC      the command (default: hf-specdec; e.g. "python3 -m hf_specdec.cli")
#   MODEL           a target path or Hub id (default: the embedded SmolLM2-135M-Instruct)
#
# The learning rate warms up and decays over the minutes left for training (--fit-minutes), so the drafters end
# annealed when the budget ends, whatever the GPU's speed. At the end each drafter (fp16) is cut into pieces of at
# most 15 MiB, OUT/pieces/<method>.safetensors.part-*, beside <method>-config.json and <method>-log.jsonl: join them
# with `cat OUT/pieces/eagle3.safetensors.part-* > model.safetensors`.
set -uo pipefail

OUT=${1:-runs/gpu}
BUDGET=${BUDGET_MINUTES:-14}
ANSWERS=${ANSWERS:-original}
METHODS=${METHODS:-eagle3}
HF=${HF_SPECDEC:-hf-specdec}
START=$(date +%s)
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} PYTHONUNBUFFERED=1
elapsed() { echo $(( $(date +%s) - START )); }

args=()
[ -n "${LIMIT:-}" ] && args+=(--limit "$LIMIT")
[ -n "${MODEL:-}" ] && args+=(--target "$MODEL")
mkdir -p "$OUT/corpus" "$OUT/pieces"
if [ -n "${CORPUS:-}" ]; then
    cp -n "$CORPUS"/corpus.json "$CORPUS"/tokens-*.npz "$OUT/corpus/"
fi
echo "== corpus ($ANSWERS answers) -> $OUT/corpus  [$(elapsed) s]"
$HF data build --out "$OUT/corpus" --answers "$ANSWERS" --heldout-limit "${HELDOUT:-200}" "${args[@]}" || exit 1

data=train.json
[ "$ANSWERS" = regenerated ] && data=train-regen.json
left=$(python3 -c "import time; print(round(max(1.0, $BUDGET - (time.time() - $START) / 60 - 1.5), 2))")
declare -A lr=([eagle3]=5e-4 [dflash]=5e-4 [mtp]=1e-3 [medusa]=1e-3)
# the host's cores shared out: three processes of 16 threads each on a 16-core host ran EAGLE-3 at 0.74 s a step,
# one alone at 0.10 s (2026-12-04, H200 lease; docs/training.md)
count=$(wc -w <<< "$METHODS")
threads=${THREADS:-$(( $(nproc) / count > 0 ? $(nproc) / count : 1 ))}
pids=()
for m in $METHODS; do
    rate_var="LR_$m"
    rate=${!rate_var:-${lr[$m]:-5e-4}}
    echo "== $m training, $left minutes, lr $rate -> $OUT/$m  [$(elapsed) s]"
    train=(--data "$OUT/corpus/$data" --features "$OUT/corpus/features-train"
           --eval-features "$OUT/corpus/features-heldout" --eval-every 1000 --samples 100000000 --max-length 384
           --batch-size "${BATCH:-16}" --grad-accum 1 --lr "$rate" --epochs "${EPOCHS:-20}" --save-every 500
           --log-every 50 --max-minutes "$left" --fit-minutes)
    [ -n "${INIT_FROM:-}" ] && train+=(--init-from "$INIT_FROM")
    [ -n "${MODEL:-}" ] && train+=(--target "$MODEL")
    OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads $HF train "$m" --out "$OUT/$m" "${train[@]}" > "$OUT/$m.log" 2>&1 &
    pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { status=1; echo "!! a training process ended with an error: see $OUT/*.log"; }
done

for m in $METHODS; do
    final="$OUT/$m/final"
    tail -c 2000 "$OUT/$m.log" | tr '\r' '\n' | tail -4
    [ -f "$final/model.safetensors" ] || { echo "!! $m: no final/ model"; status=1; continue; }
    split -b 15M "$final/model.safetensors" "$OUT/pieces/$m.safetensors.part-"
    cp "$final/config.json" "$OUT/pieces/$m-config.json"
    cp "$OUT/$m/log.jsonl" "$OUT/pieces/$m-log.jsonl" 2>/dev/null
done
echo "== done in $(elapsed) s; pieces in $OUT/pieces:"
ls -l "$OUT/pieces"
exit $status
