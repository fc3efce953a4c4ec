"""Tests of the Knights-and-Knaves section: solver, generator, loader, prompt and Logic-RL's reward.

Expectations come from the official rows in data/kk (see its README) or are written by hand.
"""
import ast
import json
import random
import re
from pathlib import Path

import pandas as pd
import pytest

import lopti
from lopti import (KK_MAX_REWARD, KK_SYSTEM_PROMPT, THINK_PREFIX, kk_format_credit, kk_generate, kk_load,
                   kk_parse_solution, kk_prompt, kk_reward, kk_solve)

DATA = Path(__file__).parent / "data" / "kk"
JSONL = {k: DATA / f"{k}ppl_20.jsonl" for k in range(3, 8)}
PARQUET = DATA / "3ppl_test_new.parquet"
PREAMBLE = ("A very special island is inhabited only by knights and knaves. Knights always tell the truth, "
            "and knaves always lie. ")
QUESTION = " So who is a knight and who is a knave?"


def official_rows():
    """Every official row as a plain dict, read with json/pandas (not with kk_load)."""
    rows = [json.loads(line) for path in JSONL.values() for line in path.read_text().splitlines()]
    return rows + pd.read_parquet(PARQUET).to_dict("records")


def wrap(answer):
    """A well-formed completion (pre-filled <think> included) whose answer block is `answer`."""
    return f"<think> reasoning </think><answer> {answer} </answer>"


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


def test_solver_on_hand_made_puzzles():
    # A: "B is a knave", B: "A and I are the same kind" -> A knight, B knave only
    assert kk_solve((("lying", 1), ("<=>", ("telling-truth", 0), ("telling-truth", 1)))) == [[True, False]]
    # A: "A is a knight" alone is consistent both ways; results in itertools.product order
    assert kk_solve((("telling-truth", 0),)) == [[True], [False]]
    assert kk_solve((("lying", 0),)) == []  # "I am a knave" has no solution
    # A: "I am a knight and B and C are knaves", B: "A is a knave", C: "B is a knight" (3-way "and")
    assert kk_solve("(('and', ('telling-truth', 0), ('lying', 1), ('lying', 2)), ('lying', 0), "
                    "('telling-truth', 1))") == [[True, False, False], [False, True, True]]
    for bad in ["(('maybe', 0),)", "(('lying', 3),)", "(('not', ('lying', 0), ('lying', 0)),)", "()"]:
        with pytest.raises(ValueError):
            kk_solve(bad)
    with pytest.raises(ValueError):
        kk_solve("__import__('os').system('true')")  # parsed as a literal, never evaluated


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


def test_generated_cover_every_statement_type(generated):
    kinds = [s[0] for r in generated for s in ast.literal_eval(r["statements"])]
    kinds_all = ("telling-truth", "lying", "not", "and", "or", "->", "<=>")
    share = {k: kinds.count(k) / len(kinds) for k in kinds_all}
    assert min(share.values()) > 0.04, share
    assert 0.08 < share["telling-truth"] + share["lying"] < 0.3, share  # ~1/6 before the uniqueness filter


def test_generator_schema_matches_official_rows(generated):
    row = json.loads(JSONL[3].read_text().splitlines()[0])
    assert set(generated.column_names) - {"num_people"} <= set(row)
    assert {type(row[c]) for c in ("quiz", "solution_text", "solution_text_format", "statements")} == {str}


def test_generator_is_reproducible(generated):
    assert kk_generate(300, num_people=(3, 7), seed=1).to_list() == generated.to_list()
    assert kk_generate(20, seed=2)["quiz"] != generated["quiz"][:20]


def test_num_people_int_range_and_bad_values():
    assert set(kk_generate(30, num_people=4)["num_people"]) == {4}
    two = kk_generate(300, num_people=2)["statements"]  # few 2-person puzzles exist: repeats are likely
    assert len(set(two)) == 300  # but one call never repeats a puzzle, like the benchmark
    with pytest.raises(ValueError, match="n=5000"):
        kk_generate(5000, num_people=2)
    assert set(kk_generate(200, num_people=(2, 8))["num_people"]) == set(range(2, 9))
    for bad in (1, 9, (5, 3), (0, 4), (3, 9), (3,), "3", None):
        with pytest.raises(ValueError, match="num_people"):
            kk_generate(1, num_people=bad)


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
    ("<think> Assistant: r </think><answer> " + GT + " </answer>", -3.0),  # Logic-RL cuts at "Assistant:"
    ("", -3.0),
    (None, -3.0),
    (42, -3.0),
    (b"<think></think>", -3.0),
    (wrap("(.*)+[ Amelia is a knight \\1 Penelope is a knave (?P<x> Evelyn is a knight $^"), 3.0),
])
def test_reward_cases(completion, expected):
    assert kk_reward(completion, GT) == expected


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


