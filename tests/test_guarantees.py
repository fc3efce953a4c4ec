"""What `lopti.py train` guarantees a user (train(), save_checkpoint, resolve_config, main): a signal saves and exits
143/130 (in the warm-up: unsaved, --resume redoes it), a second one aborts keeping the last checkpoint; a crash loses
at most save_every steps and --resume gives the steps and metrics of a run never stopped; checkpoints are written as
.tmp and renamed; a folder that is not a run is never written into, and nothing is written before the model loads;
--resume refuses a changed method or evaluation; no non-finite weight is saved; trainer_state.pt loads with
weights_only=True; a bad value or data file is one line, exit 2, nothing written; out of memory is one hint."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

import lopti
from conftest import tiny_config, varied_reward

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "kk"
CPU = torch.device("cpu")
TINY_FLAGS = ["--prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
              "--mini_batch_size", "4", "--micro_batch_size", "2", "--num_train", "16", "--num_people", "3",
              "--eval_size", "2", "--eval_every", "0", "--eval_batch_size", "4", "--save_every", "1",
              "--learning_rate", "1e-3", "--weight_decay", "0"]  # = conftest's tiny_config
TIMINGS = ("time/",)  # what differs between two runs of the same steps


def varied_rewards(completions, solutions):
    """kk_rewards' shape (B,), with variance inside groups (a random tiny model always scores -3: no advantage)."""
    return torch.tensor([varied_reward(c, s) for c, s in zip(completions, solutions)])


def use_varied_rewards(monkeypatch) -> None:
    """lopti.kk_rewards (--reward kk) replaced by varied_rewards; reward_function, which caches the function of
    "kk", reads it afresh meanwhile (so its cache never holds the stand-in)."""
    monkeypatch.setattr(lopti, "kk_rewards", varied_rewards)
    monkeypatch.setattr(lopti, "reward_function", getattr(lopti.reward_function, "__wrapped__", lopti.reward_function))


@pytest.fixture
def rewards(monkeypatch):
    use_varied_rewards(monkeypatch)


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model, tokenizer or the puzzles load: the check must come first."""
    for name in ("load_model", "load_tokenizer", "load_task_data"):
        monkeypatch.setattr(lopti, name, lambda *a, **k: pytest.fail("checked after loading"))


@pytest.fixture
def sigterm_fails():
    """A SIGTERM handler that fails the test (the default would end pytest): train must replace it while it runs,
    and restore it."""
    def mine(*a):
        pytest.fail("SIGTERM reached the handler that train replaces")

    before = signal.signal(signal.SIGTERM, mine)
    yield mine
    signal.signal(signal.SIGTERM, before)


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished 1-step run of the tiny model (checkpoint-1); tests copy it before changing it."""
    out = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as mp:
        use_varied_rewards(mp)
        lopti.train(tiny_config(tiny_model_dir, out, steps=1))
    return out


def train_argv(model_dir, out, *flags) -> list[str]:
    return ["train", "--model", str(model_dir), "--output_dir", str(out), *TINY_FLAGS, *flags]


def run_main(argv) -> int:
    """main's exit code, argparse's SystemExit included."""
    try:
        return lopti.main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def files(folder: Path) -> dict:
    """Every file under a folder, with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(capsys, *words) -> str:
    """The command's one message (progress bars aside), which must hold every word; no traceback."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("lopti.py")]
    assert len(lines) == 1 and all(w in lines[0] for w in words) and "Traceback" not in err, err[-3000:]
    return lines[0]


def steps_logged(run: Path, name: str = "metrics.jsonl") -> list[int]:
    return [r["step"] for r in lopti.read_jsonl(run / name) if "reward" in r or name != "metrics.jsonl"]


def rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in lopti.read_jsonl(run / "metrics.jsonl")]


def step_of(ckpt: Path) -> int:
    return torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"]


# --- signals: the step in progress is finished and saved, exit 128 + signal; a second signal aborts

