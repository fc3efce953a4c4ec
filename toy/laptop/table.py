# The laptop runs' table (toy/README), from RUN/metrics.jsonl.
# Usage: python toy/laptop/table.py [FOLDER]   (default: toy/laptop)
import json
import statistics
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)


def fmt(x, spec=".2f"):  # .53, −.50
    return format(x, spec).replace("0.", ".", 1).replace("-", "−")


print("| run | steps without spread | reward, step 1 → 16-20 "
      "| accuracy, step 0 → 10 → 20 (gain, p) | s a step: rollout; π_old, update, Figure 3 |")
print("|---|---|---|---|---|")
format_errors = []
for run in sorted(p for p in root.iterdir() if (p / "config.json").exists()):
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in records if "reward" in r]
    evals = {r["step"]: r for r in records if "eval/accuracy" in r}
    late = [r for r in steps if r["step"] > 15]
    format_errors.append(max(r["format_error"] for r in late))
    flat = sum(r["zero_std_groups"] == 1 for r in steps)
    updated = [r for r in steps if r["zero_std_groups"] < 1]  # (the others skip the update)
    rollout = statistics.mean(r["time/rollout"] for r in steps)
    old_logprobs = statistics.mean(r["time/logprobs"] for r in updated)
    update = statistics.mean(sum(v for k, v in r.items() if k.startswith("time/update"))
                             for r in updated)
    measure = statistics.mean(r["time/measure"] for r in updated)
    accuracy = " → ".join(fmt(evals[s]["eval/accuracy"], ".3f") for s in sorted(evals))
    last = evals[max(evals)]
    print(f"| {run.name} | {flat} of {len(steps)} "
          f"| {fmt(steps[0]['reward'], '+.2f')} → "
          f"{fmt(statistics.mean(r['reward'] for r in late), '+.2f')} | {accuracy} "
          f"({fmt(last['eval/gain'], '+.3f')}, {fmt(last['eval/gain_p'], '.2f')}) "
          f"| {rollout:.0f}; {old_logprobs:.0f}, {update:.0f}, {measure:.0f} |")
print("format errors, steps 16-20:", max(format_errors), "at most")
