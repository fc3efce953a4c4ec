#!/bin/bash
# after base/s2 (GRPO): the preset's own method, AR+Lopti, base then temperature 1.0
cd /tmp/sweep
while kill -0 7436 2>/dev/null; do sleep 5; done
grep -q "^done:" logs/base_s2.log && touch runs/base/s2/done
run() { name=$1; shift
  for s in 0 1 2; do
    out=runs/$name/s$s
    [ -f $out/done ] && continue
    rm -rf $out runs/$name/answers_s$s.jsonl; mkdir -p runs/$name
    /usr/bin/time -v python one.py runs/$name/answers_s$s.jsonl train --preset cpu \
      --model warm/s$s/checkpoint-0 --seed $s --steps 8 --eval_every 8 \
      --save_every 8 --measure_update false --output_dir $out "$@" > logs/${name}_s$s.log 2>&1 \
      && touch $out/done
  done
}
run arlopti
run arlopti_t10 --temperature 1.0
