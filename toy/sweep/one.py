# lopti.main, with every scored completion's answer appended to ANSWERS (for the modal share).
import sys, json, re
sys.path.insert(0, "/tmp/sweep/code")
import lopti
answers_path = sys.argv[1]
original = lopti.score
def score(cfg, completions, solutions):
    rewards = original(cfg, completions, solutions)
    answers = []
    for c in completions:
        m = re.search(r"<answer>(.*?)</answer>", c, re.S)
        roles = tuple(re.findall(r"(knight|knave)", m.group(1).lower())) if m else None
        answers.append(" ".join(roles) if roles else None)
    with open(answers_path, "a") as f:
        f.write(json.dumps({"n": len(completions), "answers": answers,
                            "solutions": [" ".join(re.findall(r"(knight|knave)", s)) for s in solutions],
                            "rewards": rewards.tolist()}) + "\n")
    return rewards
lopti.score = score
sys.exit(lopti.main(sys.argv[2:]))