DRIVER = """
import sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
import lopti
from test_guarantees import varied_rewards

lopti.kk_rewards = varied_rewards
flags, real_step, calls = Path(sys.argv[1]), lopti.train_step, []

def step(*args, **kwargs):  # step 2 waits, before its work, until the test has sent its signal
    calls.append(1)
    if len(calls) == 2:
        (flags / "in_step_2").touch()
        while not (flags / "sent").exists():
            time.sleep(0.01)
    return real_step(*args, **kwargs)

lopti.train_step = step
sys.exit(lopti.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_step_saves_and_exits_128_plus_it(signum, code, tiny_model_dir, tmp_path, rewards):
    """`python lopti.py train` sent SIGTERM (a scheduler) or SIGINT (Ctrl-C) during step 2 of 5, with no checkpoint
    due (save_every 0): step 2 is finished, logged and saved, the exit code is 128 + the signal's, a line says
    --resume, and --resume continues from step 2."""
    out, flags = tmp_path / "run", tmp_path / "flags"
    flags.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    argv = train_argv(tiny_model_dir, out, "--steps", "5", "--save_every", "0")
    run = subprocess.Popen([sys.executable, str(driver), str(flags), *argv], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while not (flags / "in_step_2").exists():
            assert run.poll() is None and time.time() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.02)
        run.send_signal(signum)
        (flags / "sent").touch()
        err = run.communicate(timeout=120)[1]
    finally:
        run.kill()
    assert run.returncode == code, err[-3000:]
    assert any("after step 2" in x and "--resume" in x for x in err.splitlines()), err[-3000:]
    assert [p.name for p in lopti.checkpoints(out)] == ["checkpoint-2"] and step_of(out / "checkpoint-2") == 2
    assert steps_logged(out) == steps_logged(out, "samples.jsonl") == [1, 2]
    assert run_main(["train", "--resume", "--output_dir", out, "--steps", "3"]) == 0
    assert steps_logged(out) == [1, 2, 3]


def test_a_second_signal_aborts_the_save_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path, rewards,
                                                                        monkeypatch, capsys, sigterm_fails):
    """SIGTERM during step 2, then Ctrl-C while step 2's checkpoint is being written: the save is abandoned, exit
    130, checkpoint-1 stays whole (the half-written one is only a .tmp), the handlers are restored, and --resume
    redoes step 2."""
    out, real_step, real_save, calls = tmp_path / "run", lopti.train_step, \
        transformers.PreTrainedModel.save_pretrained, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    def save(self, path, *args, **kwargs):
        real_save(self, path, *args, **kwargs)
        if Path(path).name.startswith("checkpoint-2"):
            os.kill(os.getpid(), signal.SIGINT)  # before the tokenizer and trainer_state.pt

    monkeypatch.setattr(lopti, "train_step", step)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save)
    assert run_main(train_argv(tiny_model_dir, out, "--steps", "4")) == 130
    assert "interrupted" in capsys.readouterr().err.strip().splitlines()[-1]
    assert signal.getsignal(signal.SIGTERM) is sigterm_fails
    assert [p.name for p in lopti.checkpoints(out)] == ["checkpoint-1"] and step_of(out / "checkpoint-1") == 1
    lopti.load_model(str(out / "checkpoint-1"), CPU)  # whole
    monkeypatch.setattr(lopti, "train_step", real_step)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real_save)
    assert run_main(["train", "--resume", "--output_dir", out, "--steps", "2"]) == 0
    assert steps_logged(out) == steps_logged(out, "samples.jsonl") == [1, 2]


def test_a_signal_during_an_evaluation_starts_no_further_step(tiny_model_dir, tmp_path, rewards, monkeypatch,
                                                              sigterm_fails):
    """SIGTERM during step 1's evaluation (the second, after step 0's): step 1 is saved, step 2 never starts."""
    calls, evaluations, real_step, real_evaluate = [], [], lopti.train_step, lopti.evaluate

    def evaluate_then_sigterm(*args, **kwargs):
        evaluations.append(1)
        if len(evaluations) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(lopti, "train_step", lambda *a, **k: calls.append(1) or real_step(*a, **k))
    monkeypatch.setattr(lopti, "evaluate", evaluate_then_sigterm)
    with pytest.raises(SystemExit) as exit_:
        lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", steps=4, eval_every=1))
    assert exit_.value.code == 143 and len(calls) == 1 and step_of(lopti.checkpoints(tmp_path / "run")[-1]) == 1


def test_a_signal_during_the_step_0_evaluation_saves_the_warmed_up_model(tiny_model_dir, tmp_path, rewards,
                                                                       monkeypatch, sigterm_fails):
    """SIGTERM while step 0 (after the warm-up) is evaluated: checkpoint-0 is saved, no RL step starts, and --resume
    starts from it without a second warm-up or a second step-0 evaluation."""
    real_evaluate, warmed, out = lopti.evaluate, [], tmp_path / "run"

    def evaluate_then_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(lopti, "evaluate", evaluate_then_sigterm)
    monkeypatch.setattr(lopti, "warm_up", lambda *a, **k: warmed.append(1))
    cfg = tiny_config(tiny_model_dir, out, steps=2, warmup_steps=1)
    with pytest.raises(SystemExit) as exit_:
        lopti.train(cfg)
    assert exit_.value.code == 143 and [p.name for p in lopti.checkpoints(out)] == ["checkpoint-0"]
    assert [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")] == [0]
    monkeypatch.setattr(lopti, "evaluate", real_evaluate)
    lopti.train(cfg, resume=True)
    assert warmed == [1] and [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 2]


# --- a crash: at most save_every steps lost; --resume gives the run never stopped


def test_a_run_killed_mid_run_resumes_to_the_steps_and_metrics_of_a_run_never_stopped(tiny_model_dir, tmp_path,
                                                                                       rewards, monkeypatch):
    """5 steps straight, against a run that dies in step 4 (save_every 2: checkpoint-2; step 3 logged, and a line
    torn by the kill) then resumes: every step logged once, and each step's metrics and the final weights equal."""
    straight = lopti.train(tiny_config(tiny_model_dir, tmp_path / "straight", steps=5, save_every=2))
    out, real_step, calls = tmp_path / "run", lopti.train_step, []

    def dies_in_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(lopti, "train_step", dies_in_step_4)
    with pytest.raises(RuntimeError, match="killed"):
        lopti.train(tiny_config(tiny_model_dir, out, steps=5, save_every=2))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')  # as a kill -9 while writing leaves it
    assert [p.name for p in lopti.checkpoints(out)] == ["checkpoint-2"] and steps_logged(out) == [1, 2, 3]
    monkeypatch.setattr(lopti, "train_step", real_step)
    assert run_main(["train", "--resume", "--output_dir", out]) == 0
    assert steps_logged(out) == steps_logged(out, "samples.jsonl") == [1, 2, 3, 4, 5]
    assert rows(out) == rows(tmp_path / "straight")
    a, b = (lopti.load_model(str(p), CPU).state_dict() for p in (straight, lopti.checkpoints(out)[-1]))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_is_written_as_tmp_and_a_failed_save_keeps_the_previous(tiny_model_dir, tmp_path, rewards,
                                                                              monkeypatch, capsys):
    """The disk fills while step 2's weights are written: checkpoint-1 stays the latest and whole, exit 2 in one
    line, and --resume redoes step 2 (without the .tmp folder, checkpoint-2 would be taken for a complete one, or
    checkpoint-1 removed)."""
    out, real_save, paths = tmp_path / "run", transformers.PreTrainedModel.save_pretrained, []

    def fills_the_disk(self, path, *args, **kwargs):
        paths.append(Path(path))
        real_save(self, path, *args, **kwargs)
        if len(paths) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", fills_the_disk)
    assert run_main(train_argv(tiny_model_dir, out, "--steps", "3")) == 2
    one_line(capsys, os.strerror(errno.ENOSPC))
    assert [p.name for p in paths] == ["checkpoint-1.tmp", "checkpoint-2.tmp"]
    assert [p.name for p in lopti.checkpoints(out)] == ["checkpoint-1"] and step_of(out / "checkpoint-1") == 1
    lopti.load_model(str(out / "checkpoint-1"), CPU)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real_save)
    assert run_main(["train", "--resume", "--output_dir", out]) == 0
    assert steps_logged(out) == [1, 2, 3] and sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint-3"]


