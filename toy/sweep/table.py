# The sweep's table (toy/README), from SETTING/sS/{config.json,metrics.jsonl} and SETTING/answers_sS.jsonl
import json, collections, statistics as st, sys
from pathlib import Path
root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
LABEL = {"base": "GRPO, 0.7", "arlopti": "AR+Lopti, 0.7", "arlopti_t10": "AR+Lopti, 1.0"}


def f(x, spec=".2f"):  # .53, −.50
    return format(x, spec).replace("0.", ".", 1).replace("-", "−")


print("| method, temperature | seed | steps without spread | modal answer, steps 6-8 (step 0) "
      "| reward, step 1 → 6-8 | accuracy, step 0 → 8 (p) |")
print("|---|---|---|---|---|---|")
for name, label in LABEL.items():
    for run in sorted((root / name).glob("s*")):
        recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
        steps = [r for r in recs if "reward" in r]
        evals = {r["step"]: r for r in recs if "eval/accuracy" in r}
        cfg = json.load(open(run / "config.json"))
        n = cfg["prompts_per_step"] * cfg["num_generations"]
        answers = [json.loads(line) for line in open(root / name / f"answers_{run.name}.jsonl")]
        first = next(i for i, a in enumerate(answers) if a["n"] == n)  # before it: step 0's evaluation
        greedy = collections.Counter(x for a in answers[:first] for x in a["answers"])
        greedy_modal = greedy.most_common(1)[0][1] / sum(greedy.values())
        modal = []
        for a in [a for a in answers if a["n"] == n][-3:]:
            counts = collections.Counter(x for x in a["answers"] if x is not None)
            modal.append((counts.most_common(1)[0][1] if counts else 0) / n)
        flat = sum(r["zero_std_groups"] == 1 for r in steps)
        late = st.mean(r["reward"] for r in steps[-3:])
        e0, e8 = evals[0], evals[8]
        print(f"| {label} | {run.name[1:]} | {flat} of {len(steps)} | {f(st.mean(modal))} ({f(greedy_modal)}) "
              f"| {f(steps[0]['reward'], '+.2f')} → {f(late, '+.2f')} | {f(e0['eval/accuracy'], '.3f')} → "
              f"{f(e8['eval/accuracy'], '.3f')} ({f(e8['eval/gain_p'], '.3f')}) |")