def test_reward_after_full_plain_prompt():
    # Logic-RL scores the decoded prompt + response; the prompt's own tags sit before "Assistant:"
    with pytest.warns(UserWarning):
        prompt = kk_prompt(type("NoTemplate", (), {"chat_template": None})(), "Who is who?")
    assert kk_reward(prompt + " r </think><answer> " + GT + " </answer>", GT) == 3.0


def test_parse_solution_and_bad_ground_truth():
    assert kk_parse_solution(GT) == {"Amelia": "knight", "Penelope": "knave", "Evelyn": "knight"}
    for bad in ("", "no roles here", None):
        with pytest.raises(ValueError, match="solution_text_format"):
            kk_reward(wrap("x"), bad)


# --- loader ---
@pytest.fixture(scope="module")
def loaded():
    """Every official file read with kk_load, keyed by people count (and "parquet")."""
    return {k: kk_load(path) for k, path in JSONL.items()} | {"parquet": kk_load(PARQUET)}


def test_load_official_files(loaded, generated):
    assert all(ds.features == generated.features for ds in loaded.values())
    raw = {k: [json.loads(x) for x in JSONL[k].read_text().splitlines()] for k in JSONL}
    raw["parquet"] = pd.read_parquet(PARQUET).to_dict("records")
    for key, ds in loaded.items():
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
    path = tmp_path / "logic_rl.parquet"
    pd.read_parquet(PARQUET).drop(columns=["solution_text_format", "statements", "names", "solution",
                                            "solution_text"]).to_parquet(path)
    assert kk_load(str(path)).to_list() == loaded["parquet"].to_list()


def test_load_errors(tmp_path):
    rows = [json.loads(x) for x in JSONL[3].read_text().splitlines()]
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text("".join(json.dumps({k: v for k, v in r.items()
                                           if k not in ("statements", "solution_text_format")}) + "\n"
                               for r in rows))
    with pytest.raises(ValueError, match="statements") as err:
        kk_load(lacking)
    assert "solution_text_format" in str(err.value) and "Logic-RL" in str(err.value)
    lines = rows[0]["solution_text_format"].split("\n")
    lines[0] = lines[0].replace("knight", "KNAVE").replace("knave", "knight").replace("KNAVE", "knave")
    wrong = tmp_path / "wrong.jsonl"  # first person's role flipped: the statements no longer agree
    wrong.write_text(json.dumps({k: v for k, v in rows[0].items() if k != "solution"}
                                | {"solution_text_format": "\n".join(lines)}) + "\n")
    with pytest.raises(ValueError, match="row 0"):
        kk_load(wrong)
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text(json.dumps(rows[0] | {"names": rows[0]["names"][::-1]}) + "\n")
    with pytest.raises(ValueError, match="names"):
        kk_load(swapped)
    with pytest.raises(FileNotFoundError):
        kk_load(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError):
        kk_load("some/dir/missing.parquet")
    (tmp_path / "rows.csv").write_text("quiz\nx\n")
    with pytest.raises(ValueError, match="csv"):
        kk_load(tmp_path / "rows.csv")


def _row_file(tmp_path, name, **changes):
    row = json.loads(JSONL[3].read_text().splitlines()[0]) | changes
    (tmp_path / name).write_text(json.dumps(row) + "\n")
    return tmp_path / name


def test_hostile_rows_are_rejected_quickly_with_file_and_row(tmp_path):
    """Each row is validated in time linear in its size: a cap on people (solving is 2^n), the statement count
    must match the names, nesting is bounded before literal_eval."""
    names = [f"P{c}" for c in "abcdefghijklm"]  # 13 people
    many = _row_file(tmp_path, "many.jsonl", statements=repr(tuple(("telling-truth", i) for i in range(13))),
                     solution_text_format="\n".join(f"({i}) {n} is a knight" for i, n in enumerate(names, 1)),
                     names=None, solution=None)
    with pytest.raises(ValueError, match=r"many.jsonl.* row 0: 13 statements: at most 12 people"):
        kk_load(many)
    fewer = _row_file(tmp_path, "fewer.jsonl", statements="(('telling-truth', 1),)")
    with pytest.raises(ValueError, match=r"row 0: 1 statements for 3 people"):
        kk_load(fewer)
    deep = _row_file(tmp_path, "deep.jsonl", statements="(" * 500 + ")" * 500)
    with pytest.raises(ValueError, match=r"row 0: statements are nested deeper than"):
        kk_load(deep)
    no_quiz = _row_file(tmp_path, "no_quiz.jsonl", quiz="  ")
    with pytest.raises(ValueError, match=r"row 0: quiz is missing"):
        kk_load(no_quiz)
    with pytest.raises(ValueError, match="at most 12 people"):
        kk_solve(tuple(("lying", 0) for _ in range(20)))  # 2^20 assignments are never tried


@pytest.mark.parametrize("content,match", [("", "is empty"), ("\n\n  \n", "is empty"), ('{"quiz": "x", \n', "JSON"),
                                           ("not json\n", "not a readable .jsonl")])
