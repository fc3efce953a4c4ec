"""Tests of the Knights-and-Knaves section: solver, generator, loader, prompt and Logic-RL's reward.

Expectations come from the official rows in data/kk (see its README), from Logic-RL's reward code
(verl/utils/reward_score/kk.py, transcribed below as an independent reference) or are written by hand.
"""
import ast
import dataclasses
import itertools
import json
import random
import re
from pathlib import Path

import datasets
import pandas as pd
import pytest

import lopti
from lopti import (KK_MAX_REWARD, KK_SYSTEM_PROMPT, THINK_PREFIX, Config, constant_accuracy,
                   kk_generate, kk_load, kk_parse_solution, kk_prompt, kk_reward, kk_rewards,
                   kk_solve, load_task_data, sign_test_p)

DATA = Path(__file__).parent / "data" / "kk"
JSONL = {k: DATA / f"{k}ppl_20.jsonl" for k in range(3, 8)}
PARQUET = DATA / "3ppl_test_new.parquet"
PREAMBLE = ("A very special island is inhabited only by knights and knaves. Knights always tell the truth, "
            "and knaves always lie. ")
QUESTION = " So who is a knight and who is a knave?"
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def official_rows():
    """Every official row as a plain dict, read with json/pandas (not with kk_load)."""
    rows = [json.loads(line) for path in JSONL.values() for line in path.read_text().splitlines()]
    return rows + pd.read_parquet(PARQUET).to_dict("records")


def jsonl_rows(k=3):
    return [json.loads(line) for line in JSONL[k].read_text().splitlines()]


def wrap(answer):
    """A well-formed completion (pre-filled <think> included) whose answer block is `answer`."""
    return f"<think> reasoning </think><answer> {answer} </answer>"


