#!/bin/bash
# Stopped after `run base` (GRPO, 16:55): sweep2.sh ran the preset's method, AR+Lopti, instead.
# settings in priority order; 3 seeds each; GRPO; 8 steps; eval at 0 and 8
here=$(dirname "$(readlink -f "$0")")
cd /tmp/sweep
for s in 0 1 2; do
  # ran as warm.py (509fa52), which is toy/laptop/warm.py with its model path written in
  [ -d warm/s$s/checkpoint-0 ] ||
    python "$here/../laptop/warm.py" /tmp/smol135 $s warm/s$s > logs/warm_s$s.log 2>&1
done
run() { name=$1; shift
  for s in 0 1 2; do
    out=runs/$name/s$s
    [ -f $out/done ] && continue
    rm -rf $out; mkdir -p runs/$name
    /usr/bin/time -v python one.py runs/$name/answers_s$s.jsonl train --preset cpu \
      --model warm/s$s/checkpoint-0 --seed $s --alpha 0 --lopti false --steps 8 --eval_every 8 \
      --save_every 8 --measure_update false --output_dir $out "$@" > logs/${name}_s$s.log 2>&1 \
      && touch $out/done
  done
}
run base
run t10 --temperature 1.0
run lr2e-5 --learning_rate 2e-5
run g16 --num_generations 16 --mini_batch_size 64
