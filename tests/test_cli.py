"""The command line (lopti.py's "CLI" section) and the README: presets and --field parsing, one-line errors and
exit codes, --help per command, Ctrl-C, and every Python block of the README run as written."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lopti
from conftest import tiny_config, varied_reward
from lopti import Config

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
README_BLOCKS = [block for doc in ("README.md", "toy/README.md")  # the front page and its measured details
                 for block in re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)]



def train_args(argv: list[str]) -> dict:
    """What `python lopti.py train ARGV` parses, as resolve_config takes it."""
    return vars(lopti.build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("argv,match", [
    (["--alpha", "1.5"], "alpha"), (["--eta", "0"], "eta"), (["--lopti_order", "sideways"], "lopti_order"),
    (["--optimizer", "adam"], "optimizer"),
    (["--micro_batch_size", "0"], "micro_batch_size"), (["--dual_clip", "1"], "dual_clip"),
    (["--max_grad_norm", "-1"], "max_grad_norm"), (["--weight_decay", "-0.1"], "weight_decay"),
    (["--steps", "0"], "steps"), (["--save_every", "-1"], "save_every"),
    (["--generation_batch_size", "-2"], "generation_batch_size"), (["--seed", "-3"], "seed")])
def test_bad_config_values(argv, match):
    with pytest.raises(ValueError, match=match):
        lopti.resolve_config(train_args(argv))


def test_config_precedence_and_bool_parsing():
    parse = lambda argv: lopti.resolve_config(train_args(argv))  # noqa: E731
    assert parse([]) == Config()
    cfg = parse(["--preset", "cpu", "--num-generations", "2", "--lopti", "false"])
    assert cfg.model == lopti.PRESETS["cpu"]["model"] and cfg.num_generations == 2 and cfg.lopti is False
    with pytest.raises(SystemExit):
        parse(["--lopti", "maybe"])


def test_resume_with_a_config_from_another_version_names_the_unknown_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**dataclasses.asdict(Config()), "warp_factor": 9}))
    with pytest.raises(ValueError, match="warp_factor"):
        lopti.resolve_config(train_args(["--resume", "--output_dir", str(tmp_path)]))


def test_resume_continues_at_the_right_step_and_matches_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    straight = lopti.train(tiny_config(tiny_model_dir, tmp_path / "a", steps=3))
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "b", steps=2))
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:  # a crash after step 3's log line, mid-write
        f.write(json.dumps({"step": 3, "reward": 99.0}) + "\n" + '{"step": 4, "rew')
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    # what may change: memory settings (micro-batches: update_policy divides by the mini-batch's token count), the
    # measurement (it restores the weights and draws no random numbers)
    args = train_args(["--resume", "--output_dir", str(tmp_path / "b"), "--steps", "3", "--micro_batch_size", "1",
                       "--gradient_checkpointing", "true", "--eval_every", "1", "--diagnose_every", "1"])
    cfg = lopti.resolve_config(args)
    assert cfg.model == str(tiny_model_dir) and cfg.steps == 3  # the saved config, with the explicit override
    resumed = lopti.train(cfg, resume=True)
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == {
        **saved, "steps": 3, "micro_batch_size": 1, "gradient_checkpointing": True, "eval_every": 1,
        "diagnose_every": 1}
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # (the torn line and step 3 written before the "crash" are dropped on resume)
    a, b = (lopti.load_model(str(p), CPU).state_dict() for p in (straight, resumed))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    last = [json.loads((tmp_path / p / "metrics.jsonl").read_text().splitlines()[-1]) for p in "ab"]
    assert last[0]["reward"] == last[1]["reward"]


def test_cli_train_and_eval(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out = tmp_path / "run"
    lopti.main(["train", "--model", str(tiny_model_dir), "--output-dir", str(out), "--steps", "1",
                "--prompts-per-step", "2", "--num-generations", "2", "--mini-batch-size", "4", "--num-train", "8",
                "--max-completion-length", "4", "--num-people", "3", "--eval-size", "2", "--lopti", "false"])
    assert json.loads((out / "config.json").read_text())["lopti"] is False
    assert (out / "checkpoint" / "trainer_state.pt").exists()
    monkeypatch.setattr(lopti, "kk_reward", lambda text, sol: 3.0)
    capsys.readouterr()
    data = Path(__file__).parent / "data" / "kk" / "4ppl_20.jsonl"
    lopti.main(["eval", "--model", str(out / "checkpoint"), "--eval-data", str(data), "--max-completion-length", "2"])
    assert json.loads(capsys.readouterr().out) == {"eval/accuracy_4ppl": 1.0, "eval/reward_4ppl": 3.0,
                                                  "eval/accuracy": 1.0}


def test_ctrl_c_finishes_the_step_saves_and_exits_130(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    real_step = lopti.train_step

    def interrupted_step(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C during the step
        return real_step(*args, **kwargs)

    monkeypatch.setattr(lopti, "train_step", interrupted_step)
    monkeypatch.setattr(lopti, "evaluate", lambda *a: pytest.fail("Ctrl-C saves without evaluating"))
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs as a background job
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", steps=5, save_every=0)
    with pytest.raises(KeyboardInterrupt, match="after step 1"):
        lopti.train(cfg)
    ckpt = tmp_path / "run" / "checkpoint"
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"] == 1
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored
    # from the command line: one line, exit code 130, and --resume continues at step 2
    argv = ["train", "--resume", "--output_dir", str(cfg.output_dir), "--steps", "3"]
    assert lopti.main(argv) == 130
    assert "--resume" in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.setattr(lopti, "train_step", real_step)
    monkeypatch.undo()
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    assert lopti.main(argv) == 0
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("argv", [[], ["fly"], ["train", "--num_generation", "3"], ["train", "--lopti", "maybe"],
                                  ["eval", "--alpha", "0.1"], ["plot"]])
def test_usage_errors_are_one_line_and_exit_2(argv, capsys):
    """No command, an unknown one, an abbreviated option, a bad value, another command's option, no run folder."""
    with pytest.raises(SystemExit) as exit_:
        lopti.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "error" in err, err


