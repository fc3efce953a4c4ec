"""Where inputs enter and results leave: rewards checked where they enter (--reward FILE.py:FUNCTION,
MODULE:FUNCTION, Config(reward=f)), the stall note, eval of a checkpoint on its run's puzzles, refused inputs that
write nothing (a missing or non-model --model, a torn checkpoint, an edited --eval_data under --resume, a folder
holding another program's results), compare's files and steps, --eval_data shared with --train_data, names equal but
for case, byte-order marks, diagnose under SIGTERM, and the settings and version that result files record (the
committed laptop runs too).

Each test names what it guards; each fails on the code before these behaviours (see the report that came with it).
One trained tiny run (`run`, 3 steps, a constant reward from a file) and one stopped diagnose (`stopped_diagnose`)
are shared by module-scoped fixtures."""
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lopti
from conftest import exit_code, tiny_config
from lopti import Config

# = conftest's tiny_config, as flags; eval_every 0 and save_every 0: evaluated and saved at step 0 / the last step
TINY_FLAGS = ["--prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
              "--mini_batch_size", "4", "--micro_batch_size", "2", "--num_train", "16", "--num_people", "3",
              "--eval_size", "2", "--eval_every", "0", "--eval_batch_size", "4", "--save_every", "0",
              "--learning_rate", "1e-3", "--weight_decay", "0"]
# What eval takes of them (it refuses train's own flags)
EVAL_FLAGS = ["--max_completion_length", "12", "--num_people", "3", "--eval_size", "2", "--eval_batch_size", "4"]
DIAGNOSE_FLAGS = ["--prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
                  "--mini_batch_size", "4", "--micro_batch_size", "2", "--num_people", "3", "--num_train", "16",
                  "--eval_size", "2", "--eval_batch_size", "4"]
REWARDS = '''
def constant(completions, solutions):
    return [0.5] * len(completions)

def always_correct(completions, solutions):
    return [3.0] * len(completions)

def nan_reward(completions, solutions):
    return [float("nan")] + [1.0] * (len(completions) - 1)
'''