# --- folders that are not a run are never written into


@pytest.mark.parametrize("what", ["model", "other files", "finished run"])
def test_train_refuses_a_non_empty_folder_before_writing(what, tiny_model_dir, trained_run, tmp_path, capsys,
                                                          no_loading):
    """A model's folder (the easy slip: --output_dir where --model was meant), a folder of other files, another run
    without --resume: one line, exit 2, every file as it was, nothing loaded."""
    folder = {"model": tiny_model_dir, "finished run": trained_run, "other files": tmp_path}[what]
    (tmp_path / "notes.txt").write_text("mine")
    before = files(folder)
    assert run_main(train_argv(tiny_model_dir, folder)) == 2
    one_line(capsys, str(folder))
    assert files(folder) == before


@pytest.mark.parametrize("what", ["model", "empty", "missing"])
def test_resume_refuses_a_folder_that_holds_no_run(what, tiny_model_dir, tmp_path, capsys, no_loading):
    """--resume on a model's folder (its config.json is the model's), an empty or a missing folder: one line naming
    the folder, exit 2, nothing written or loaded."""
    folder = {"model": tiny_model_dir, "empty": tmp_path, "missing": tmp_path / "missing"}[what]
    before = files(folder) if folder.exists() else None
    assert run_main(["train", "--resume", "--output_dir", folder]) == 2
    one_line(capsys, str(folder))
    assert (files(folder) if folder.exists() else None) == before


# --- --resume: the method stays, the schedule and memory settings may change


