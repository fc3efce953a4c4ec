# The sweep's table (toy/README), from SETTING/sS/{config.json,metrics.jsonl} and
# SETTING/answers_sS.jsonl: a row per setting, each cell seeds 0, 1, 2.
import json, collections, statistics as st, sys
from pathlib import Path
root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
LABEL = {"base": "GRPO, 0.7", "arlopti": "AR+Lopti, 0.7", "arlopti_t10": "AR+Lopti, 1.0"}


def f(x, spec=".2f"):  # .53, −.50
    return format(x, spec).replace("0.", ".", 1).replace("-", "−")


def seed_row(root, name, run):
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in recs if "reward" in r]
    evals = {r["step"]: r for r in recs if "eval/accuracy" in r}
    cfg = json.load(open(run / "config.json"))
    n = cfg["prompts_per_step"] * cfg["num_generations"]
    answers = [json.loads(line) for line in open(root / name / f"answers_{run.name}.jsonl")]
    first = next(i for i, a in enumerate(answers) if a["n"] == n)  # before it: step 0's evaluation
    greedy = collections.Counter(x for a in answers[:first] for x in a["answers"])
    modal = []
    for a in [a for a in answers if a["n"] == n][-3:]:
        counts = collections.Counter(x for x in a["answers"] if x is not None)
        modal.append((counts.most_common(1)[0][1] if counts else 0) / n)
    return {"flat": str(sum(r["zero_std_groups"] == 1 for r in steps)),
            "modal": f(st.mean(modal)),
            "modal_0": f(greedy.most_common(1)[0][1] / sum(greedy.values())),
            "reward_1": f(steps[0]["reward"], "+.2f"),
            "reward_late": f(st.mean(r["reward"] for r in steps[-3:]), "+.2f"),
            "accuracy_0": f(evals[0]["eval/accuracy"], ".3f"),
            "accuracy": f"{f(evals[8]['eval/accuracy'], '.3f')} ({f(evals[8]['eval/gain_p'], '.3f')})"}


rows = {label: [seed_row(root, name, run) for run in sorted((root / name).glob("s*"))]
        for name, label in LABEL.items()}
first = rows["GRPO, 0.7"]
print("Step 0 (the warm-up's, seeds 0, 1, 2): accuracy",
      ", ".join(r["accuracy_0"] for r in first) + "; modal answer",
      ", ".join(r["modal_0"] for r in first))
print("| method, temperature | steps without spread, of 8 | modal answer, steps 6-8 "
      "| reward, step 1 → 6-8 | accuracy, step 8 (p) |")
print("|---|---|---|---|---|")
for label, seeds in rows.items():
    cells = {key: ", ".join(r[key] for r in seeds) for key in seeds[0]}
    print(f"| {label} | {cells['flat']} | {cells['modal']} | {cells['reward_1']} → "
          f"{cells['reward_late']} | {cells['accuracy']} |")
