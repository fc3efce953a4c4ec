# Warm up SmolLM2 once per seed exactly as `train --preset cpu` does, save as checkpoint-0.
import sys, torch
sys.path.insert(0, "/tmp/sweep/code")
import lopti
from pathlib import Path
seed = int(sys.argv[1]); out = Path(sys.argv[2])
cfg = lopti.Config(**{**lopti.PRESETS["cpu"], "model": "/tmp/smol135", "seed": seed})
device = lopti.pick_device()
torch.manual_seed(cfg.seed)
train_rows, eval_rows = lopti.load_task_data(cfg)
model, tok, ref = lopti.load_policy(cfg, device)
lopti.warm_up(cfg, model, tok, device, rows=lopti.warmup_puzzles(cfg, eval_rows))
out.mkdir(parents=True, exist_ok=True)
lopti.save_checkpoint(out, model, tok, optimizer=lopti.make_optimizer(model, cfg), step=0)
print("warmed", out)
