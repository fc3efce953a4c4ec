"""Faults a user meets (issue 27): an output folder that holds a model, a base model that moved, a signal in the last
step, a diverging run, malformed files, a full disk. Each is one line (exit 2) and leaves every run resumable."""
import errno
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import lopti
from conftest import tiny_config, varied_reward

CPU = torch.device("cpu")
TINY_FLAGS = ["--prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
              "--mini_batch_size", "4", "--micro_batch_size", "2", "--num_train", "16", "--num_people", "3",
              "--eval_size", "2", "--eval_every", "0", "--learning_rate", "1e-3", "--weight_decay", "0"]
TIMINGS = ("time/", "peak_memory_gb", "gen_tokens_per_s")  # what differs between two runs of the same steps


def files(folder: Path) -> dict:
    """Every file under a folder, with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(capsys, *words) -> str:
    """The command's one error line (progress bars aside), which must hold every word."""
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("lopti.py")]
    assert len(err) == 1 and all(w in err[0] for w in words), err
    return err[0]


def rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in lopti.read_jsonl(run / "metrics.jsonl")]


def step_of(ckpt: Path) -> int:
    return torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"]


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model, tokenizer or the puzzles are loaded: the checks must come first."""
    for name in ("load_model", "load_tokenizer", "load_task_data"):
        monkeypatch.setattr(lopti, name, lambda *a, **k: pytest.fail("checked after loading"))


@pytest.fixture
def trained_run(tiny_model_dir, tmp_path_factory, monkeypatch):
    """A 1-step run (checkpoint at step 1) of the tiny model, with a reference model (beta > 0)."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out = tmp_path_factory.mktemp("trained") / "run"
    lopti.train(tiny_config(tiny_model_dir, out, steps=1, beta=0.01))
    return out


# --- a folder that holds a model is never an output folder


def test_an_output_dir_that_holds_a_model_or_another_run_is_refused_before_loading(
        tiny_model_dir, trained_run, tmp_path, capsys, no_loading):
    """A hub model's local copy, another run's checkpoint/, a folder of weights alone, a folder with a config.json
    lopti did not write: train and diagnose refuse them in one line and write nothing."""
    weights_only, foreign = tmp_path / "weights", tmp_path / "foreign"
    weights_only.mkdir(), foreign.mkdir()
    (weights_only / "model.safetensors").write_bytes(b"x")
    (foreign / "config.json").write_text('{"my": "settings"}')
    for folder, what in ((tiny_model_dir, "holds a model (model.safetensors)"),
                         (trained_run / "checkpoint", "holds a model"), (weights_only, "holds a model"),
                         (foreign, "holds another run (config.json)")):
        before = files(folder)
        for command in ("train", "diagnose"):
            if command == "diagnose" and folder == foreign:
                continue  # (diagnose writes no config.json: a folder of one's own files is fine)
            assert lopti.main([command, "--model", str(tiny_model_dir), "--output_dir", str(folder)]) == 2
            one_line(capsys, what)
        assert files(folder) == before