def error_line(capsys, *words) -> str:
    """The one error line of lopti.py (progress bars of a model's loading aside), holding every word; no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lopti.py ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def printed_json(out: str) -> dict:
    """The JSON that eval prints after its notes."""
    return json.loads(out[out.index("{"):])


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def write_jsonl(path: Path, rows: list[dict], encoding: str = "utf-8") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding=encoding)
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture(scope="module")
def run(tiny_model_dir, reward_file, tmp_path_factory) -> SimpleNamespace:
    """`python lopti.py train --reward rewards.py:constant --seed 1 --steps 3` of the tiny model: evaluated at
    steps 0 and 3, saved at step 3 (checkpoint-3); its exit code and stderr kept."""
    out = tmp_path_factory.mktemp("surfaces") / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = exit_code(["train", "--model", tiny_model_dir, "--output_dir", out, *TINY_FLAGS, "--steps", "3",
                   "--seed", "1", "--reward", f"{reward_file}:constant"])
    return SimpleNamespace(out=out, rc=rc, err=err.getvalue(), reward=f"{reward_file}:constant")


# --- 1. rewards checked where they enter


def nan_row(completions, solutions):
    return [1.0, float("nan")] + [1.0] * (len(completions) - 2)


def one_short(completions, solutions):
    return [1.0] * (len(completions) - 1)


def a_list_each(completions, solutions):
    return [[1.0] for _ in completions]


def strings(completions, solutions):
    return ["3.0"] * len(completions)


def nothing(completions, solutions):
    return None


def good(completions, solutions):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("function", [nan_row, one_short, a_list_each, strings, nothing])
def test_a_bad_reward_is_one_line_naming_the_function(function):
    """Guards score(): a reward that returns NaN, too few values, a list per completion, text or nothing is one
    ValueError naming the function, not a tensor that trains on garbage (NaN advantages used to skip every step)."""
    cfg = Config(reward=function)
    with pytest.raises(ValueError) as e:
        lopti.score(cfg, ["a", "bb", "ccc"], ["s", "s", "s"])
    assert function.__name__ in str(e.value) and "\n" not in str(e.value)


def test_a_good_reward_function_is_scored_as_returned_and_recorded_as_module_qualname():
    """Guards Config(reward=f): a Python function's floats are the rewards, and config_record names it
    "module:qualname" (config.json holds text)."""
    cfg = Config(reward=good)
    rewards = lopti.score(cfg, ["a", "bb", "ccc"], ["s", "s", "s"])
    assert rewards.tolist() == [1.0, 2.0, 3.0] and rewards.dtype == torch.float32
    assert lopti.config_record(cfg)["reward"] == f"{good.__module__}:good"


def test_a_train_run_with_a_nan_reward_file_exits_2_in_one_line_and_saves_nothing(tiny_model_dir, reward_file,
                                                                                   tmp_path, capsys):
    """Guards train --reward FILE.py:FUNCTION with a NaN: exit 2, one line naming the function, no checkpoint (a NaN
    reward never trains nothing in silence)."""
    out = tmp_path / "run"
    assert exit_code(["train", "--model", tiny_model_dir, "--output_dir", out, *TINY_FLAGS, "--steps", "1",
                 "--reward", f"{reward_file}:nan_reward"]) == 2
    error_line(capsys, ": error: ", "nan_reward", "finite")
    assert not list(out.glob("checkpoint-*"))


def test_a_train_run_with_a_nan_reward_function_raises_and_its_config_names_it(tiny_model_dir, tmp_path):
    """Guards Config(reward=f) in train: the NaN is a ValueError naming the function, and config.json recorded the
    function as "module:qualname"."""
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", steps=1, reward=nan_row)
    with pytest.raises(ValueError, match="nan_row"):
        lopti.train(cfg)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["reward"] == f"{nan_row.__module__}:nan_row"
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_score_of_kk_follows_kk_rewards(monkeypatch):
    """Guards the tests' own contract: conftest.fixed_rewards patches lopti.kk_rewards, so score('kk') must call the
    kk_rewards of the moment, not the first one it saw."""
    cfg = Config()
    solution = "(1) Zoey is a knight\n(2) Oliver is a knave"
    real = lopti.score(cfg, ["x"], [solution]).tolist()
    monkeypatch.setattr(lopti, "kk_rewards", lambda completions, solutions: [1.5] * len(completions))
    assert lopti.score(cfg, ["x"], [solution]).tolist() == [1.5] != real


# --- 2. --reward FILE.py:FUNCTION and MODULE:FUNCTION; 3. the stall note


def test_train_with_a_reward_file_trains_on_that_reward(run):
    """Guards --reward FILE.py:FUNCTION: every step's reward is the file's 0.5 (Logic-RL's is -3 to 3, and a random
    tiny model scores -3 or so), and config.json records the spec."""
    assert run.rc == 0, run.err
    steps = [r for r in read_jsonl(run.out / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["reward"] == 0.5 for r in steps)
    assert json.loads((run.out / "config.json").read_text())["reward"] == run.reward
    assert (run.out / "checkpoint-3" / "trainer_state.pt").is_file()


def test_a_run_whose_groups_all_score_alike_says_it_has_stalled(run):
    """Guards Run.end_step's note: 3 steps in a row where every group scored alike are said once on stderr."""
    assert run.rc == 0, run.err
    assert run.err.count("note: steps 1-3: in every group all samples scored alike") == 1, run.err