@pytest.mark.parametrize("flag,value", [
    ("alpha", "0.1"), ("lopti", "false"), ("eta", "0.3"), ("lopti_order", "high_first"), ("beta", "0"),
    ("epsilon_high", "0.2"), ("temperature", "1.0"), ("num_generations", "2"), ("optimizer", "sgd"),
    ("warmup_steps", "3"), ("max_completion_length", "8"), ("seed", "1"), ("model", "some/other-model"),
    ("eval_size", "3"), ("eval_data", str(DATA / "3ppl_20.jsonl"))])  # (the evaluation puzzles are step 0's)
def test_resume_refuses_a_changed_method_setting_before_writing(flag, value, trained_run, capsys, no_loading):
    before = files(trained_run)
    assert run_main(["train", "--resume", "--output_dir", trained_run, f"--{flag}", value, "--steps", "2"]) == 2
    one_line(capsys, "--resume may not change", flag)
    assert files(trained_run) == before


MAY_CHANGE = {"steps": "3", "eval_every": "1", "save_every": "2", "eval_batch_size": "2", "micro_batch_size": "1",
              "generation_batch_size": "4",
              "gradient_checkpointing": "true", "measure_update": "false", "learning_rate": "1e-4",
              "output_dir": None, "report_to": "tensorboard",  # (output_dir: the run copied to another folder)
              "reward": "lopti:kk_rewards"}  # (a function's record, module:name, may not load from the command line)


def test_may_change_covers_resume_may_change():
    assert set(MAY_CHANGE) == set(lopti.RESUME_MAY_CHANGE)


def test_resume_of_a_tensorboard_run_without_tensorboard_is_one_line_or_turns_it_off(trained_run, tmp_path,
                                                                                  monkeypatch, capsys):
    """A run logged to TensorBoard, resumed where the package is missing: one line naming the package (not "no
    run"), nothing written; with --report_to none it resumes (train goes on to pick a device: stopped there)."""
    class Passed(Exception):
        pass

    def passed():
        raise Passed

    run = shutil.copytree(trained_run, tmp_path / "tb")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "report_to": "tensorboard"}))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # (and an earlier import)
    before = files(run)
    assert run_main(["train", "--resume", "--output_dir", run]) == 2
    assert "holds no run" not in one_line(capsys, "pip install tensorboard") and files(run) == before
    monkeypatch.setattr(lopti, "pick_device", passed)
    with pytest.raises(Passed):
        lopti.main(["train", "--resume", "--output_dir", str(run), "--report_to", "none"])


@pytest.mark.parametrize("flag", sorted(MAY_CHANGE))
def test_resume_accepts_a_schedule_or_memory_setting(flag, trained_run, tmp_path, monkeypatch):
    """Each of RESUME_MAY_CHANGE passes the settings check (train goes on to pick a device: stopped there)."""
    class Passed(Exception):
        pass

    def passed():
        raise Passed

    if flag == "report_to":
        pytest.importorskip("tensorboard")
    run = shutil.copytree(trained_run, tmp_path / "moved") if flag == "output_dir" else trained_run
    monkeypatch.setattr(lopti, "pick_device", passed)
    with pytest.raises(Passed):
        lopti.main(["train", "--resume", "--output_dir", str(run)] +
                   ([f"--{flag}", MAY_CHANGE[flag]] if MAY_CHANGE[flag] else []))


def test_a_lower_learning_rate_on_resume_is_the_one_used(trained_run, tmp_path, rewards, monkeypatch):
    run, real, seen = shutil.copytree(trained_run, tmp_path / "run"), lopti.update_policy, []

    def update(cfg, logprob_fn, optimizer, batch):
        seen.append([g["lr"] for g in optimizer.param_groups])
        return real(cfg, logprob_fn, optimizer, batch)

    monkeypatch.setattr(lopti, "update_policy", update)
    assert run_main(["train", "--resume", "--output_dir", run, "--steps", "2", "--learning_rate", "1e-4"]) == 0
    assert seen == [[1e-4]]
    assert [r["learning_rate"] for r in lopti.read_jsonl(run / "metrics.jsonl") if "reward" in r] == [1e-3, 1e-4]
    state = torch.load(run / "checkpoint-2" / "trainer_state.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [1e-4]


# --- no non-finite weight is saved


def test_a_diverging_step_is_one_line_saves_nothing_and_resume_continues(tiny_model_dir, tmp_path, rewards,
                                                                          monkeypatch, capsys):
    """Step 2's update leaves a NaN weight: one line naming step 2 and --learning_rate, exit 2, step 2 neither
    logged nor saved; --resume --learning_rate LOWER continues from checkpoint-1 to finite weights."""
    out, real, calls = tmp_path / "run", lopti.update_policy, []

    def diverges_in_step_2(cfg, logprob_fn, optimizer, batch):
        metrics = real(cfg, logprob_fn, optimizer, batch)
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][-1].view(-1)[0] = float("nan")
        return metrics

    monkeypatch.setattr(lopti, "update_policy", diverges_in_step_2)
    assert run_main(train_argv(tiny_model_dir, out, "--steps", "3")) == 2
    one_line(capsys, "step 2", "--resume", "--learning_rate")
    assert [p.name for p in out.glob("checkpoint*")] == ["checkpoint-1"] and steps_logged(out) == [1]
    monkeypatch.setattr(lopti, "update_policy", real)
    assert run_main(["train", "--resume", "--output_dir", out, "--learning_rate", "1e-4"]) == 0
    assert steps_logged(out) == [1, 2, 3]
    model = lopti.load_model(str(out / "checkpoint-3"), CPU)
    assert all(p.isfinite().all() for p in model.parameters())