def test_diagnose_checks_its_output_before_loading_and_replaces_only_its_own(tiny_model_dir, tmp_path, capsys,
                                                                            monkeypatch, no_loading):
    """--output_dir at a file, a JSON or PNG of that name that diagnose did not write: refused before the model
    loads (it was refused after the measurement: 7 minutes on a laptop). An earlier diagnose output is replaced."""
    (tmp_path / "file").write_text("x")
    argv = ["diagnose", "--model", str(tiny_model_dir), "--seed", "3", "--output_dir"]
    assert lopti.main([*argv, str(tmp_path / "file")]) == 2
    one_line(capsys, "is a file")
    name = f"diagnose_{tiny_model_dir.name}_seed3"
    for suffix in (".json", ".png"):
        folder = tmp_path / suffix[1:]
        folder.mkdir()
        (folder / (name + suffix)).write_text('{"mine": 1}')
        assert lopti.main([*argv, str(folder)]) == 2
        one_line(capsys, name + suffix, "is not an output of diagnose")
        assert (folder / (name + suffix)).read_text() == '{"mine": 1}'
    monkeypatch.undo()  # an earlier output of the same measurement is replaced
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / f"{name}.json").write_text(json.dumps({"bins": [], "paper": {}, "old": True}))
    monkeypatch.setattr(lopti, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(lopti, "_pyplot", lambda: None)
    monkeypatch.setattr(lopti, "train_step", lambda *a, **k: {"diagnose": {"x": 1}, "reward": 0.0,
                                                              "time/diagnose": 0.0})
    assert lopti.main([*argv, str(earlier), *TINY_FLAGS[:2]]) == 0
    assert json.loads((earlier / f"{name}.json").read_text())["x"] == 1


def test_plot_and_toy_refuse_an_output_that_is_not_theirs_before_working(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": -3.0}\n')
    pytest.importorskip("matplotlib")
    assert lopti.main(["plot", str(run), "--out", str(run / "metrics.jsonl")]) == 2  # would be written over
    one_line(capsys, "is not a PNG")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "reward": -3.0}\n'
    monkeypatch.setattr(lopti, "run_toy", lambda *a: pytest.fail("checked after the run"))
    assert lopti.main(["toy", "--quick", "--out", str(run / "metrics.jsonl")]) == 2
    one_line(capsys)


# --- a base model that moved


def test_resume_accepts_the_base_model_at_a_new_place_and_refuses_another(tiny_model_dir, tmp_path, capsys,
                                                                          monkeypatch):
    """beta > 0: --resume reads the reference model at the path in config.json. After the folder moves, --resume
    names the fix; --resume --model NEW continues (the same files: config, weights' headers and samples) and
    records NEW; a model with other weights or another config is refused before anything loads."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    base, out = tmp_path / "base", tmp_path / "run"
    shutil.copytree(tiny_model_dir, base)
    lopti.train(tiny_config(base, out, steps=1, beta=0.01))
    moved = base.rename(tmp_path / "moved")
    resume = ["train", "--resume", "--output_dir", str(out), "--steps", "2"]
    assert lopti.main(resume) == 2
    one_line(capsys, "no model folder", "add --model ITS_NEW_PLACE")
    other_weights, other_config = tmp_path / "other_weights", tmp_path / "other_config"
    model = lopti.load_model(str(moved), CPU)
    with torch.no_grad():
        model.model.norm.weight.add_(1e-3)
    model.save_pretrained(other_weights)
    shutil.copytree(moved, other_config)
    config = json.loads((other_config / "config.json").read_text())
    (other_config / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    before = files(out)
    with monkeypatch.context() as m:
        m.setattr(lopti, "load_model", lambda *a, **k: pytest.fail("checked after loading"))
        for other in (other_weights, other_config):
            assert lopti.main([*resume, "--model", str(other)]) == 2
            one_line(capsys, f"--model {other} is not the model", str(base))
    assert files(out) == before
    assert lopti.main([*resume, "--model", str(moved)]) == 0
    assert json.loads((out / "config.json").read_text())["model"] == str(moved)
    assert [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_model_fingerprint_is_the_files_wherever_they_are(tiny_model_dir, tmp_path):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    assert lopti.model_fingerprint(str(copy)) == lopti.model_fingerprint(str(tiny_model_dir))
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one bit (the tiny model's 0.4 MB are within the first MiB, read whole)
    weights.write_bytes(bytes(data))
    assert lopti.model_fingerprint(str(copy)) != lopti.model_fingerprint(str(tiny_model_dir))
    assert lopti.model_fingerprint("no-such-org/no-such-model") is None  # a hub id not in the cache


# --- a signal in the last step; the evaluation comes after the save


def test_a_signal_in_the_last_step_then_resume_gives_the_rows_of_a_run_never_stopped(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    straight = tmp_path / "straight"
    lopti.train(tiny_config(tiny_model_dir, straight, steps=2, save_every=0))
    real_step, real_eval = lopti.train_step, lopti.evaluate

    def step(*args, **kwargs):
        if args[0].steps == 2 and lopti.latest_checkpoint(str(tmp_path / "run")) is None and os.path.exists(
                tmp_path / "run" / "metrics.jsonl"):  # during step 2, the last
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(lopti, "train_step", step)
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", steps=2, save_every=0)
    with pytest.raises(lopti.Stopped, match="after step 2 and saved it"):
        lopti.train(cfg)
    assert "eval/accuracy" not in lopti.read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]

    def evaluate(*args):  # the evaluation runs on the saved step
        assert step_of(tmp_path / "run" / "checkpoint") == 2
        return real_eval(*args)

    monkeypatch.setattr(lopti, "evaluate", evaluate)
    assert lopti.main(["train", "--resume", "--output_dir", str(cfg.output_dir)]) == 0
    assert rows(tmp_path / "run") == rows(straight) and "eval/accuracy" in rows(straight)[-1]
    assert lopti.main(["train", "--resume", "--output_dir", str(cfg.output_dir)]) == 0  # nothing left: no-op
    assert rows(tmp_path / "run") == rows(straight)


def test_an_error_in_an_evaluation_loses_no_step_and_resume_evaluates_it(tiny_model_dir, tmp_path, monkeypatch,
                                                                         capsys):
    """Step 2 of 3 saves, then its evaluation runs out of memory: the checkpoint of step 2 is there, and --resume
    evaluates it before step 3, as a run never stopped does."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    straight = tmp_path / "straight"
    lopti.train(tiny_config(tiny_model_dir, straight, steps=3, save_every=2, eval_every=2))
    real_eval = lopti.evaluate

    def out_of_memory(*args):
        raise MemoryError("out of CPU memory in the evaluation; lower --eval_batch_size")

    monkeypatch.setattr(lopti, "evaluate", out_of_memory)
    argv = ["train", "--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"), *TINY_FLAGS,
            "--steps", "3", "--save_every", "2", "--eval_every", "2"]
    assert lopti.main(argv) == 2
    one_line(capsys, "evaluation")
    assert step_of(tmp_path / "run" / "checkpoint") == 2
    monkeypatch.setattr(lopti, "evaluate", real_eval)
    assert lopti.main(["train", "--resume", "--output_dir", str(tmp_path / "run")]) == 0
    assert rows(tmp_path / "run") == rows(straight)