def test_malformed_files_name_the_file(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        kk_load(tmp_path / "bad.jsonl")
    assert "bad.jsonl" in str(err.value)


def test_zero_row_and_garbage_parquet_name_the_file(tmp_path):
    pd.read_parquet(PARQUET).iloc[:0].to_parquet(tmp_path / "zero.parquet")
    with pytest.raises(ValueError, match="zero.parquet' has no rows"):
        kk_load(tmp_path / "zero.parquet")
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="garbage.parquet' is not a readable .parquet"):
        kk_load(tmp_path / "garbage.parquet")


def test_parse_solution_equals_logic_rl_regex_and_is_linear():
    """kk_parse_solution = Logic-RL's per-line re.search(r"\\b([A-Za-z]+)\\b.*?\\b(knight|knave)\\b", I), checked
    on random lines, without that regex's quadratic time (40k words run in milliseconds, not a minute)."""
    def logic_rl(text):
        found = (re.search(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", line.strip(), re.I) for line in text.split("\n"))
        return {m.group(1): m.group(2).lower() for m in found if m}

    rng = random.Random(0)
    pieces = list("ab AZk_1é(),.\t\n") + ["knight", "knave", "Knave", " is a ", "Zoey"]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        expected = logic_rl(text)
        if expected:
            assert kk_parse_solution(text) == expected, text
        else:
            with pytest.raises(ValueError):
                kk_parse_solution(text)
    assert kk_parse_solution("a" * 40_000 + "1 " + "word " * 40_000 + "Zoey is a knave") == {"word": "knave"}


@pytest.mark.parametrize("completion, credit", [
    ("<think> r", 0.0),  # nothing yet
    ("<think> r </think>", 1 / 8),
    ("<think> r </think><answer> </answer>", 3 / 8 + 1 / 8),  # every tag, in order: the tag half is full
    ("<think> r </think><answer> Amelia is a knight </answer>", 0.5 + 0.5 / 3),
    (wrap("Amelia is a knight, Penelope is a knave, and Evelyn is a knight."), 1.0),
    (wrap("Amelia is a knave, Penelope is a knight, and Evelyn is a knave."), 1.0),  # wrong roles: format only
    (wrap("Amelia is a knight, Penelope is a knave, Evelyn is a knight or a knave."), 0.5),  # 4 role words
    ("<think> r <answer> Amelia is a knight", 1 / 8 + 0.5 / 3),  # no </think>, no </answer>: not in order
    ("<think> r </think> Amelia is a knight, Penelope is a knave", 1 / 8),  # names outside <answer> earn nothing
    ("<think> r </think><answer> x </answer><answer> y </answer>", 1 / 8),  # tags twice
    (None, 0.0),
])
def test_format_credit_golden(completion, credit):
    assert kk_format_credit(completion, GT) == pytest.approx(credit)
    # it only grows toward an answer Logic-RL can read: full credit iff the reward is 3 or -0.5
    assert (kk_format_credit(completion, GT) == 1.0) == (kk_reward(completion, GT) in (3.0, -0.5))


def test_load_hub_offline(monkeypatch):
    import datasets
    import huggingface_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read once at import: patch the copies
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("no load (and no retries) offline"))
    lopti.hub_reachable.cache_clear()
    with pytest.raises(ConnectionError, match="not reachable") as err:
        kk_load("K-and-K/knights-and-knaves:test/3ppl")
    assert "kk_generate" in str(err.value)


def test_hub_unreachable_without_offline_mode(monkeypatch):
    """No network (DNS fails): the hub counts as unreachable after one probe; an answering hub as reachable."""
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def no_network(self, *a, **k):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)
    lopti.hub_reachable.cache_clear()
    assert lopti.hub_reachable("org/name", "model") is False

    def missing(self, *a, **k):
        from huggingface_hub.errors import RepositoryNotFoundError
        raise RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # (its __init__ wants an HTTP response)

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", missing)
    lopti.hub_reachable.cache_clear()
    assert lopti.hub_reachable("org/name", "model") is True
    lopti.hub_reachable.cache_clear()


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


@pytest.mark.parametrize("template", [CHATML, QWEN25])
def test_prompt_with_chat_template_equals_official_prompt(template):
    tokenizer = tiny_tokenizer(template)
    rows = pd.read_parquet(PARQUET).to_dict("records")
    for r in rows:
        assert kk_prompt(tokenizer, r["quiz"]) == r["prompt"][0]["content"]
    official = rows[0]["prompt"][0]["content"]
    assert official.split("<|im_start|>system\n")[1].split("<|im_end|>")[0] == KK_SYSTEM_PROMPT
    assert official.endswith("<|im_start|>assistant\n" + THINK_PREFIX)


def test_prompt_without_chat_template_warns():
    with pytest.warns(UserWarning, match="no chat template.*instruct"):
        prompt = kk_prompt(tiny_tokenizer(None), "QUIZ TEXT")
    assert prompt.startswith(KK_SYSTEM_PROMPT) and "QUIZ TEXT" in prompt
    assert prompt.endswith("Assistant: " + THINK_PREFIX)