def test_eval_with_a_module_reward_scores_by_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Guards --reward MODULE:FUNCTION: a module on sys.path whose reward is always 3.0 makes every puzzle correct."""
    (tmp_path / "surfaces_reward_module.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert exit_code(["eval", "--model", tiny_model_dir, *EVAL_FLAGS,
                 "--reward", "surfaces_reward_module:always_correct"]) == 0
    result = printed_json(capsys.readouterr().out)
    assert result["eval/accuracy"] == 1.0 and result["eval/correct"] == "11"


@pytest.mark.parametrize("spec", ["missing.py:constant", "REWARDS:no_such_function", "no_such_module_xyz:f",
                                  "not_a_spec"])
def test_a_bad_reward_spec_is_one_line_and_writes_nothing(spec, tiny_model_dir, reward_file, tmp_path, capsys):
    """Guards reward_function and check_config: a missing file, function or module, or text that is no spec, is one
    line naming --reward / reward, exit 2, before --output_dir is made."""
    spec = spec.replace("REWARDS", str(reward_file))
    spec = str(tmp_path / spec) if spec.startswith("missing") else spec
    out = tmp_path / "run"
    assert exit_code(["train", "--model", tiny_model_dir, "--output_dir", out, *TINY_FLAGS, "--reward", spec]) == 2
    error_line(capsys, ": error: ", "reward")
    assert not out.exists()


# --- 4. eval of a checkpoint scores its run's puzzles; 16. a missing local --model


def test_eval_of_a_checkpoint_scores_its_runs_puzzles(run, capsys):
    """Guards resolve_config for eval of RUN/checkpoint-N: the run's config.json (seed 1, 3 people, 2 puzzles), so
    eval/puzzles is the one the run logged; an explicit --seed 0 still wins, and draws other puzzles."""
    assert run.rc == 0, run.err
    logged = [r for r in read_jsonl(run.out / "metrics.jsonl") if "eval/puzzles" in r]
    assert [r["step"] for r in logged] == [0, 3]
    assert exit_code(["eval", "--model", run.out / "checkpoint-3"]) == 0
    own = printed_json(capsys.readouterr().out)
    assert own["eval/puzzles"] == logged[-1]["eval/puzzles"] == logged[0]["eval/puzzles"]
    assert own["eval/correct"] == logged[-1]["eval/correct"]
    assert exit_code(["eval", "--model", run.out / "checkpoint-3", "--seed", "0"]) == 0
    assert printed_json(capsys.readouterr().out)["eval/puzzles"] != own["eval/puzzles"]


@pytest.mark.parametrize("command", ["eval", "train"])
@pytest.mark.parametrize("model", ["./nope", "a/b/c", "ABSOLUTE"])
def test_a_missing_local_model_is_no_such_folder(command, model, tmp_path, monkeypatch, capsys):
    """Guards load_model: a local path that does not exist is "no such folder", not a hub lookup's error."""
    monkeypatch.chdir(tmp_path)
    model = str(tmp_path / "nope") if model == "ABSOLUTE" else model
    flags = EVAL_FLAGS if command == "eval" else [*TINY_FLAGS, "--output_dir", tmp_path / "out"]
    assert exit_code([command, "--model", model, *flags]) == 2
    error_line(capsys, ": error: ", "no such folder", model)


# --- 5. a refused --model writes nothing; 6. a torn checkpoint


@pytest.mark.parametrize("kind", ["missing", "empty folder"])
def test_train_with_a_model_that_does_not_load_writes_nothing(kind, tmp_path, capsys):
    """Guards Run.__init__'s order: the model loads before config.json is written, so a refused --model leaves
    --output_dir as it was (absent, or empty)."""
    model = tmp_path / "model"
    if kind == "empty folder":
        model.mkdir()
    out = tmp_path / "out"
    if kind == "empty folder":
        out.mkdir()
    assert exit_code(["train", "--model", model, "--output_dir", out, *TINY_FLAGS]) == 2
    error_line(capsys, ": error: ", str(model))
    assert (not out.exists()) if kind == "missing" else not any(out.iterdir())


def test_a_torn_checkpoint_is_one_line_for_eval_and_resume(run, tmp_path, capsys):
    """Guards load_model's catch-all: model.safetensors cut to half its bytes is one line (exit 2) for eval of the
    checkpoint and for --resume of its run, which leaves the run's files as they were."""
    assert run.rc == 0, run.err
    torn = tmp_path / "run"
    shutil.copytree(run.out, torn)
    weights = torn / "checkpoint-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    before = digest(torn)
    assert exit_code(["eval", "--model", torn / "checkpoint-3"]) == 2
    error_line(capsys, "lopti.py eval: error: ", "checkpoint-3")
    assert exit_code(["train", "--resume", "--output_dir", torn, "--steps", "4"]) == 2
    error_line(capsys, "lopti.py train: error: ", "checkpoint-3")
    assert digest(torn) == before