# --- a diverging run


def test_a_diverging_run_stops_unsaved_and_resumes_from_the_last_finite_weights(tiny_model_dir, tmp_path, capsys,
                                                                               monkeypatch):
    """At a huge learning rate the weights stay finite (1e30) but the logits do not; the next rollout failed in
    sampling and the checkpoint held them. Now the step is named, not saved, and --resume --learning_rate continues."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out = tmp_path / "run"
    assert lopti.main(["train", "--model", str(tiny_model_dir), "--output_dir", str(out), *TINY_FLAGS,
                       "--steps", "1", "--save_every", "1"]) == 0
    finite = files(out / "checkpoint")
    resume = ["train", "--resume", "--output_dir", str(out), "--steps", "3"]
    assert lopti.main([*resume, "--learning_rate", "1e30"]) == 2
    one_line(capsys, "step 2 diverged", "--learning_rate")
    assert files(out / "checkpoint") == finite and step_of(out / "checkpoint") == 1
    assert [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")] == [1]
    assert lopti.main([*resume, "--learning_rate", "1e-3"]) == 0
    lines = lopti.read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], r["learning_rate"]) for r in lines] == [(1, 1e-3), (2, 1e-3), (3, 1e-3)]
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-3


def test_a_lower_learning_rate_on_resume_is_the_one_used(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", steps=1))
    seen = []
    monkeypatch.setattr(lopti, "update_policy", lambda cfg, fn, opt, batch: seen.append(opt.param_groups[0]["lr"])
                        or {})
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", steps=2, learning_rate=1e-5), resume=True)
    assert seen == [1e-5]


# --- malformed files: one line naming the file, exit 2, before anything loads


def tear(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_a_torn_checkpoint_file_is_named_by_eval_diagnose_and_resume(trained_run, tmp_path, capsys, name,
                                                                     no_loading):
    run = Path(shutil.copytree(trained_run, tmp_path / "run"))
    tear(run / "checkpoint" / name)
    before = files(run)
    for argv in (["eval", "--model", str(run / "checkpoint")], ["diagnose", "--checkpoint", str(run / "checkpoint")],
                 ["train", "--resume", "--output_dir", str(run), "--steps", "2"]):
        assert lopti.main(argv) == 2
        one_line(capsys, f"{run / 'checkpoint' / name} is malformed")
    assert files(run) == before


def test_malformed_run_files_are_named(trained_run, tmp_path, capsys, monkeypatch):
    """trainer_state.pt torn or of another model, a run config.json with a bad value; metrics.jsonl with a torn line
    and bytes that are not text still resumes."""
    run = Path(shutil.copytree(trained_run, tmp_path / "run"))
    resume = ["train", "--resume", "--output_dir", str(run), "--steps", "2"]
    state = run / "checkpoint" / "trainer_state.pt"
    good = state.read_bytes()
    tear(state)
    assert lopti.main(resume) == 2
    one_line(capsys, str(state), "cannot be loaded")
    torch.save({**torch.load(trained_run / "checkpoint" / "trainer_state.pt", weights_only=True),
                "optimizer": torch.optim.AdamW([torch.zeros(3)]).state_dict()}, state)  # another model's
    assert lopti.main(resume) == 2
    one_line(capsys, str(state), "does not fit")
    state.write_bytes(good)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "alpha": 7}))
    assert lopti.main(resume) == 2
    one_line(capsys, str(run / "config.json"), "alpha")
    (run / "config.json").write_text(json.dumps(config))
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 2, "rew\xff\xfe\n\x00\x01')
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    assert lopti.main(resume) == 0
    assert [r["step"] for r in lopti.read_jsonl(run / "metrics.jsonl")] == [1, 2]


# --- a full disk


def test_a_full_disk_while_saving_is_one_line_and_the_last_checkpoint_resumes(tiny_model_dir, tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out, real_save = tmp_path / "run", torch.save

    def full_disk(obj, path, *args, **kwargs):
        if obj.get("step") == 2:  # half the file, then no space left
            Path(path).write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    argv = ["train", "--model", str(tiny_model_dir), "--output_dir", str(out), *TINY_FLAGS, "--steps", "3",
            "--save_every", "1"]
    assert lopti.main(argv) == 2
    one_line(capsys, "the disk is full", "step 2 was not saved", "--resume")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "config.json", "metrics.jsonl", "samples.jsonl"]
    assert step_of(out / "checkpoint") == 1
    monkeypatch.setattr(torch, "save", real_save)
    assert lopti.main(["train", "--resume", "--output_dir", str(out)]) == 0
    assert [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_full_disk_while_logging_tears_no_line_that_resume_trips_over(tiny_model_dir, tmp_path, capsys,
                                                                        monkeypatch):
    """metrics.jsonl on a full disk: half of step 2's line, then ENOSPC (as /dev/full gives it)."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out = tmp_path / "run"

    class FullDisk:
        def __init__(self, path, *args):
            self.f = open(path, *args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    opened = []

    def open_(path, *args):  # step 2's metrics line
        opened.append(Path(path).name)
        return FullDisk(path, *args) if opened.count("metrics.jsonl") == 2 else open(path, *args)

    monkeypatch.setattr(lopti, "open", open_, raising=False)
    argv = ["train", "--model", str(tiny_model_dir), "--output_dir", str(out), *TINY_FLAGS, "--steps", "3",
            "--save_every", "1"]
    assert lopti.main(argv) == 2
    one_line(capsys, f"cannot write {out / 'metrics.jsonl'} (No space left on device)", "--resume")
    assert step_of(out / "checkpoint") == 1 and (out / "metrics.jsonl").read_text().count("\n") == 1
    monkeypatch.setattr(lopti, "open", open)
    assert lopti.main(["train", "--resume", "--output_dir", str(out)]) == 0
    assert [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # the torn line is gone


def test_a_full_disk_while_rewriting_a_file_keeps_the_old_text(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")

    def full(self, text, *a, **k):
        Path.write_bytes(self, text[:3].encode())
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match=f"cannot write {path}"):
        lopti._atomic_write(path, "new text\n")
    assert path.read_bytes() == b"old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_full_disk_is_recognised_without_an_errno(tiny_model_dir, tmp_path, monkeypatch):
    """torch.save and safetensors raise errors without an errno on a full disk (measured on a full tmpfs: torch's
    "unexpected pos"): no space left on the device is what says so."""
    cfg = tiny_config(tiny_model_dir, tmp_path / "run")
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    opt = torch.optim.AdamW(model.parameters())

    def torn(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 805376 vs 805268")

    monkeypatch.setattr(torch, "save", torn)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(OSError, match="the disk is full"):
        lopti.save_checkpoint(cfg, model, tok, opt, step=1)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 0, 10**9))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # another error stays itself
        lopti.save_checkpoint(cfg, model, tok, opt, step=1)
    assert not (tmp_path / "run" / "checkpoint.tmp").exists()
