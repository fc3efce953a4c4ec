# The cpu preset's warm-up, once per seed, exactly as `train --preset cpu` runs it, kept as a
# run's checkpoint-0 so that every method of that seed starts RL from the same weights.
# Usage (from the repository root): python toy/laptop/warm.py MODEL SEED OUT (OUT/checkpoint-0)
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lopti

model_path, seed, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
cfg = lopti.Config(**{**lopti.PRESETS["cpu"], "model": model_path, "seed": seed})
device = lopti.pick_device()
torch.manual_seed(cfg.seed)
train_rows, eval_rows = lopti.load_task_data(cfg)
model, tokenizer, ref_model = lopti.load_policy(cfg, device)
lopti.warm_up(cfg, model, tokenizer, device, rows=lopti.warmup_puzzles(cfg, eval_rows))
out.mkdir(parents=True, exist_ok=True)
lopti.save_checkpoint(out, model, tokenizer, optimizer=lopti.make_optimizer(model, cfg), step=0)
print("warmed up:", out / "checkpoint-0")