# --- 7. compare


def fake_run(folder: Path, steps, correct=("0110", "1111"), puzzles: str | None = "0123456789ab", **cfg) -> Path:
    """A run folder as train writes it: config.json, and metrics.jsonl with an evaluation at each step (step 0's
    outcomes `correct[0]`, later ones `correct[1]`)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(lopti.config_record(Config(**cfg))))
    records = []
    for step in steps:
        outcomes = correct[0] if step == 0 else correct[1]
        record = {"step": step, "eval/correct": outcomes, "eval/accuracy": outcomes.count("1") / len(outcomes)}
        if puzzles is not None:
            record["eval/puzzles"] = puzzles
        records.append(record)
    write_jsonl(folder / "metrics.jsonl", records)
    return folder


@pytest.mark.parametrize("text", ["", "[1, 2]"])
def test_compare_of_a_run_whose_config_holds_no_settings_names_the_file(text, tmp_path, capsys):
    """Guards read_config: an empty config.json, or one holding a JSON list, is one line naming the file."""
    bad = fake_run(tmp_path / "bad", [0])
    (bad / "config.json").write_text(text)
    good = fake_run(tmp_path / "good", [0])
    assert exit_code(["compare", bad, good]) == 2
    error_line(capsys, "lopti.py compare: error: ", str(bad / "config.json"))


def test_compare_compares_the_last_common_step_and_says_it_is_not_the_last_of_each(tmp_path, capsys):
    """Guards compare_runs' note: runs evaluated at [0, 2] and [0, 3] compare at step 0, said to be not both runs'
    last evaluation."""
    a = fake_run(tmp_path / "a", [0, 2], seed=0)
    b = fake_run(tmp_path / "b", [0, 3], correct=("0111", "1111"), seed=1)
    assert exit_code(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "note: step 0 is the last step both evaluated, not the last of each (2, 3)" in out
    assert "accuracy 0.500 at step 0" in out and "accuracy 0.750 at step 0" in out


def test_compare_refuses_runs_whose_records_lack_eval_puzzles(tmp_path, capsys):
    """Guards compare_runs: without eval/puzzles, equal settings no longer stand in for the same puzzles."""
    a = fake_run(tmp_path / "a", [0, 2], puzzles=None)
    b = fake_run(tmp_path / "b", [0, 2], puzzles=None)
    assert exit_code(["compare", a, b]) == 2
    error_line(capsys, "lopti.py compare: error: ", "eval/puzzles")


# --- 8. --eval_data sharing rows with --train_data; 9. an --eval_data edited before --resume


@pytest.fixture
def puzzle_files(tmp_path) -> SimpleNamespace:
    """4 training puzzles; an evaluation file of 2 of them and 2 others."""
    train = lopti.kk_generate(4, 3, seed=5).to_list()
    others = [r for r in lopti.kk_generate(6, 3, seed=6).to_list()
              if r["statements"] not in {t["statements"] for t in train}][:2]
    assert len(others) == 2
    return SimpleNamespace(train=train, others=others,
                           train_file=write_jsonl(tmp_path / "train.jsonl", train),
                           eval_file=write_jsonl(tmp_path / "eval.jsonl", train[:2] + others))


def test_eval_data_shared_with_train_data_is_said_and_not_evaluated(puzzle_files, capsys):
    """Guards evaluation_rows: 2 of 4 --eval_data puzzles in --train_data are said in a note and dropped."""
    cfg = Config(train_data=str(puzzle_files.train_file), eval_data=str(puzzle_files.eval_file), num_people="3")
    train_rows, evals = lopti.load_task_data(cfg)
    assert "2 of 4 --eval_data puzzles are also in --train_data" in capsys.readouterr().out
    assert len(train_rows) == 4 and evals["quiz"] == [r["quiz"] for r in puzzle_files.others]
    assert lopti.evaluation_rows(cfg)["quiz"] == evals["quiz"]
    only_shared = write_jsonl(puzzle_files.eval_file.with_name("shared.jsonl"), puzzle_files.train[:2])
    with pytest.raises(ValueError, match="--eval_data"):
        lopti.evaluation_rows(dataclasses.replace(cfg, eval_data=str(only_shared)))


def test_resume_after_the_eval_data_changed_is_refused_in_one_line(run, tmp_path, capsys):
    """Guards Run.__init__'s check of step 0's eval/puzzles: the shared run, as if it had been trained with an
    --eval_data file (config.json and its logged eval/puzzles say so), refuses --resume once that file is edited, and
    writes nothing."""
    assert run.rc == 0, run.err
    resumed = tmp_path / "run"
    shutil.copytree(run.out, resumed)
    rows = lopti.kk_generate(2, 3, seed=7).to_list()
    eval_file = write_jsonl(tmp_path / "eval.jsonl", rows)
    config = json.loads((resumed / "config.json").read_text())
    (resumed / "config.json").write_text(json.dumps({**config, "eval_data": str(eval_file)}))
    puzzles = lopti.puzzles_hash(lopti.kk_load(str(eval_file)))
    records = [{**r, "eval/puzzles": puzzles} if "eval/puzzles" in r else r
               for r in read_jsonl(resumed / "metrics.jsonl")]
    write_jsonl(resumed / "metrics.jsonl", records)
    write_jsonl(eval_file, [rows[0], lopti.kk_generate(1, 3, seed=8).to_list()[0]])  # edited
    before = digest(resumed)
    assert exit_code(["train", "--resume", "--output_dir", resumed, "--steps", "4"]) == 2
    error_line(capsys, "lopti.py train: error: ", "--resume", "--eval_data")
    assert digest(resumed) == before


# --- 10. toy's --out; 14. the settings and version of result files


@pytest.mark.parametrize("files", [{"results.json": '{"a": 1}'}, {"figures.png": "not toy's"}])
def test_toy_refuses_an_out_folder_holding_another_programs_results(files, tmp_path, capsys):
    """Guards toy_main's check_replaceable: a results.json that is not toy's, or a figures.png without results.json,
    is one line (exit 2) before any work, and the files stay as they were."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = digest(tmp_path)
    assert exit_code(["toy", "--quick", "--out", tmp_path]) == 2
    error_line(capsys, "lopti.py toy: error: ", str(tmp_path / next(iter(files))))
    assert digest(tmp_path) == before