# --- saved state loads with weights_only=True


class RunsCode:
    """A pickle that runs code when loaded without weights_only: it writes `path`."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('ran')",)


def test_a_trainer_state_that_pickles_code_is_refused(trained_run, tmp_path, rewards, capsys):
    run, ran = shutil.copytree(trained_run, tmp_path / "run"), tmp_path / "ran"
    state = run / "checkpoint-1" / "trainer_state.pt"
    torch.save({**torch.load(state, weights_only=True), "payload": RunsCode(ran)}, state)
    torch.load(state, weights_only=False)  # the payload works: a plain torch.load would run it
    assert ran.exists()
    ran.unlink()
    before = files(run)
    assert lopti.main(["train", "--resume", "--output_dir", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer_state.pt cannot be loaded" in err, err
    assert not ran.exists() and files(run) == before


# --- a bad value or data file: one line naming it, exit 2, nothing written


def data_file(tmp_path: Path, kind: str) -> Path:
    """A K&K file that is not JSON, whose second row's solution is not its puzzle's, or whose second row names 30
    people, every one in its quiz (a solver would try 2^30 worlds)."""
    path, good = tmp_path / f"{kind}.jsonl", (DATA / "3ppl_20.jsonl").read_text().splitlines()
    if kind == "not_json":
        path.write_text(good[0] + "\n" + good[1][:50] + "\n")
    elif kind == "thirty_people":
        row = json.loads(good[1])
        row["statements"] = [["telling-truth", i % 30] for i in range(1, 31)]
        row["solution_text_format"] = "\n".join(f"({i}) {n} is a knight"
                                                for i, n in enumerate(lopti.KK_NAMES[:30], 1))
        row["quiz"] += " " + " ".join(lopti.KK_NAMES[:30])
        path.write_text(good[0] + "\n" + json.dumps(row) + "\n")
    else:
        row = json.loads(good[1])
        row["solution_text_format"] = row["solution_text_format"].replace("knight", "KNAVE").replace(
            "knave", "knight").replace("KNAVE", "knave")
        path.write_text(good[0] + "\n" + json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("flag,value,named", [
    ("alpha", "1.5", "alpha"), ("num_people", "3-9", "num_people"), ("micro_batch_size", "3", "mini_batch_size"),
    ("learning_rate", "nan", "learning_rate"), ("learning_rate", "inf", "learning_rate"), ("beta", "inf", "beta"),
    ("steps", "ten", "--steps"), ("lopti", "maybe", "--lopti"),
    ("preset", "huge", "--preset"), ("train_data", "not_json", "not_json.jsonl"),
    ("train_data", "thirty_people", "must name 2 to 8 people"),
    ("train_data", "wrong_solution", "row 2"), ("eval_data", "wrong_solution", "wrong_solution.jsonl"),
    ("train_data", "missing.jsonl", "missing.jsonl")])
def test_a_bad_value_or_data_file_is_one_line_exit_2_and_writes_nothing(flag, value, named, tiny_model_dir, tmp_path,
                                                                         capsys, monkeypatch):
    monkeypatch.setattr(lopti, "load_model", lambda *a, **k: pytest.fail("checked after loading the model"))
    if value in ("not_json", "wrong_solution", "thirty_people"):
        value = str(data_file(tmp_path, value))
    out = tmp_path / "run"
    assert run_main(train_argv(tiny_model_dir, out, f"--{flag}", value)) == 2
    one_line(capsys, named)
    assert not out.exists()


# --- out of memory: one hint, at the top level


@pytest.mark.parametrize("where,error", [
    ("train_step", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")),
    ("update_policy", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")),
    ("rollout", RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")),
    ("batched_logprobs", MemoryError())])
def test_out_of_memory_is_one_line_naming_micro_batch_size_exit_1(where, error, tiny_model_dir, tmp_path, rewards,
                                                                   monkeypatch, capsys):
    def oom(*a, **k):
        raise error

    monkeypatch.setattr(lopti, where, oom)
    assert run_main(train_argv(tiny_model_dir, tmp_path / "run", "--steps", "2")) == 1
    one_line(capsys, "out of memory", "--micro_batch_size")


def test_another_runtime_error_is_not_called_out_of_memory(tiny_model_dir, tmp_path, rewards, monkeypatch):
    def bug(*a, **k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(lopti, "update_policy", bug)
    with pytest.raises(RuntimeError, match="shapes"):
        lopti.main(train_argv(tiny_model_dir, tmp_path / "run", "--steps", "2"))


# --- the warm-up: a signal ends it unsaved, --resume redoes it


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_in_the_warm_up_exits_unsaved_and_resume_redoes_it(signum, code, tiny_model_dir, tmp_path, rewards,
                                                                    monkeypatch, capsys, sigterm_fails):
    """A signal during warm-up step 2 of 3: that step ends, nothing of the warm-up is saved, one line says --resume
    redoes it, exit 128 + the signal; the folder holds only config.json and empty logs (not_started), and --resume
    redoes the (deterministic) warm-up: the run's steps and weights equal those of a run never stopped."""
    straight = lopti.train(tiny_config(tiny_model_dir, tmp_path / "straight", warmup_steps=3, steps=1))
    out, real_analysis, calls = tmp_path / "run", lopti.kk_case_analysis, []

    def signal_in_step_2(row):
        calls.append(1)
        if len(calls) == 3:  # (2 puzzles a step)
            os.kill(os.getpid(), signum)
        return real_analysis(row)

    monkeypatch.setattr(lopti, "kk_case_analysis", signal_in_step_2)
    cfg = tiny_config(tiny_model_dir, out, warmup_steps=3, steps=1)
    with pytest.raises(SystemExit) as exit_:
        lopti.train(cfg)
    assert exit_.value.code == code and len(calls) == 4  # steps 1 and 2, not 3
    assert "lopti.py: stopped in warm-up step 3, unsaved; --resume redoes the warm-up" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.jsonl", "samples.jsonl"]
    assert lopti.not_started(out) and signal.getsignal(signal.SIGTERM) is sigterm_fails
    monkeypatch.setattr(lopti, "kk_case_analysis", real_analysis)
    assert run_main(["train", "--resume", "--output_dir", out]) == 0
    assert [p.name for p in lopti.checkpoints(out)] == ["checkpoint-1"] and rows(out) == rows(tmp_path / "straight")
    a, b = (lopti.load_model(str(p), CPU).state_dict() for p in (straight, lopti.checkpoints(out)[-1]))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_warm_up_is_kept_as_checkpoint_0(tiny_model_dir, tmp_path, rewards, monkeypatch):
    """Killed in RL step 1 (no checkpoint due yet): --resume starts from the warmed-up checkpoint-0, no second
    warm-up."""
    warmed, real_step, real_warm_up = [], lopti.train_step, lopti.warm_up

    def killed(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(lopti, "warm_up", lambda *a, **k: warmed.append(1) or real_warm_up(*a, **k))
    monkeypatch.setattr(lopti, "train_step", killed)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="killed"):
        lopti.train(tiny_config(tiny_model_dir, out, warmup_steps=1, steps=2, save_every=0))
    assert [p.name for p in lopti.checkpoints(out)] == ["checkpoint-0"]
    monkeypatch.setattr(lopti, "train_step", real_step)
    assert run_main(["train", "--resume", "--output_dir", out]) == 0 and warmed == [1]


