#!/bin/bash
# The laptop runs, one at a time on 2 cores: per seed the cpu preset's warm-up once (warm.py),
# then each method's 20 RL steps from that checkpoint-0. Usage: toy/laptop/run.sh MODEL OUT
# (MODEL: SmolLM2-135M-Instruct, a hub id or a local folder). Run from the repository root.
set -e
model=$1; out=$2
mkdir -p "$out/logs"
method() { name=$1; seed=$2; shift 2
  [ -f "$out/$name/done" ] && return
  rm -rf "$out/$name"
  /usr/bin/time -f "wall %e s" python lopti.py train --preset cpu --seed "$seed" \
    --model "$out/warm_s$seed/checkpoint-0" --output_dir "$out/$name" "$@" \
    > "$out/logs/$name.log" 2>&1
  touch "$out/$name/done"
}
for seed in 0 1; do
  [ -f "$out/warm_s$seed/checkpoint-0/trainer_state.pt" ] ||
    /usr/bin/time -f "wall %e s" python toy/laptop/warm.py "$model" "$seed" \
      "$out/warm_s$seed" > "$out/logs/warm_s$seed.log" 2>&1
  method arlopti_s$seed "$seed"
  if [ "$seed" = 0 ]; then
    method grpo2_s0 0 --alpha 0 --lopti false --num_iterations 2
    method lopti_s0 0 --alpha 0
  fi
  method grpo_s$seed "$seed" --alpha 0 --lopti false
done