def test_toy_results_record_the_version_and_settings(tmp_path, capsys):
    """Guards toy_main: results.json holds the version and every ToySettings value it ran with."""
    assert exit_code(["toy", "--quick", "--out", tmp_path]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["settings"] == dataclasses.asdict(lopti.ToySettings(**lopti.TOY_QUICK))
    assert "lopti.py sha256" in result["version"]


def test_config_json_records_the_version(run):
    """Guards start_run_files: config.json holds every Config field, the method and the version."""
    assert run.rc == 0, run.err
    saved = json.loads((run.out / "config.json").read_text())
    assert {f.name for f in dataclasses.fields(Config)} <= set(saved)
    assert "lopti.py sha256" in saved["version"] and saved["method"]


def test_the_committed_laptop_runs_record_how_they_were_made_and_compare_as_toy_readme_quotes(
        monkeypatch, capsys):
    """Guards the evidence in toy/laptop/: each run's config.json names its method and one shared version, each
    evaluation its puzzles; compare of the seed-0 runs needs no legacy path and prints the verdicts toy/README quotes."""
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    runs = sorted(p for p in Path("toy/laptop").iterdir() if (p / "config.json").exists())
    versions = set()
    for run in runs:
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["method"] == lopti.method_name(cfg) and "lopti.py sha256" in cfg["version"]
        versions.add(cfg["version"])
        evaluations = [r for r in lopti.read_jsonl(run / "metrics.jsonl") if "eval/correct" in r]
        assert [r["step"] for r in evaluations] == [0, 10, 20], run
        assert all(r["eval/puzzles"] for r in evaluations)
    assert len(runs) >= 4 and len(versions) == 1
    readme = (root / "toy" / "README.md").read_text()
    for other in ("lopti_s0", "arlopti_s0"):
        lopti.compare_runs(Path("toy/laptop/grpo2_s0"), Path("toy/laptop") / other)
        verdict = capsys.readouterr().out.splitlines()[-1]  # second minus first: ...
        assert f"python lopti.py compare toy/laptop/grpo2_s0 toy/laptop/{other}\n# {verdict}\n" in readme


# --- 11. names equal but for case; byte-order marks


def test_names_equal_but_for_case_are_refused_naming_file_row_and_field(tiny_model_dir, tmp_path, capsys):
    """Guards _kk_row: "Amelia" and "amelia" are one person to the reward, so the row is refused in one line that
    names the file, the row and solution_text_format (the same row with its own names loads)."""
    row = lopti.kk_generate(1, 2, seed=3).to_list()[0]
    lopti.kk_load(str(write_jsonl(tmp_path / "fine.jsonl", [row])))
    renamed = dict(row)
    for field in ("quiz", "solution_text", "solution_text_format"):
        text = row[field]
        for i, name in enumerate(row["names"]):
            text = re.sub(rf"\b{name}\b", f"@{i}@", text)
        renamed[field] = text.replace("@0@", "Amelia").replace("@1@", "amelia")
    renamed["names"] = ["Amelia", "amelia"]
    path = write_jsonl(tmp_path / "case.jsonl", [renamed])
    assert exit_code(["eval", "--model", tiny_model_dir, *EVAL_FLAGS, "--eval_data", path]) == 2
    error_line(capsys, "lopti.py eval: error: ", str(path), "row 1", "solution_text_format")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_file_with_a_byte_order_mark_loads(suffix, tmp_path):
    """Guards _read_rows: UTF-8 with a byte-order mark (as Windows tools write it) is read, not refused."""
    rows = lopti.kk_generate(2, 3, seed=4).to_list()
    path = tmp_path / f"bom{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8-sig")
    else:
        write_jsonl(path, rows, encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    assert lopti.kk_load(str(path))["quiz"] == [r["quiz"] for r in rows]


# --- 12. --eval_size beyond what exists


@pytest.mark.parametrize("command", ["eval", "train"])
def test_more_evaluation_puzzles_than_exist_names_eval_size(command, tiny_model_dir, tmp_path, capsys):
    """Guards evaluation_rows: 400 2-person puzzles do not exist (399 do): the error names --eval_size."""
    flags = ["--output_dir", tmp_path / "out"] if command == "train" else []
    assert exit_code([command, "--model", tiny_model_dir, "--eval_size", "400", "--num_people", "2", *flags]) == 2
    error_line(capsys, ": error: ", "--eval_size 400")


def test_an_evaluation_that_takes_every_puzzle_leaves_training_some_or_says_so():
    """Guards load_task_data: generated training never comes back empty; it says so, naming the flag."""
    with pytest.raises(ValueError, match="--eval_size 399"):
        lopti.load_task_data(Config(num_people="2", eval_size=399))


# --- 13. diagnose under SIGTERM; 14. its JSON's settings


@pytest.fixture(scope="module")
def stopped_diagnose(tiny_model_dir, tmp_path_factory) -> SimpleNamespace:
    """`python lopti.py diagnose --steps 20` in a subprocess, sent SIGTERM once it has printed "step 1:" and written
    its --out (it rewrites --out after every step): its exit code, stdout, stderr and --out."""
    root = tmp_path_factory.mktemp("diagnose")
    out = root / "diagnose.json"
    argv = [sys.executable, "-u", str(Path(lopti.__file__).resolve()), "diagnose", "--model", str(tiny_model_dir),
            "--steps", "20", "--out", str(out), *DIAGNOSE_FLAGS]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    lines: queue.Queue = queue.Queue()
    with open(root / "stderr.txt", "w") as err:  # (a file: a full pipe would block the child)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=root, env=env)
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                                  daemon=True)
        reader.start()
        stdout, deadline, signalled = [], time.monotonic() + 300, False
        try:
            while time.monotonic() < deadline:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
                if line is None:
                    break  # exited by itself
                stdout.append(line)
                if line.startswith("step 1:"):
                    while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
                        time.sleep(0.02)
                    proc.send_signal(signal.SIGTERM)
                    signalled = True
                    break
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
    while not lines.empty():
        line = lines.get()
        stdout += [line] if line else []
    return SimpleNamespace(rc=rc, signalled=signalled, stdout="".join(stdout), out=out,
                           err=(root / "stderr.txt").read_text())