@pytest.mark.parametrize("command", ["", "toy", "train", "eval", "plot"])
def test_help_exits_0_and_lists_only_the_commands_options(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        lopti.main([command, "--help"] if command else ["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "usage: lopti.py" in out
    assert ("--alpha" in out) == (command in ("train", "toy"))
    assert ("--eval-data" in out) == (command in ("train", "eval"))
    assert ("--resume" in out) == (command == "train") and ("--quick" in out) == (command == "toy")


@pytest.mark.parametrize("argv,match", [
    (["train", "--learning_rate", "-1e-6"], "learning_rate must be > 0, got -1e-06"),
    (["train", "--learning_rate", "inf"], "learning_rate must be a finite float"),
    (["train", "--weight_decay", "nan"], "weight_decay must be a finite float"),
    (["train", "--beta", "inf"], "beta must be a finite float"),
    (["train", "--num_people", "3-9"], "num_people"),
    (["train", "--model", "./no/such/folder"], "no model folder"),
    (["eval", "--model", "./no/such/folder"], "no model folder"),
    (["eval", "--model", "no-such-org/no-such-model", "--eval_data", "missing.jsonl"], "no such file"),
    (["train", "--resume", "--output_dir", "no/such/run"], "config.json not found")])
def test_user_errors_are_one_line_before_any_model_loads(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(lopti, "load_model", lambda *a, **k: pytest.fail("checked after loading the model"))
    assert lopti.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err


def test_output_dir_that_is_a_file_fails_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lopti, "load_model", lambda *a, **k: pytest.fail("checked after loading the model"))
    (tmp_path / "f").write_text("")
    assert lopti.main(["train", "--output_dir", str(tmp_path / "f"), "--model", str(tmp_path)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_debug_shows_the_traceback():
    with pytest.raises(FileNotFoundError):
        lopti.main(["eval", "--model", "./no/such/folder", "--debug"])


def test_readme_has_python_blocks():
    assert len(README_BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(README_BLOCKS)))
def test_readme_block_runs_as_written(i, monkeypatch):
    if "LoptiGRPOTrainer" in README_BLOCKS[i]:
        pytest.importorskip("trl")  # optional; CI installs it
    monkeypatch.chdir(ROOT)  # (it reads tests/data/kk)
    exec(compile(README_BLOCKS[i], f"README block {i}", "exec"), {"__name__": "readme"})


def test_ctrl_c_outside_a_resumable_run_says_interrupted_without_resume(monkeypatch, capsys):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(lopti, "evaluate_model", interrupt)
    assert lopti.main(["eval", "--model", "./anything"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "lopti.py eval: interrupted"  # not an empty message, and no --resume advice for eval


def test_output_dir_under_a_file_fails_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lopti, "load_model", lambda *a, **k: pytest.fail("checked after loading the model"))
    monkeypatch.setattr(lopti, "load_tokenizer", lambda *a, **k: pytest.fail("checked after loading the tokenizer"))
    (tmp_path / "f").write_text("")
    assert lopti.main(["train", "--output_dir", str(tmp_path / "f" / "sub"), "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def files(folder: Path) -> dict:
    """Every file under a run folder, with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


TINY_FLAGS = ["--prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
              "--mini_batch_size", "4", "--micro_batch_size", "2", "--num_train", "16", "--num_people", "3",
              "--eval_size", "2", "--eval_every", "0", "--learning_rate", "1e-3"]


def test_sigterm_finishes_the_step_saves_and_exits_143(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM to `python lopti.py train`: the step in progress is finished and saved, one line, exit
    143; --resume continues from it."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "lopti.py"), "train", "--model", str(tiny_model_dir), "--output_dir", str(out),
           "--steps", "1000", "--save_every", "0", *TINY_FLAGS]
    run = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1):
        assert run.poll() is None and time.time() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)  # during step 2 or later, with no checkpoint yet (save_every 0)
    err = run.communicate(timeout=300)[1]
    steps = [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")]
    assert run.returncode == 143, err[-3000:]
    assert err.splitlines()[-1] == f"lopti.py train: SIGTERM: stopped after step {steps[-1]} and saved it; " \
                                   "continue with --resume"
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)["step"] == steps[-1] == len(steps)
    assert [r["step"] for r in lopti.read_jsonl(out / "samples.jsonl")] == steps
    assert lopti.main(["train", "--resume", "--output_dir", str(out), "--steps", str(len(steps) + 1)]) == 0
    assert [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")] == list(range(1, len(steps) + 2))


@pytest.fixture
def sigterm_fails():
    """A SIGTERM handler that fails the test (not the default, which would end pytest): train must replace it while
    it runs, and restore it."""
    def mine(*a):
        pytest.fail("SIGTERM reached the handler that train replaces")

    before = signal.signal(signal.SIGTERM, mine)
    yield mine
    signal.signal(signal.SIGTERM, before)


def test_a_second_signal_during_the_save_aborts_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path,
                                                                               monkeypatch, sigterm_fails):
    """SIGTERM during step 3 (whose evaluation is then skipped), and again while step 3's checkpoint is written:
    the save is abandoned, step 2's checkpoint stays, and --resume redoes step 3."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    real_step, real_save, evaluated = lopti.train_step, torch.save, []

    def step(*args, **kwargs):
        if len(evaluated) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    def save(obj, path, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a second signal before trainer_state.pt (SIGTERM again: one)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(lopti, "train_step", step)
    monkeypatch.setattr(lopti, "evaluate", lambda *a: evaluated.append(1) or {})
    monkeypatch.setattr(torch, "save", save)
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", steps=5, eval_every=1, save_every=1)
    with pytest.raises(lopti.Stopped, match="SIGINT: sent twice, aborted without saving") as stopped:
        lopti.train(cfg)
    assert stopped.value.signum == signal.SIGINT and len(evaluated) == 2
    assert signal.getsignal(signal.SIGTERM) is sigterm_fails  # restored
    ckpt = lopti.latest_checkpoint(cfg.output_dir)
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"] == 2
    lopti.load_model(str(ckpt), CPU)  # the weights of step 2 load
    monkeypatch.undo()
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    lopti.train(dataclasses.replace(cfg, steps=3, eval_every=0), resume=True)
    assert [r["step"] for r in lopti.read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_a_signal_while_loading_stops_before_the_first_step(tiny_model_dir, tmp_path, monkeypatch, sigterm_fails):
    real_data = lopti.load_task_data

    def data(*args):  # SIGTERM while the run loads its data and model
        os.kill(os.getpid(), signal.SIGTERM)
        return real_data(*args)

    monkeypatch.setattr(lopti, "load_task_data", data)
    monkeypatch.setattr(lopti, "train_step", lambda *a: pytest.fail("a step started after the signal"))
    with pytest.raises(lopti.Stopped, match="SIGTERM: stopped before step 1") as stopped:
        lopti.train(tiny_config(tiny_model_dir, tmp_path / "run"))
    assert stopped.value.signum == signal.SIGTERM and lopti.latest_checkpoint(str(tmp_path / "run")) is None


def test_resume_refuses_other_settings_before_loading_or_writing(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out = tmp_path / "run"
    lopti.train(tiny_config(tiny_model_dir, out, steps=2))
    before, _ = files(out), capsys.readouterr()
    monkeypatch.setattr(lopti, "load_task_data", lambda *a: pytest.fail("refused after loading the data"))
    monkeypatch.setattr(lopti, "load_model", lambda *a, **k: pytest.fail("refused after loading the model"))
    for flags, match in ((["--alpha", "0.9", "--lopti", "false", "--steps", "4"],
                          "(alpha 0.3 -> 0.9, lopti True -> False)"),
                         (["--steps", "1"], "is at step 2, past --steps 1")):
        assert lopti.main(["train", "--resume", "--output_dir", str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err
        assert files(out) == before  # config.json, the logs and the checkpoint as they were


def test_a_folder_in_use_by_another_train_is_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Two `train` commands on one folder: the second is refused while the first holds the folder's lock (here
    taken as train takes it, by another open file), and nothing is written."""
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(lopti, "load_task_data", lambda *a: pytest.fail("refused after loading the data"))
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert lopti.main(["train", "--model", str(tiny_model_dir), "--output_dir", str(out), *TINY_FLAGS]) == 2
    finally:
        os.close(fd)
    assert "in use by another run" in capsys.readouterr().err and files(out) == {}


def test_resume_reads_and_writes_the_folder_it_was_given(tmp_path, monkeypatch):
    """A run folder moved after it began (config.json names the old place) resumes where it is now, also when the
    folder is the default or the preset's."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / Config.output_dir
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(Config(output_dir="old/place"))))
    assert lopti.resolve_config(train_args(["--resume"])).output_dir == Config.output_dir


def test_diagnose_bad_input_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A model without a chat template, a folder that is not a run's checkpoint, a negative --diagnose_every."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(lopti, "load_model", lambda *a, **k: pytest.fail("checked after loading the model"))
    out = tmp_path / "out"
    for argv, match in ((["diagnose", "--model", str(bare)], "has no chat template"),
                        (["diagnose", "--checkpoint", str(tiny_model_dir)], "is not a checkpoint of a lopti run"),
                        (["diagnose", "--diagnose_every", "-1"], "diagnose_every must be >= 0"),
                        (["train", "--diagnose_every", "-1"], "diagnose_every must be >= 0"),
                        (["train", "--engine", "trl", "--diagnose_every", "2"], "--engine trl has no --diagnose_every")):
        assert lopti.main([*argv, "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err
    assert not out.exists()