# --- every value and output path checked before the first file is written


@pytest.mark.parametrize("argv,words", [
    (["train", "--seed", str(1_733_000_000_000_000_000)], ["seed must be below 2**32"]),
    (["eval", "--output_dir", "x"], ["unrecognized arguments: --output_dir"]),
    (["diagnose", "--save_every", "1"], ["unrecognized arguments: --save_every"]),
    (["diagnose", "--out", "RUN/metrics.jsonl"], ["must name a .json file"]),
    (["diagnose", "--out", "RUN/config.json"], ["exists and is not diagnose's"]),
    (["diagnose", "--out", "RUN"], ["must name a .json file"]),
    (["plot", "RUN/checkpoint-1"], ["is not a folder written by lopti.py train"]),
    (["compare", "RUN", "RUN/checkpoint-1"], ["is not a folder written by lopti.py train"])])
def test_a_bad_value_or_output_path_is_one_line_before_any_work(argv, words, trained_run, tmp_path, capsys,
                                                               no_loading):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = files(run)
    argv = [str(a).replace("RUN", str(run)) for a in argv]
    if argv[0] == "train":
        argv += ["--output_dir", str(tmp_path / "new")]
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words) and "Traceback" not in err, err
    assert files(run) == before and not (tmp_path / "new").exists()