def test_diagnose_stopped_by_sigterm_exits_143_and_keeps_valid_json(stopped_diagnose):
    """Guards main's SIGTERM handler: diagnose, which has no StopOnSignal, exits 143 with "interrupted" (not killed
    by the signal, -15), and its --out is whole JSON with its settings (written beside, then renamed)."""
    d = stopped_diagnose
    assert d.signalled, d.stdout + d.err
    assert d.rc == 128 + signal.SIGTERM == 143, d.err
    assert "lopti.py diagnose: interrupted" in d.err
    result = json.loads(d.out.read_text())
    assert "settings" in result and "figure1" in result


def test_diagnose_json_records_every_setting_the_method_and_the_version(stopped_diagnose, tiny_model_dir):
    """Guards diagnose's result: "settings" holds every Config field as run (measure_update on), the method and
    the version."""
    settings = json.loads(stopped_diagnose.out.read_text())["settings"]
    assert {f.name for f in dataclasses.fields(Config)} <= set(settings)
    assert settings["model"] == str(tiny_model_dir) and settings["num_generations"] == 4
    assert settings["measure_update"] is True
    assert settings["method"] and "lopti.py sha256" in settings["version"]


# --- 15. plot of a folder that is not a run, without matplotlib


def test_plot_of_a_checkpoint_says_it_is_not_a_run_even_without_matplotlib(run, tmp_path, monkeypatch, capsys):
    """Guards plot_runs' order: the folder is read before matplotlib is imported, so RUN/checkpoint-N is said to be
    no run folder rather than matplotlib being missing."""
    assert run.rc == 0, run.err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert exit_code(["plot", run.out / "checkpoint-3", "--out", tmp_path / "plot.png"]) == 2
    error_line(capsys, "lopti.py plot: error: ", "is not a folder written by lopti.py train")
    assert not (tmp_path / "plot.png").exists()