# --- Logic-RL's reward (verl/utils/reward_score/kk.py), transcribed: the reference kk_reward must equal ---
def logic_rl_parse(solution_text):
    """parse_solution_text_format: per stripped non-empty line, the first name and role."""
    status = {}
    for line in solution_text.split("\n"):
        line = line.strip()
        if not line:
            continue
        match = re.search(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", line, re.IGNORECASE)
        if match:
            status[match.group(1)] = match.group(2).lower()
    return status


def logic_rl_score(solution_str, solution_text_format):
    """compute_score(format_reward=1) on the decoded prompt + response, as Logic-RL calls it."""
    gt = logic_rl_parse(solution_text_format)
    if "Assistant:" in solution_str:
        processed = solution_str.split("Assistant:", 1)[1]
    elif "<|im_start|>assistant" in solution_str:
        processed = solution_str.split("<|im_start|>assistant", 1)[1]
    else:
        processed = solution_str
    matches = list(re.finditer(r"<answer>(.*?)</answer>", processed, re.DOTALL))
    answer = matches[-1].group(1).strip() if matches else None
    positions = [processed.find(tag) for tag in TAGS]
    format_ok = all(processed.count(tag) == 1 for tag in TAGS) and positions == sorted(positions)
    answer_score = -2
    if format_ok and answer:
        pred = {}
        if answer.lower().count("knight") + answer.lower().count("knave") == len(gt):
            for name in gt:
                m = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
                if not m:
                    pred = None
                    break
                pred[name] = m.group(1).lower()
        else:
            pred = None
        if pred:
            answer_score = 2 if pred == gt else -1.5
    return (1 if format_ok else -1) + answer_score


# --- an independent reader of the benchmark's English, used to check generated and official quizzes ---
def parse_quiz(quiz, names):
    """(statements, speech templates) read back from a quiz; asserts its fixed parts."""
    intro = f"You meet {len(names)} inhabitants: {', '.join(names[:-1])}, and {names[-1]}. "
    assert quiz.startswith(PREAMBLE + intro) and quiz.endswith(QUESTION)
    body = quiz[len(PREAMBLE + intro):-len(QUESTION)]
    who = "|".join(map(re.escape, names))
    leaf = rf"(?:{who}) is (?:not )?a (?:knight|knave)"
    spans = list(re.finditer(rf"If {leaf} then {leaf}|{leaf} (?:and|or|if and only if) {leaf}|{leaf}", body))
    assert len(spans) == len(names), body

    def read_leaf(text):
        m = re.fullmatch(rf"({who}) is (not )?a (knight|knave)", text)
        return m.group(2), ("telling-truth" if m.group(3) == "knight" else "lying", names.index(m.group(1)))

    statements = []
    for m in spans:
        text = m.group(0)
        if text.startswith("If "):
            a, b = text[3:].split(" then ")
            statements.append(("->", read_leaf(a)[1], read_leaf(b)[1]))
            continue
        for op, word in (("<=>", " if and only if "), ("and", " and "), ("or", " or ")):
            if word in text:
                a, b = text.split(word)
                statements.append((op, read_leaf(a)[1], read_leaf(b)[1]))
                break
        else:
            negated, lf = read_leaf(text)
            statements.append(("not", lf) if negated else lf)
    # the text between two statements is the end of one sentence and the start of the next
    gaps = [body[:spans[0].start()]] + [body[a.end():b.start()] for a, b in zip(spans, spans[1:])]
    gaps.append(body[spans[-1].end():])
    # a sentence ends at the first '.' (or '."') followed by a space; no opening contains one
    cuts = [("", gaps[0])] + [re.fullmatch(r'(.*?\."?) (.*)', g, re.S).groups() for g in gaps[1:-1]]
    cuts.append((gaps[-1], ""))
    templates = [(cuts[i][1] + "{content}" + cuts[i + 1][0]).replace(name, "{name}")
                 for i, name in enumerate(names)]
    return tuple(statements), templates


@pytest.fixture(scope="module")
def official_templates():
    """The speech templates the official quizzes use, read with parse_quiz."""
    return {t for r in official_rows() for t in parse_quiz(r["quiz"], list(r["names"]))[1]}


def leaves(stmt):
    """The leaves of a statement."""
    return [stmt] if stmt[0] in ("telling-truth", "lying") else [x for s in stmt[1:] for x in leaves(s)]


# --- solver and official rows ---
def test_official_rows_solve_uniquely_and_score_max():
    rows = official_rows()
    assert len(rows) == 200
    for r in rows:
        assert kk_solve(r["statements"]) == [list(r["solution"])]
        assert kk_solve(ast.literal_eval(r["statements"])) == [list(r["solution"])]  # tuple form too
        assert kk_reward(wrap(r["solution_text_format"]), r["solution_text_format"]) == KK_MAX_REWARD


def test_reader_reads_official_quizzes(official_templates):
    for r in official_rows():
        assert parse_quiz(r["quiz"], list(r["names"]))[0] == ast.literal_eval(r["statements"])
    assert len(official_templates) == 18  # the benchmark's speech styles, all seen in the rows


# Two leaves, x = "person 0 is a knight", y = "person 1 is a knave", in the worlds (T,T), (T,F), (F,T), (F,F)
X, Y = ("telling-truth", 0), ("lying", 1)
TRUTH_TABLES = {X: [1, 1, 0, 0], Y: [0, 1, 0, 1], ("not", X): [0, 0, 1, 1], ("and", X, Y): [0, 1, 0, 0],
                ("or", X, Y): [1, 1, 0, 1], ("->", X, Y): [0, 1, 1, 1], ("<=>", X, Y): [0, 1, 1, 0],
                ("not", ("<=>", X, Y)): [1, 0, 0, 1]}  # (nested)


@pytest.mark.parametrize("statement", list(TRUTH_TABLES), ids=str)
def test_truth_of_leaves_and_operators_by_hand(statement):
    worlds = [(True, True), (True, False), (False, True), (False, False)]
    assert [int(lopti._kk_true(statement, w)) for w in worlds] == TRUTH_TABLES[statement]


@pytest.mark.parametrize("statements, solutions", [
    # A: "B is a knave"; B: "A is a knight iff B is a knight" -> A knight, B knave
    ((("lying", 1), ("<=>", ("telling-truth", 0), ("telling-truth", 1))), [[True, False]]),
    # A: "I am a knave or B is a knave"; B: "I am a knight" -> A knight, B knave
    ((("or", ("lying", 0), ("lying", 1)), ("telling-truth", 1)), [[True, False]]),
    # A: "I am a knave and B is a knave" -> A knave, B knight
    ((("and", ("lying", 0), ("lying", 1)), ("telling-truth", 1)), [[False, True]]),
    # A: "If I am a knight then B is a knight" -> both knights
    ((("->", ("telling-truth", 0), ("telling-truth", 1)), ("telling-truth", 1)), [[True, True]]),
    # A: "B is not a knave"; B: "A is a knight or I am a knave" -> both knights
    ((("not", ("lying", 1)), ("or", ("telling-truth", 0), ("lying", 1))), [[True, True]]),
    # A: "I am a knight iff B is a knave"; B: "I am a knight" -> B knave, A either
    ((("<=>", ("telling-truth", 0), ("lying", 1)), ("telling-truth", 1)), [[True, False], [False, False]]),
    ((("telling-truth", 0),), [[True], [False]]),  # "I am a knight": both, in itertools.product order
    ((("lying", 0),), []),  # "I am a knave": no world
    # A: "I am a knight and B and C are knaves" (a 3-way and); B: "A is a knave"; C: "B is a knight"
    ("(('and', ('telling-truth', 0), ('lying', 1), ('lying', 2)), ('lying', 0), ('telling-truth', 1))",
     [[True, False, False], [False, True, True]]),
])
def test_solver_on_hand_made_puzzles(statements, solutions):
    assert kk_solve(statements) == solutions


def test_solver_parses_statements_as_a_literal_never_as_code():
    with pytest.raises(ValueError):
        kk_solve("__import__('os').system('true')")


# --- generator ---
@pytest.fixture(scope="module")
def generated():
    """300 generated puzzles of 3-7 people, shared by the generator tests."""
    return kk_generate(300, num_people=(3, 7), seed=1)


def test_generated_puzzles_are_valid_and_read_back(generated, official_templates):
    templates = set()
    for r in generated:
        statements = ast.literal_eval(r["statements"])
        assert repr(statements) == r["statements"]  # the official string form
        assert kk_solve(statements) == [r["solution"]]
        assert r["num_people"] == len(r["names"]) == len(statements) == len(set(r["names"]))
        read, used = parse_quiz(r["quiz"], r["names"])
        assert read == statements
        templates |= set(used)
        roles = ["a knight" if k else "a knave" for k in r["solution"]]
        parts = [f"{n} is {role}" for n, role in zip(r["names"], roles)]
        assert r["solution_text"] == ", ".join(parts[:-1]) + ", and " + parts[-1] + "."
        assert r["solution_text_format"] == "\n".join(f"({i + 1}) {p}" for i, p in enumerate(parts))
        for i, s in enumerate(statements):
            assert ("lying", i) not in leaves(s)  # nobody says "I am a knave", not even inside a compound
            assert s[0] in ("telling-truth", "lying") or len(leaves(s)) == len(s) - 1 <= 2
            assert s[0] not in ("and", "or", "->", "<=>") or s[1] != s[2]
    assert templates == official_templates
    assert {n for r in generated for n in r["names"]} == {n for r in official_rows() for n in r["names"]}
    assert len(set(generated["statements"])) == len(generated)  # no puzzle twice, as in the benchmark


def test_generated_cover_every_statement_type(generated):
    kinds = [s[0] for r in generated for s in ast.literal_eval(r["statements"])]
    share = {k: kinds.count(k) / len(kinds) for k in ("telling-truth", "lying", "not", "and", "or", "->", "<=>")}
    assert min(share.values()) > 0.04, share
    assert 0.08 < share["telling-truth"] + share["lying"] < 0.3, share  # ~1/6 before the uniqueness filter


def test_generator_schema_matches_official_rows(generated):
    row = jsonl_rows()[0]
    assert set(generated.column_names) == {"quiz", "names", "solution", "solution_text", "solution_text_format",
                                           "statements", "num_people"}
    assert set(generated.column_names) - {"num_people"} <= set(row)
    for c in ("quiz", "solution_text", "solution_text_format", "statements"):
        assert type(generated[0][c]) is type(row[c]) is str
    assert type(generated[0]["names"]) is type(row["names"]) is list
    assert type(generated[0]["solution"][0]) is type(row["solution"][0]) is bool


def test_generated_quizzes_read_back_through_kk_load(generated, tmp_path):
    path = tmp_path / "generated.jsonl"
    generated.to_json(str(path))
    assert kk_load(str(path)).to_list() == generated.to_list()


def test_generator_is_reproducible(generated):
    assert kk_generate(300, num_people=(3, 7), seed=1).to_list() == generated.to_list()
    assert kk_generate(20, num_people=(3, 7), seed=2)["quiz"] != generated["quiz"][:20]


def test_num_people_int_and_range():
    assert set(kk_generate(30, num_people=4)["num_people"]) == {4}
    assert set(kk_generate(200, num_people=(2, 8))["num_people"]) == set(range(2, 9))
    two = kk_generate(300, num_people=2)["statements"]  # few 2-person puzzles exist, yet none repeats
    assert len(set(two)) == 300
    with pytest.raises(ValueError, match="distinct 2-person puzzles"):
        kk_generate(5000, num_people=2)


# --- reward (Logic-RL's kk.py; totals: 3 correct, -0.5 wrong, -1 unreadable answer, -3 bad format) ---
GT = "(1) Amelia is a knight\n(2) Penelope is a knave\n(3) Evelyn is a knight"


@pytest.mark.parametrize("completion, expected", [
    (wrap("(1) Amelia is a knight\n(2) Penelope is a knave\n(3) Evelyn is a knight"), 3.0),
    (wrap("Amelia is a knight, Penelope is a knave, and Evelyn is a knight."), 3.0),
    (wrap("amelia IS A Knight\nPENELOPE is a KNAVE\nEvelyn is  a\nknight"), 3.0),
    (wrap("Evelyn is a knight. Penelope is a knave. Amelia is a knight."), 3.0),  # any order
    ("<think>\nA long thought.\n</think>\n<answer>\n" + GT + "\n</answer><|im_end|>", 3.0),
    (wrap("Amelia is a knight, Penelope is a knight, and Evelyn is a knight."), -0.5),  # one wrong
    (wrap("Amelia is a knave, Penelope is a knight, and Evelyn is a knave."), -0.5),  # all wrong
    (wrap("Amelia is a knight, Penelope is a knave, and Evelyn is a knight (no knave)."), -1.0),  # 4 words
    (wrap("Amelia is a knight, Penelope is a knave."), -1.0),  # a person missing
    (wrap("Amelia is knight, Penelope is a knave, and Evelyn is a knight."), -1.0),  # no article
    (wrap("Amelia: knight, Penelope: knave, Evelyn: knight"), -1.0),
    ("<think> r </think><answer></answer>", -1.0),  # empty answer
    ("<think> r </think><answer>  \n </answer>", -1.0),
    (" r </think><answer> " + GT + " </answer>", -3.0),  # <think> missing (prefix not prepended)
    ("<think> r <answer> " + GT + " </answer>", -3.0),  # </think> missing
    ("<think> r </think> " + GT + " </answer>", -3.0),  # <answer> missing
    ("<think> r </think><answer> " + GT, -3.0),  # truncated: no </answer>
    ("<think><think> r </think><answer> " + GT + " </answer>", -3.0),  # <think> re-opened
    ("<think> r </think><answer> " + GT + " </answer><answer> " + GT + " </answer>", -3.0),
    ("<think> the format ends with </answer> </think><answer> " + GT + " </answer>", -3.0),
    ("<think> r <answer> " + GT + " </answer></think>", -3.0),  # answer inside the thought
    ("</think><think> r <answer> " + GT + " </answer>", -3.0),  # wrong order
    ("<answer> " + GT + " </answer><think> r </think>", -3.0),
    ("", -3.0),
    (wrap("(.*)+[ Amelia is a knight \\1 Penelope is a knave (?P<x> Evelyn is a knight $^"), 3.0),
])
def test_reward_cases(completion, expected):
    assert kk_reward(completion, GT) == expected


def test_reward_reads_only_the_text_after_assistant():
    """Logic-RL scores the text after the first "Assistant:": tags before it do not count, nor does a <think>
    that the completion itself puts before an "Assistant:" of its own."""
    prompt = "System: use <think> </think> and <answer> </answer>. User: who is who? Assistant: "
    assert kk_reward(prompt + "<think> r </think><answer> " + GT + " </answer>", GT) == 3.0
    assert kk_reward("<think> Assistant: r </think><answer> " + GT + " </answer>", GT) == -3.0
    assert kk_reward("<think> r </think><answer> " + GT + " </answer> Assistant: more", GT) == -3.0


def test_reward_names_inside_other_names():
    gt = "(1) Jack is a knave\n(2) Jackson is a knight"
    assert kk_reward(wrap("Jackson is a knight, and Jack is a knave."), gt) == 3.0
    assert kk_reward(wrap("Jack is a knave, and Jackson is a knight."), gt) == 3.0
    assert kk_reward(wrap("Jackson is a knave, and Jack is a knight."), gt) == -0.5
    assert kk_reward(wrap("Jackson is a knight, and Jacky is a knave."), gt) == -1.0  # no "Jack is a ..."
    # "William is a knight" contains "liam is a knight": the \b before the name keeps Liam's role apart
    assert kk_reward(wrap("William is a knight, and Liam is a knave."),
                     "(1) Liam is a knave\n(2) William is a knight") == 3.0
    flipped = "(1) Jackson is a knave\n(2) Jack is a knight"
    assert kk_reward(wrap("Jack is a knight and Jackson is a knave"), flipped) == 3.0


def test_rewards_equal_logic_rl_on_random_completions():
    """kk_rewards on completions (after the pre-filled <think>) equals Logic-RL's compute_score on the official
    prompt + the same completion, on random mixtures of tags, names, roles and "Assistant:"."""
    rng, rows = random.Random(0), official_rows()
    official_prompt = rows[-1]["prompt"][0]["content"]  # (ends "<|im_start|>assistant\n<think>")
    pieces = ["<think>", "</think>", "<answer>", "</answer>", "Assistant:", " ", "\n", ", and ", " is a ", "knight",
              "knave", "Jack", " r "]
    completions, truths = [], []
    for _ in range(3000):
        truth = rng.choice(rows)["solution_text_format"]
        names = list(logic_rl_parse(truth))
        said = [f"{n} is a {rng.choice(['knight', 'knave'])}" for n in rng.sample(names, rng.randint(0, len(names)))]
        noise = lambda: "".join(rng.choice(pieces) for _ in range(rng.choice([0, 0, 0, 1, 2])))  # noqa: E731
        completions.append(f"{noise()} r </think>{noise()}<answer>{noise()} {', '.join(said)}{noise()}</answer>"
                           f"{noise()}")
        truths.append(truth)
        completions.append(f" r </think><answer> {truth} </answer>")  # correct (so every total occurs)
        truths.append(truth)
    rewards = kk_rewards(completions, truths)
    expected = [logic_rl_score(official_prompt + c, t) for c, t in zip(completions, truths)]
    assert rewards.tolist() == expected
    assert set(expected) == {3.0, -0.5, -1.0, -3.0}


def test_parse_solution_golden_and_equal_to_logic_rl_regex():
    """kk_parse_solution = Logic-RL's parse_solution_text_format: on the official rows and on random lines."""
    assert kk_parse_solution(GT) == {"Amelia": "knight", "Penelope": "knave", "Evelyn": "knight"}
    for r in official_rows():
        expected = logic_rl_parse(r["solution_text_format"])
        assert kk_parse_solution(r["solution_text_format"]) == expected
        assert list(expected) == list(r["names"])
    rng = random.Random(0)
    pieces = list("ab AZk_1é(),.\t\n") + ["knight", "knave", "Knave", " is a ", "Zoey"]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        assert kk_parse_solution(text) == logic_rl_parse(text), text


# --- loader ---
@pytest.fixture(scope="module")
def loaded():
    """Every official file read with kk_load, keyed by people count (and "parquet")."""
    return {k: kk_load(str(path)) for k, path in JSONL.items()} | {"parquet": kk_load(str(PARQUET))}


def test_load_official_files(loaded):
    raw = {k: jsonl_rows(k) for k in JSONL} | {"parquet": pd.read_parquet(PARQUET).to_dict("records")}
    for key, ds in loaded.items():
        assert ds.features == lopti.kk_generate(2, 3).features  # generated and loaded rows concatenate
        assert len(ds) == len(raw[key])
        for got, want in zip(ds, raw[key]):
            for col in ("quiz", "solution_text", "solution_text_format", "statements"):
                assert got[col] == want[col]
            assert got["names"] == list(want["names"]) and got["solution"] == list(want["solution"])
            assert got["num_people"] == len(want["names"])


def test_parquet_rows_match_jsonl_rows(loaded):
    by_quiz = {r["quiz"]: r for r in loaded[3]}
    shared = [r for r in loaded["parquet"] if r["quiz"] in by_quiz]
    assert len(shared) == 20
    assert all(r == by_quiz[r["quiz"]] for r in shared)


def test_load_logic_rl_rows_without_top_level_answer(tmp_path, loaded):
    """Logic-RL's rows keep the answer in reward_model.ground_truth; the rest is rebuilt from it."""
    path = tmp_path / "logic_rl.parquet"
    pd.read_parquet(PARQUET).drop(columns=["solution_text_format", "statements", "names", "solution",
                                            "solution_text"]).to_parquet(path)
    assert kk_load(str(path)).to_list() == loaded["parquet"].to_list()


def test_load_statements_given_as_json_lists(tmp_path, loaded):
    """A JSON file may hold the statements as nested lists: loaded as the official tuple's string."""
    rows = jsonl_rows()
    path = tmp_path / "lists.jsonl"
    path.write_text("".join(json.dumps(r | {"statements": ast.literal_eval(r["statements"])}) + "\n" for r in rows))
    assert kk_load(str(path)).to_list() == loaded[3].to_list()


def _flip_first_role(text_format):
    lines = text_format.split("\n")
    lines[0] = lines[0].replace("knight", "KNAVE").replace("knave", "knight").replace("KNAVE", "knave")
    return "\n".join(lines)


def _write(path, content):
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


MALFORMED = {  # file name -> content; None: no file
    "missing.jsonl": None,
    "notjson.jsonl": "not json\n",
    "truncated.jsonl": '{"quiz": "x", \n',
    "empty.jsonl": "",
    "garbage.parquet": b"PAR1 not really",
    "columns.jsonl": json.dumps({"question": "Who?", "answer": "Zoey is a knight"}) + "\n",
    "rows.csv": "quiz\nx\n",  # not a puzzle file (read as a hub dataset name, which offline is not reachable)
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_file_is_one_value_error_naming_it(tmp_path, name):
    if MALFORMED[name] is not None:
        _write(tmp_path / name, MALFORMED[name])
    with pytest.raises(ValueError) as err:
        kk_load(str(tmp_path / name))
    message = str(err.value)
    assert name in message and "\n" not in message, message


def test_zero_row_parquet_names_the_file(tmp_path):
    pd.read_parquet(PARQUET).iloc[:0].to_parquet(tmp_path / "zero.parquet")
    with pytest.raises(ValueError, match=r"zero\.parquet"):  # (datasets cannot read it, or it has no rows)
        kk_load(str(tmp_path / "zero.parquet"))


@pytest.mark.parametrize("change,field", [("role flipped", "statements"), ("no statements", "statements"),
                                          ("no quiz", "quiz"), ("a person more", "solution_text_format")])
def test_bad_row_is_one_value_error_naming_file_and_row(tmp_path, change, field):
    """Row 2 (counted from 1) is broken, rows 1 and 3 are fine: the error names the file, row 2 and the field."""
    rows = jsonl_rows()[:3]
    bad = dict(rows[1])
    if change == "role flipped":  # its statements no longer have its solution
        bad["solution_text_format"] = _flip_first_role(bad["solution_text_format"])
    elif change == "no statements":
        del bad["statements"]
    elif change == "no quiz":
        bad["quiz"] = ""
    else:
        bad["solution_text_format"] += "\n(4) Zoey is a knight"
    path = _write(tmp_path / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in (rows[0], bad, rows[2])))
    with pytest.raises(ValueError, match=rf"rows\.jsonl.*row 2\b.*field '{field}'") as err:
        kk_load(str(path))
    assert "\n" not in str(err.value)


def test_row_without_people_is_refused(tmp_path):
    row = {"quiz": "Who is who?", "statements": "()", "solution_text_format": "nobody", "solution_text": "nobody"}
    path = _write(tmp_path / "nobody.jsonl", json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"nobody\.jsonl.*row 1\b"):
        kk_load(str(path))


# --- task data ---
def test_load_task_data_keeps_evaluation_puzzles_out_of_training(capsys):
    """The official 3-person parquet holds the 20 puzzles of 3ppl_20.jsonl: evaluated on the other 80, with a note
    saying how many were dropped; an --eval_data wholly inside --train_data is one error."""
    train, evals = load_task_data(Config(train_data=str(JSONL[3]), eval_data=str(PARQUET)))
    assert len(train) == 20 and len(evals) == 80
    assert not set(train["quiz"]) & set(evals["quiz"])
    assert not set(train["statements"]) & set(evals["statements"])
    assert "note: 20 of 100 --eval_data puzzles are also in --train_data: not evaluated" in capsys.readouterr().out
    with pytest.raises(ValueError, match="every --eval_data puzzle is also in --train_data"):
        load_task_data(Config(train_data=str(JSONL[3]), eval_data=str(JSONL[3])))
    _, alone = load_task_data(Config(eval_data=str(PARQUET), num_people="3", num_train=40))  # nothing to drop
    assert len(alone) == 100 and "note:" not in capsys.readouterr().out


def test_load_task_data_generates_disjoint_sets_per_size():
    train, evals = load_task_data(Config(num_train=40, num_people="3-4", eval_size=5))
    assert len(train) == 40 and set(train["num_people"]) <= {3, 4}
    assert sorted(evals["num_people"]) == [3] * 5 + [4] * 5
    assert not set(train["quiz"]) & set(evals["quiz"])


def test_constant_accuracy_golden():
    """The best constant answer per size: 2 people, (knight, knave) 2 of 3; 3 people, any 1 of 2 -> 3/5."""
    rows = lambda solutions: datasets.Dataset.from_dict({"solution": solutions})  # noqa: E731
    assert constant_accuracy(rows([[True, False], [True, False], [False, False], [True, True, True],
                                   [False, False, False]])) == pytest.approx(3 / 5)
    assert constant_accuracy(rows([[True, True, False]] * 4)) == 1.0
    assert constant_accuracy(rows([[True, False], [False, True], [False, False, True]])) == pytest.approx(2 / 3)


# --- prompt ---
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN25 = (  # Qwen2.5-Instruct's template without its tools branch (the default system prompt included)
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiny_tokenizer(chat_template):
    """A word-level tokenizer made here (no download), with the given chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    hf.chat_template = chat_template
    return hf


@pytest.mark.parametrize("template", [CHATML, QWEN25], ids=["chatml", "qwen2.5"])
def test_prompt_with_chat_template_equals_official_prompt(template):
    tokenizer = tiny_tokenizer(template)
    rows = pd.read_parquet(PARQUET).to_dict("records")
    for r in rows:
        assert kk_prompt(tokenizer, r["quiz"]) == r["prompt"][0]["content"]
    official = rows[0]["prompt"][0]["content"]
    assert official.split("<|im_start|>system\n")[1].split("<|im_end|>")[0] == KK_SYSTEM_PROMPT
    assert official.endswith("<|im_start|>assistant\n" + THINK_PREFIX)


def test_prompt_without_chat_template_raises():
    """No silent plain-text prompt for a base model: the tokenizer's ValueError (main: one line, exit 2)."""
    with pytest.raises(ValueError, match="chat template|chat_template"):
        kk_prompt(tiny_tokenizer(None), "QUIZ TEXT")


def test_case_analysis_golden_and_every_demonstration_scores_3():
    """The warm-up's target: each assignment in the benchmark's order with the truth of each speaker's statement
    under it and whether that fits (knights true, knaves false), then the solution; Logic-RL's reward gives every
    demonstration 3."""
    statements = (("lying", 1), ("and", ("telling-truth", 0), ("telling-truth", 1)))
    row = {"names": ["Ann", "Bo"], "statements": repr(statements),
           "solution_text_format": "(1) Ann is a knight\n(2) Bo is a knave"}
    # Ann: "Bo is a knave"; Bo: "Ann and Bo are knights". Knight/knight: Ann false, Bo true. Knight/knave: Ann true,
    # Bo false: fits. Knave/knight: Ann false, Bo false. Knave/knave: Ann true, Bo false.
    assert lopti.kk_solve(row["statements"]) == [[True, False]]
    assert lopti.kk_case_analysis(row) == (
        " Ann knight, Bo knight: Ann says false, Bo says true: no. Ann knight, Bo knave: Ann says true, Bo says"
        " false: yes. Ann knave, Bo knight: Ann says false, Bo says false: no. Ann knave, Bo knave: Ann says true,"
        " Bo says false: no. </think><answer> (1) Ann is a knight\n(2) Bo is a knave </answer>")
    rows = lopti.kk_generate(30, (2, 5), seed=11)
    for i in range(len(rows)):
        r = {k: rows[k][i] for k in rows.column_names}
        analysis = lopti.kk_case_analysis(r)
        assert lopti.kk_reward(lopti.THINK_PREFIX + analysis, r["solution_text_format"]) == 3.0
        assert analysis.count(": yes.") == 1 and analysis.count(": no.") == 2 ** r["num_people"] - 1


# --- the evaluation apart from training, and McNemar's exact test of RL's gain over step 0


def test_evaluation_is_its_seeds_draw_and_training_and_the_warm_up_skip_its_puzzles():
    """2-person puzzles as the cpu preset draws them (256 training, 240 warm-up, 64 evaluated; 399 exist): the
    evaluation is kk_generate's plain draw from its own seed, and the training and warm-up puzzles are drawn around
    it, sharing none of its statements (the same draws without the exclusion would share some)."""
    cfg = Config(num_people="2", num_train=256, eval_size=64, warmup_steps=60, prompts_per_step=4, mini_batch_size=32)
    train, evals = load_task_data(cfg)
    assert evals["quiz"] == kk_generate(64, 2, seed=cfg.seed + 1_000_003 + 2)["quiz"]
    warm = lopti.warmup_puzzles(cfg, evals)
    evaluated = set(evals["statements"])
    assert len(train) == 256 and len(warm) == 240 and len(evaluated) == 64
    assert not evaluated & set(train["statements"]) and not evaluated & set(warm["statements"])
    assert evaluated & set(kk_generate(256, 2, seed=cfg.seed)["statements"])
    assert evaluated & set(kk_generate(240, 2, seed=cfg.seed + 2_000_003)["statements"])


def test_a_multi_size_evaluation_is_each_sizes_draw():
    """--num_people 3-4: eval_size puzzles of each size, each from its size's seed, none a training puzzle."""
    cfg = Config(num_people="3-4", num_train=40, eval_size=5, seed=7)
    train, evals = load_task_data(cfg)
    expected = [q for n in (3, 4) for q in kk_generate(5, n, seed=7 + 1_000_003 + n)["quiz"]]
    assert evals["quiz"] == expected and lopti.evaluation_rows(cfg)["quiz"] == expected
    assert not set(train["statements"]) & set(evals["statements"])


def test_sign_test_p_golden_values_and_an_enumeration_of_sign_flips():
    """McNemar's exact p by hand (9 gained, 1 lost: 2 * 11 / 1024; 6 and 0: 2 / 64; none changed: 1), and against an
    enumeration of every sign pattern of the changed puzzles' differences."""
    assert sign_test_p(9, 1) == pytest.approx(22 / 1024) and sign_test_p(1, 9) == sign_test_p(9, 1)
    assert sign_test_p(6, 0) == pytest.approx(2 / 64) and sign_test_p(0, 0) == 1.0 and sign_test_p(4, 4) == 1.0
    for gained, lost in ((3, 1), (7, 2), (5, 0), (2, 6)):
        diffs = [1] * gained + [-1] * lost
        patterns = list(itertools.product((1, -1), repeat=len(diffs)))
        extreme = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= abs(sum(diffs)) for signs in patterns)
        assert sign_test_p(gained, lost) == pytest.approx(extreme / len(patterns))


def test_paired_gain_on_hand_made_outcomes():
    """Before 1100110000, after 1011111000: puzzles 2, 3 and 6 gained, puzzle 1 lost; gain (3 - 1) / 10, and
    McNemar's p of 3 against 1: 2 * (1 + 4) / 16."""
    out = lopti.paired_gain("1100110000", "1011111000")
    assert out == {"eval/gain": pytest.approx(0.2), "eval/gained": 3, "eval/lost": 1,
                   "eval/gain_p": pytest.approx(sign_test_p(3, 1))}
    assert sign_test_p(3, 1) == pytest.approx(2 * 5 / 16)


def _bare_run(out, cfg, evaluations, monkeypatch, records):
    """A Run with only what evaluate_if_due reads; lopti.evaluate returns `records` in turn."""
    run = object.__new__(lopti.Run)
    run.cfg, run.out, run.evaluations = cfg, out, evaluations
    run.stop = lopti.StopOnSignal()  # (not entered: no handlers installed)
    run.stop.signum = 0
    run.model = run.tokenizer = run.eval_rows = run.device = None
    run.log = lopti.MetricsLog(out, cfg)
    queue = list(records)
    monkeypatch.setattr(lopti, "evaluate", lambda *args, **kwargs: dict(queue.pop(0)))
    return run, queue


def test_the_gain_is_logged_only_against_a_step_0_of_the_same_puzzles(tmp_path, monkeypatch):
    """Run.evaluate_if_due evaluates only steps due (0, every eval_every, the last), and pairs an evaluation with step
    0's only when both name the same puzzles (eval/puzzles): a step 0 that names none gets no gain."""
    cfg = Config(steps=30, eval_every=10)
    records = [{"eval/correct": "1100110000", "eval/puzzles": "abc"},
               {"eval/correct": "1011111000", "eval/puzzles": "abc"},
               {"eval/correct": "1011111000", "eval/puzzles": "xyz"}]
    run, queue = _bare_run(tmp_path, cfg, {}, monkeypatch, records)
    for step in (0, 5, 10, 20):
        run.evaluate_if_due(step)
    assert not queue  # three evaluations: step 5 is not due
    logged = lopti.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == [0, 10, 20] and "eval/gain" not in logged[0]
    assert logged[1]["eval/gain"] == pytest.approx(0.2) and logged[1]["eval/gained"] == 3
    assert "eval/gain" not in logged[2]
    run.evaluate_if_due(10)  # evaluated already (a resumed run's): not again
    assert len(lopti.read_jsonl(tmp_path / "metrics.jsonl")) == 3
    old = tmp_path / "old"
    old.mkdir()
    step_0 = {0: {"step": 0, "eval/correct": "1100110000"}}  # logged before eval/puzzles existed
    run, queue = _bare_run(old, cfg, step_0, monkeypatch, records[1:2])
    run.evaluate_if_due(30)
    assert not queue and "eval/gain" not in lopti.read_jsonl(old / "metrics.jsonl")[0]


def test_an_unknown_statement_operator_is_a_row_error(tmp_path):
    """A row whose statement uses an operator the benchmark has not ("xor") is refused, not read as another."""
    row = json.loads((DATA / "3ppl_20.jsonl").read_text().splitlines()[0])
    row["statements"] = [["xor", ["telling-truth", 1], ["lying", 2]], ["lying", 0], ["telling-truth", 0]]
    (tmp_path / "bad.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="row 1 is not a K&K puzzle: field 'statements': unknown statement 'xor'"):
        kk_load(str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize("name", ["cpu", "colab"])
def test_small_presets_find_their_puzzles_and_evaluate_on_at_least_64(name):
    """The laptop's and Colab's presets generate their training, warm-up and evaluation puzzles
    (distinct 2-person puzzles are few: 4,480 training puzzles over 2-3 people cannot be found), and
    evaluate on at least 64 puzzles, where one puzzle is 0.016 of accuracy."""
    cfg = lopti.Config(**lopti.PRESETS[name])
    train, evals = lopti.load_task_data(cfg)
    assert len(train) == cfg.num_train and len(evals) >= 64


# --- your own rows: every row checked at load for what the reward needs to score it


def _renamed(row, old, new):
    """The row with one person's name replaced everywhere (quiz, names, solution texts)."""
    text = json.dumps(row).replace(old, new)
    return json.loads(text)


@pytest.mark.parametrize("name", ["Zoë", "Mary-Jane", "Mary Ann", "Émile"])
def test_a_name_the_reward_cannot_read_is_refused_at_load(tmp_path, name):
    """Logic-RL's reward reads names of letters A-Z: "Zoë" would be read as "is", "Mary Ann" as "Mary", and the
    true answer score -1 (a row that silently teaches nothing). Refused, naming the field."""
    row = jsonl_rows()[0]
    bad = _renamed(row, row["names"][0], name)
    path = _write(tmp_path / "names.jsonl", json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"names\.jsonl.*row 2\b.*field 'solution_text_format'.*A-Z"):
        kk_load(str(path))
    assert kk_reward(wrap(bad["solution_text_format"]), bad["solution_text_format"]) != KK_MAX_REWARD


@pytest.mark.parametrize("people", ["Zoey Zoey", "Zoey zoey", "Zoey", "A B C D E F G H I"])
def test_people_must_be_2_to_8_distinct_ignoring_case(tmp_path, people):
    """The reward matches names ignoring case: "Zoey" twice, or "Zoey" and "zoey", would be one person to it. One,
    or nine people (more than the benchmark's 8), are refused too; the error names the names."""
    names = people.split()
    quiz = "Who is who? " + " ".join(f"{name} says nothing." for name in names)
    text_format = "\n".join(f"({i}) {name} is a knight" for i, name in enumerate(names, 1))
    statements = repr(tuple(("telling-truth", i) for i in range(len(names))))
    row = {"quiz": quiz, "solution_text_format": text_format, "statements": statements}
    path = _write(tmp_path / "people.jsonl", json.dumps(row) + "\n")
    message = (r"row 1\b.*field 'solution_text_format' must name 2 to 8 people of the quiz, distinct ignoring case, "
               rf"got \[{re.escape(', '.join(map(repr, names)))}\]")
    with pytest.raises(ValueError, match=message):
        kk_load(str(path))


def test_statements_are_kept_in_the_canonical_form_of_their_tuple(tmp_path):
    """Statements written with other quotes and spacing, or as JSON lists, are kept as the parsed tuple's repr: the
    form kk_generate writes, so that the same puzzle compares equal across files."""
    row = jsonl_rows()[0]
    canonical = repr(ast.literal_eval(row["statements"]))
    spaced = canonical.replace("'", '"').replace(", ", " ,  ")
    lists = json.loads(json.dumps(ast.literal_eval(row["statements"])))
    for i, statements in enumerate((spaced, lists)):
        loaded = kk_load(str(_write(tmp_path / f"{i}.jsonl", json.dumps({**row, "statements": statements}) + "\n")))
        assert loaded["statements"] == [canonical]
    assert spaced != canonical


def test_a_person_missing_from_the_quiz_is_refused(tmp_path):
    row = jsonl_rows()[0]
    bad = dict(row, quiz=row["quiz"].replace(row["names"][1], "Somebody"))
    path = _write(tmp_path / "unnamed.jsonl", json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"row 1\b.*field 'solution_text_format'.*people of the quiz"):
        kk_load(str(path))


@pytest.mark.parametrize("quiz", [7, [{"role": "user", "content": "Who?"}], "x" * 20_001, " \n"],
                         ids=["int", "list", "too long", "blank"])
def test_a_quiz_of_the_wrong_type_or_size_is_refused_naming_the_field(tmp_path, quiz):
    """The second row's quiz is a number, a chat list, 20,001 characters or blank (the first row is text): one
    error naming row 2, 'quiz' and what it must be."""
    rows = jsonl_rows()[:2]
    rows[1]["quiz"] = quiz
    path = _write(tmp_path / "quiz.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 2\b.*field 'quiz' must be text of 1 to 20,000 characters") as err:
        kk_load(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content,words", [("", "the file is empty"), ("  \n\n", "the file is empty"),
                                           ("GOOD\n{oops\n", "line 2 is not JSON"),
                                           ("[1, 2]\n", "row 1 is not a K&K puzzle: a row must be an object")])
def test_an_empty_or_malformed_file_says_which_line(tmp_path, content, words):
    path = _write(tmp_path / "f.jsonl", content.replace("GOOD", json.dumps(jsonl_rows()[0])))
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        kk_load(str(path))
    assert "f.jsonl" in str(err.value) and "\n" not in str(err.value)


def test_a_json_file_may_hold_a_list_or_json_lines(tmp_path):
    rows = jsonl_rows()[:3]
    listed = _write(tmp_path / "list.json", json.dumps(rows))
    lines = _write(tmp_path / "lines.json", "".join(json.dumps(r) + "\n" for r in rows))
    assert kk_load(str(listed)).to_list() == kk_load(str(lines)).to_list() == kk_load(str(JSONL[3])).to_list()[:3]


def test_reading_a_data_file_leaves_nothing_in_the_datasets_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    for path in (JSONL[3], PARQUET):
        assert len(kk_load(str(path))) > 0
    assert not cache.exists() or not any(cache.rglob("*"))


# --- the puzzle counts: the defaults fit the sizes asked for; a request that cannot be met names its flag


def test_two_person_runs_train_on_every_distinct_puzzle_by_default():
    """Only 399 distinct 2-person puzzles exist: the default num_train (4,480) takes them all, not an error."""
    train, evals = load_task_data(Config(num_people="2", eval_size=4))
    assert 300 < len(train) < Config.num_train and len(set(train["statements"])) == len(train) and len(evals) == 4


def test_an_explicit_num_train_that_cannot_be_met_names_the_flag():
    with pytest.raises(ValueError, match=r"--num_train 500, --num_people 2: only \d+ distinct 2-person"):
        load_task_data(Config(num_people="2", num_train=500, eval_size=4))


def test_the_warm_up_cycles_where_fewer_puzzles_exist_and_a_checkpoint_evaluates_the_runs_puzzles(tmp_path):
    """60 steps x 8 prompts = 480 warm-up puzzles of 2 people (399 exist, less the 4 evaluated): the draw gives what
    exists, no error. A checkpoint of the run (--model, warmed up already: trainer_state.pt) is evaluated on the run's
    own puzzles."""
    cfg = Config(num_people="2", num_train=256, warmup_steps=60, prompts_per_step=8, eval_size=4, mini_batch_size=64)
    run_evals = load_task_data(cfg)[1]
    warm = lopti.warmup_puzzles(cfg, run_evals)
    assert 300 < len(warm) < 480 and len(warm) + len(run_evals) <= 399
    (tmp_path / "trainer_state.pt").write_bytes(b"")
    checkpoint_evals = load_task_data(dataclasses.replace(cfg, model=str(tmp_path)))[1]
    assert checkpoint_evals["quiz"] == run_evals["quiz"]


@pytest.mark.parametrize("change,words", [
    ({"reward_model": "x"}, "field 'reward_model' must be an object"),
    ({"statements": "(('lying', -1), ('telling-truth', 0), ('lying', 0))"}, "person -1 is not one of 0..2")])
def test_a_logic_rl_field_of_the_wrong_type_or_a_negative_person_is_one_line(tmp_path, change, words):
    row = {**jsonl_rows()[0], **change}
    with pytest.raises(ValueError, match=re.escape(words)):
        kk_load(str(_write(tmp_path / "bad.jsonl", json.dumps(row) + "\n")))


def test_a_solution_text_of_the_wrong_type_is_rebuilt(tmp_path):
    rows = jsonl_rows()[:2]
    rows[1]["solution_text"] = 7
    loaded = kk_load(str(_write(tmp_path / "mixed.jsonl", "".join(json.dumps(r) + "\n" for r in rows))))
    assert loaded["solution_text"][1].endswith(".") and loaded["solution_text"][0] == rows[0]["solution_text"]


def test_the_toy_readme_example_row_loads_with_its_solution(tmp_path):
    """toy/README's "Your own rows" example: one JSON line that kk_load accepts, Zoey a knight and Ava a knave."""
    text = (Path(__file__).resolve().parent.parent / "toy" / "README.md").read_text()
    line = next(x.strip() for x in text.splitlines() if x.strip().startswith('{"quiz"'))
    rows = kk_load(str(_write(tmp_path / "mine.jsonl", line + "\n")))
    assert rows["names"] == [["Zoey", "Ava"]] and rows["solution"] == [[True, False]]