def test_diagnose_replaces_only_an_earlier_diagnose_output(tmp_path, capsys, monkeypatch):
    """diagnose --out may name a new file, or one an earlier diagnose wrote (a JSON object with "figure1"), which it
    then replaces without a word; any other file is refused in one line before any work."""
    ran = []
    monkeypatch.setattr(lopti, "diagnose", lambda cfg, steps, out: ran.append(out))
    earlier = tmp_path / "d.json"
    earlier.write_text(json.dumps({"model": "m", "figure1": {}}))
    fresh = tmp_path / "new" / "d.json"
    for out in (earlier, fresh):
        assert run_main(["diagnose", "--out", out]) == 0
    assert ran == [earlier, fresh] and fresh.parent.is_dir() and "replacing" not in capsys.readouterr().out
    for content in (json.dumps({"model": "m"}), json.dumps([1]), "not json"):
        earlier.write_text(content)
        assert run_main(["diagnose", "--out", earlier]) == 2
        one_line(capsys, str(earlier), "is not diagnose's output")
        assert earlier.read_text() == content and len(ran) == 2


def test_a_tilde_output_dir_is_the_home_folder(tiny_model_dir, tmp_path, rewards, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert run_main(train_argv(tiny_model_dir, "~/run", "--steps", "1")) == 0
    assert (tmp_path / "home" / "run" / "checkpoint-1").is_dir() and not (tmp_path / "~").exists()


def test_a_checkpoint_whose_weights_do_not_fit_is_one_line(tiny_model_dir, trained_run, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(lopti.checkpoints(trained_run)[-1], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    assert run_main(["eval", "--model", ckpt, "--num_people", "3", "--eval_size", "1", "--num_train", "4"]) == 2
    one_line(capsys, "cannot load the model")


# --- two runs compared on the same puzzles; config.json names the method


def test_compare_pairs_two_runs_on_the_same_puzzles_and_refuses_others(trained_run, tmp_path, rewards, capsys,
                                                                      tiny_model_dir):
    grpo = tmp_path / "grpo"
    lopti.train(tiny_config(tiny_model_dir, grpo, steps=1, alpha=0.0, lopti=False, num_iterations=2))
    assert json.loads((grpo / "config.json").read_text())["method"] == "grpo_2_epochs"
    assert json.loads((trained_run / "config.json").read_text())["method"] == "ar_lopti"
    out = lopti.compare_runs(grpo, trained_run)
    a, b = (lopti.read_jsonl(r / "metrics.jsonl")[-1] for r in (grpo, trained_run))
    assert out["step"] == 1 and [r["method"] for r in out["runs"]] == ["grpo_2_epochs", "ar_lopti"]
    assert out["b_minus_a"] == {k.removeprefix("eval/"): v
                                for k, v in lopti.paired_gain(a["eval/correct"], b["eval/correct"]).items()}
    assert "McNemar" in capsys.readouterr().out
    other = tmp_path / "other"
    lopti.train(tiny_config(tiny_model_dir, other, steps=1, seed=1))
    assert run_main(["compare", grpo, other]) == 2
    one_line(capsys, "evaluated different puzzles")


def test_resume_refuses_an_evaluation_on_other_puzzles_than_step_0(trained_run, tmp_path, capsys):
    """The gain is paired with step 0's evaluation: a run whose evaluation puzzles are no longer those step 0 scored
    (the same --eval_data path with other puzzles in it, say) is refused in one line, its files as they were."""
    run = shutil.copytree(trained_run, tmp_path / "run")
    records = lopti.read_jsonl(run / "metrics.jsonl")
    assert records[0]["step"] == 0 and records[0]["eval/puzzles"]
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "eval/puzzles": "elsewhere"} if r["step"] == 0 else r)
                                               + "\n" for r in records))
    before = files(run)
    assert run_main(["train", "--resume", "--output_dir", run, "--steps", "2"]) == 2
    one_line(capsys, "not those step 0 scored", "--eval_data")
    assert files(run) == before


