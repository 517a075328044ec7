#!/usr/bin/env bash
# Two short MoE RL runs, identical except train.router_replay (off vs r3, Rollout Routing Replay), then
# `tandem report compare` puts their curves side by side: OUT/compare/compare.md (+ PNGs, compare.json).
#
# Usage: scripts/moe_r3_compare.sh [OUT]           (default OUT: runs/moe-r3-$MOE_KIND)
# Environment:
#   MOE_KIND=upcycled (default)  the shipped dense model sparse-upcycled to 8 experts, top-2
#                                (scripts/upcycle_moe.py, written to OUT/model): it solves some tasks, so
#                                rewards vary, advantages are non-zero and the trainer really updates.
#   MOE_KIND=random              the tiny random-init MoE of docs/results.md (models/tandem-moe): fast, but in a
#                                trial run it scored reward 0 at every step, so every gradient was zero and
#                                only the mismatch and routing curves carried information.
#   STEPS=8                      optimizer steps per run.
#   MODE=async (default) | sync  orchestrator.mode; sync trains every batch on the weights that sampled it,
#                                so the mismatch is numerics and routing only, without policy lag.
# Both runs: smoke preset, same seeds, partial-credit reward, lr 1e-4, 2 epochs per step (the second update's
# PPO ratio is off-policy), icepop (so zero-advantage trajectories are still forwarded and measured).
# About 3-4 minutes per run (upcycled) or 1 minute (random) on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."

KIND="${MOE_KIND:-upcycled}"
OUT="${1:-runs/moe-r3-$KIND}"
STEPS="${STEPS:-8}"
MODE="${MODE:-async}"
PY=.venv/bin/python
TANDEM=.venv/bin/tandem

case "$KIND" in
  upcycled)
    MODEL="$OUT/model"
    if [ ! -f "$MODEL/config.json" ]; then
      "$PY" scripts/upcycle_moe.py models/tandem-base "$MODEL"
    fi
    ;;
  random)
    MODEL=models/tandem-moe
    if [ ! -f "$MODEL/config.json" ]; then
      "$PY" -c "from tandem.model import write_model_dir; write_model_dir('$MODEL')"
    fi
    ;;
  *)
    echo "error: MOE_KIND must be upcycled or random, got '$KIND'" >&2
    exit 2
    ;;
esac

common=(
  --preset smoke
  --set "model.path=$MODEL"
  --set "orchestrator.steps=$STEPS"
  --set "orchestrator.mode=$MODE"
  --set reward.kind=fraction
  --set train.lr=1e-4
  --set train.epochs=2
  --set train.is_correction=icepop
  --set train.seed=0
  --set tasks.seed=0
)
if [ "$KIND" = random ]; then
  common+=(--set tasks.max_turns=2 --set rollout.max_new_tokens=64)
fi

for replay in off r3; do
  rm -rf "${OUT:?}/$replay"
  echo "== train.router_replay=$replay -> $OUT/$replay"
  "$TANDEM" train "${common[@]}" --run-dir "$OUT/$replay" --set "train.router_replay=$replay"
done
"$TANDEM" report compare "$OUT/off" "$OUT/r3" --out "$OUT/compare"
cat "$OUT/compare/compare.md"