# --- review fixes: a training file keeps generated evaluation puzzles out; reward objects; diagnose --out


def test_generated_evaluation_puzzles_skip_a_training_files_statements(tmp_path):
    """Guards evaluation_rows: with --train_data a file and the evaluation generated, no evaluation puzzle shares
    its statements with a training row (2 people: 256 of the 399 that exist; a plain draw of 64 would share ~40)."""
    rows = lopti.kk_generate(256, 2, seed=7).to_list()
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = Config(num_people="2", eval_size=64, train_data=str(train))
    train_rows, evals = lopti.load_task_data(cfg)
    assert len(evals) == 64 and not set(evals["statements"]) & set(train_rows["statements"])
    plain = lopti.kk_generate(64, 2, seed=cfg.seed + 1_000_003 + 2)  # the draw without the exclusion
    assert set(plain["statements"]) & set(train_rows["statements"])


class CallableReward:
    def __call__(self, completions, solutions):
        return [1.0] * len(completions)

    @staticmethod
    def nested(completions, solutions):
        return [2.0] * len(completions)


def test_a_callable_object_reward_is_recorded_and_a_nested_name_loads():
    """Guards config_record and load_function: an object with __call__ (or a functools.partial) has no __qualname__;
    MODULE:Class.method resolves the dotted name."""
    record = lopti.config_record(Config(reward=CallableReward()))
    assert record["reward"] == f"{__name__}:CallableReward"
    assert lopti.reward_function(f"{__name__}:CallableReward.nested")(["a"], ["b"]) == [2.0]


def test_diagnose_out_never_replaces_the_toys_results(tmp_path, capsys):
    """Guards check_replaceable: the toy's results.json holds a figure1 too, but it is not diagnose's output."""
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"figure1": {}, "prop_4_2": {}, "settings": {}}))
    before = out.read_bytes()
    assert exit_code(["diagnose", "--out", out]) == 2
    error_line(capsys, "is not diagnose's output")
    assert out.read_bytes() == before