def test_config_json_is_written_after_the_model_loads_and_before_the_warm_up(tiny_model_dir, tmp_path, monkeypatch):
    """Nothing is written while the model loads (a model that fails leaves no folder behind); config.json is written
    next, before the warm-up, so that --resume can continue a run stopped in the warm-up."""
    seen, real_load = [], lopti.load_policy
    config = tmp_path / "run" / "config.json"

    def load_policy(*args, **kwargs):
        seen.append(("load", config.exists()))
        return real_load(*args, **kwargs)

    def warm_up(*args, **kwargs):
        seen.append(("warm_up", config.exists()))
        raise RuntimeError("stop here")

    monkeypatch.setattr(lopti, "load_policy", load_policy)
    monkeypatch.setattr(lopti, "warm_up", warm_up)
    with pytest.raises(RuntimeError, match="stop here"):
        lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", warmup_steps=1))
    assert seen == [("load", False), ("warm_up", True)]


def test_evaluation_puzzles_that_are_training_puzzles_are_dropped_with_a_note(tmp_path, capsys):
    rows = lopti.kk_generate(4, 3, seed=5)
    path = tmp_path / "both.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows.to_list()))
    cfg = lopti.Config(train_data=str(path), eval_data=str(tmp_path / "evals.jsonl"), num_people="3")
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                  rows.to_list()[:2] + lopti.kk_generate(3, 3, seed=6).to_list()))
    evals = lopti.load_task_data(cfg)[1]
    assert evals["quiz"] == lopti.kk_generate(3, 3, seed=6)["quiz"]
    assert "note: 2 of 5 --eval_data puzzles are also in --train_data: not evaluated" in capsys.readouterr().out


def test_plot_says_when_runs_evaluated_different_puzzles(trained_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    other = shutil.copytree(trained_run, tmp_path / "other")
    records = lopti.read_jsonl(other / "metrics.jsonl")
    (other / "metrics.jsonl").write_text("".join(json.dumps({**r, "eval/puzzles": "elsewhere"} if "eval/correct" in r
                                                            else r) + "\n" for r in records))
    lopti.plot_runs([trained_run, other], tmp_path / "p.png")
    assert "evaluated 2 different sets of puzzles" in capsys.readouterr().out
    lopti.plot_runs([trained_run, trained_run], tmp_path / "q.png")
    assert "different sets" not in capsys.readouterr().out


def test_a_run_whose_model_did_not_load_can_be_started_again(tiny_model_dir, tmp_path, rewards, capsys):
    """A typo in --model: one line naming it, and nothing written (no folder); the corrected command then runs. A
    folder holding only config.json and empty logs (a run stopped before its first checkpoint) does not block a new
    run with other settings either."""
    out = tmp_path / "new"
    assert run_main(train_argv(tmp_path / "no-such-model", out, "--steps", "1")) == 2
    one_line(capsys, "no-such-model", "no such folder")
    assert not out.exists()
    assert run_main(train_argv(tiny_model_dir, out, "--steps", "1")) == 0
    assert [p.name for p in lopti.checkpoints(out)] == ["checkpoint-1"]
    stopped = tmp_path / "stopped"
    lopti.start_run_files(stopped, tiny_config(tiny_model_dir, stopped, seed=5, warmup_steps=2), 0)
    assert lopti.not_started(stopped)
    assert run_main(train_argv(tiny_model_dir, stopped, "--steps", "1")) == 0
    assert lopti.read_config(stopped / "config.json")["seed"] == 0 and lopti.checkpoints(stopped)


def test_a_signal_while_the_model_loads_writes_nothing(tiny_model_dir, tmp_path, rewards, monkeypatch,
                                                       sigterm_fails):
    """SIGTERM while the model loads: nothing is written (no folder), no evaluation starts, exit 143, the handler is
    restored; the same command then runs from the start."""
    real_load, evaluations = lopti.load_policy, []

    def load_then_sigterm(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return loaded

    monkeypatch.setattr(lopti, "load_policy", load_then_sigterm)
    real_evaluate = lopti.evaluate
    monkeypatch.setattr(lopti, "evaluate", lambda *a, **k: evaluations.append(1) or real_evaluate(*a, **k))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        lopti.train(tiny_config(tiny_model_dir, out, steps=1))
    assert exit_.value.code == 143 and evaluations == [] and not out.exists()
    assert signal.getsignal(signal.SIGTERM) is sigterm_fails
    monkeypatch.setattr(lopti, "load_policy", real_load)
    assert run_main(train_argv(tiny_model_dir, out, "--steps", "1")) == 0 and evaluations == [1, 1]


def test_a_run_with_a_reward_function_resumes(tiny_model_dir, tmp_path):
    """Config.reward may be a Python function; config.json names it (module:qualname), and train(resume=True) with
    the same function continues the run."""
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", steps=1, reward=varied_rewards)
    lopti.train(cfg)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["reward"] == "test_guarantees:varied_rewards"
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", steps=2, reward=varied_rewards), resume=True)
    assert steps_logged(tmp_path / "run") == [1, 2]
