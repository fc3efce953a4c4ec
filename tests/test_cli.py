"""The command line (build_parser, resolve_config, main) and the README: defaults < preset < flags, --resume's
config.json, bool flags, one-line usage errors with exit 2, --help per command, train then eval, diagnose's JSON,
plot's PNG, and every Python block of README.md run as written."""
import dataclasses
import hashlib
import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import lopti
from conftest import exit_code, varied_reward
from lopti import Config

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "kk"
TINY_FLAGS = ["--prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
              "--mini_batch_size", "4", "--micro_batch_size", "2", "--num_train", "16", "--num_people", "3",
              "--eval_size", "2", "--eval_every", "0", "--eval_batch_size", "4", "--save_every", "1",
              "--learning_rate", "1e-3", "--weight_decay", "0"]  # = conftest's tiny_config


def varied_rewards(completions, solutions):
    """kk_rewards' shape with variance inside groups (a random tiny model always scores -3: no advantage)."""
    return torch.tensor([varied_reward(c, s) for c, s in zip(completions, solutions)])


def use_rewards(monkeypatch, function) -> None:
    """lopti.kk_rewards (--reward kk) replaced by `function`; reward_function, which caches the function of "kk",
    reads it afresh meanwhile (so its cache never holds the stand-in)."""
    monkeypatch.setattr(lopti, "kk_rewards", function)
    monkeypatch.setattr(lopti, "reward_function", getattr(lopti.reward_function, "__wrapped__", lopti.reward_function))


def parsed(argv: list[str]) -> dict:
    """What `python lopti.py ARGV` parses, as resolve_config takes it."""
    return vars(lopti.build_parser().parse_args([str(a) for a in argv]))


def one_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    return err


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cli_run(tiny_model_dir, tmp_path_factory) -> Path:
    """`python lopti.py train` (through main) of the tiny model: 2 steps of GRPO + AR (--lopti false), eval at the
    end."""
    out = tmp_path_factory.mktemp("cli") / "run"
    with pytest.MonkeyPatch.context() as mp:
        use_rewards(mp, varied_rewards)
        assert lopti.main(["train", "--model", str(tiny_model_dir), "--output_dir", str(out), *TINY_FLAGS,
                           "--steps", "2", "--lopti", "false"]) == 0
    return out


# --- configuration: defaults < preset < flags; --resume: the run's config.json < flags


def test_defaults_then_preset_then_flags():
    assert lopti.resolve_config(parsed(["train"])) == Config()
    cpu = lopti.PRESETS["cpu"]
    assert lopti.resolve_config(parsed(["train", "--preset", "cpu"])) == Config(**cpu)
    cfg = lopti.resolve_config(parsed(["train", "--preset", "cpu", "--steps", "7", "--alpha", "0.1"]))
    assert cfg == Config(**{**cpu, "steps": 7, "alpha": 0.1})  # the preset's steps replaced, the rest kept
    assert lopti.resolve_config(parsed(["eval", "--preset", "gpu"])) == Config(**lopti.PRESETS["gpu"])


def test_resume_reads_the_runs_config_and_flags_override_it(tmp_path):
    """The run's config.json replaces the defaults AND the preset (the run's settings are what continue); explicit
    flags still win, --output_dir included (the folder may have moved)."""
    saved = Config(alpha=0.1, seed=5, steps=7, output_dir="old/place")
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(saved)))
    cfg = lopti.resolve_config(parsed(["train", "--resume", "--output_dir", tmp_path, "--preset", "gpu",
                                       "--steps", "9"]))
    assert cfg == dataclasses.replace(saved, steps=9, output_dir=str(tmp_path))


def test_resume_at_the_default_folder_continues_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / lopti.PRESETS["cpu"]["output_dir"]
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(Config(**{**lopti.PRESETS["cpu"],
                                                                              "output_dir": "moved/from"}))))
    assert lopti.resolve_config(parsed(["train", "--resume", "--preset", "cpu"])).output_dir == str(
        lopti.PRESETS["cpu"]["output_dir"])


@pytest.mark.parametrize("text,value", [("true", True), ("True", True), ("1", True), ("false", False),
                                        ("FALSE", False), ("0", False)])
def test_bool_flags_read_true_false_1_0(text, value):
    cfg = lopti.resolve_config(parsed(["train", "--lopti", text, "--gradient_checkpointing", text]))
    assert cfg.lopti is value and cfg.gradient_checkpointing is value


@pytest.mark.parametrize("text", ["yes", "maybe", "", "2"])
def test_a_bad_bool_is_one_line_exit_2(text, capsys):
    assert exit_code(["train", "--lopti", text]) == 2
    one_line(capsys, "--lopti", "true or false")


# --- usage errors and --help


@pytest.mark.parametrize("argv", [
    [], ["fly"], ["train", "--num_generation", "3"], ["train", "--num-generations", "3"],
    ["train", "--steps", "1.5"], ["train", "--alpha", "high"], ["train", "--preset", "huge"],
    ["eval", "--resume"], ["toy", "--model", "x"], ["plot"], ["fig3", "x"], ["train", "stray"]])
def test_usage_errors_are_one_line_and_exit_2(argv, capsys):
    """No command, an unknown one, an abbreviated or misspelt option, a value of the wrong type, an unknown preset,
    another command's option, no run folder, the dropped fig3, a stray argument."""
    assert exit_code(argv) == 2
    one_line(capsys, "error")


@pytest.mark.parametrize("command", ["", "toy", "train", "eval", "diagnose", "plot"])
def test_help_exits_0_and_lists_the_commands_options(command, capsys):
    assert exit_code([command, "--help"] if command else ["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: lopti.py" in out
    assert ("--alpha" in out) == (command in ("toy", "train", "eval", "diagnose"))
    assert ("--micro_batch_size" in out) == (command in ("train", "eval", "diagnose"))
    assert ("--resume" in out) == (command == "train") and ("--quick" in out) == (command == "toy")


# --- the commands on the tiny model


def test_train_writes_a_run_with_the_flags_it_was_given(cli_run):
    cfg = json.loads((cli_run / "config.json").read_text())
    assert cfg["lopti"] is False and cfg["steps"] == 2 and cfg["learning_rate"] == 1e-3
    assert [p.name for p in lopti.checkpoints(cli_run)] == ["checkpoint-2"]
    steps = [r["step"] for r in lopti.read_jsonl(cli_run / "metrics.jsonl")]
    assert steps == [0, 1, 2, 2]  # the evaluation at step 0, two steps, then the evaluation at the last


def test_eval_prints_accuracy_and_the_constant_answers_as_json(cli_run, tmp_path, capsys, monkeypatch):
    """Puzzles A, A, B (A's and B's solutions differ; all 3 people) and a reward of 3 for B's solution only:
    accuracy 1/3, mean reward (-3 - 3 + 3) / 3 = -1, and the constant answer (A's roles) right on 2 of 3. A run's
    checkpoint is evaluated with the run's settings (said), flags overriding them; without --eval_data, on the
    puzzles the run scored at step 0."""
    rows = [json.loads(x) for x in (DATA / "3ppl_20.jsonl").read_text().splitlines()]
    a = rows[0]
    b = next(r for r in rows if r["solution"] != a["solution"])
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (a, a, b)))
    use_rewards(monkeypatch, lambda texts, solutions: torch.tensor(
        [3.0 if s == b["solution_text_format"] else -3.0 for s in solutions]))
    capsys.readouterr()
    assert lopti.main(["eval", "--model", str(cli_run / "checkpoint-2"), "--eval_data", str(tmp_path / "eval.jsonl"),
                       "--num_train", "8", "--num_people", "3", "--max_completion_length", "2",
                       "--eval_batch_size", "2"]) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert f"evaluating with {cli_run}" in printed.out + printed.err
    puzzles = hashlib.sha256("\n".join([a["quiz"], a["quiz"], b["quiz"]]).encode()).hexdigest()[:12]
    assert out == pytest.approx({"eval/accuracy": 1 / 3, "eval/constant_accuracy": 2 / 3, "eval/correct": "001",
                                 "eval/puzzles": puzzles, "eval/accuracy_3ppl": 1 / 3, "eval/reward_3ppl": -1.0})
    assert lopti.main(["eval", "--model", str(cli_run / "checkpoint-2"), "--max_completion_length", "2"]) == 0
    step_0 = lopti.read_jsonl(cli_run / "metrics.jsonl")[0]
    assert json.loads(capsys.readouterr().out)["eval/puzzles"] == step_0["eval/puzzles"]


def test_diagnose_writes_figures_1_and_3_paired_and_only_reads_the_model(tiny_model_dir, tmp_path, monkeypatch):
    """diagnose's JSON: Figure 1's bins on the first batch, Figure 3 paired per step and pooled, and its settings
    (every Config field, the method and the version); the model's files are only read."""
    use_rewards(monkeypatch, varied_rewards)
    before, out = digest(tiny_model_dir), tmp_path / "d.json"
    flags = [f for f in TINY_FLAGS if f != "--save_every"]  # (train's: diagnose refuses it)
    flags.remove(TINY_FLAGS[TINY_FLAGS.index("--save_every") + 1])
    assert lopti.main(["diagnose", "--model", str(tiny_model_dir), *flags, "--steps", "2",
                       "--out", str(out)]) == 0
    assert digest(tiny_model_dir) == before
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert set(settings) == {f.name for f in dataclasses.fields(Config)} | {"method", "version"}
    assert settings["model"] == str(tiny_model_dir) and settings["measure_update"] is True
    assert settings["method"] == "ar_lopti" and settings["version"] == lopti.lopti_version()
    fig1 = result["figure1"]
    assert len(fig1["token_share"]) == 4 and sum(fig1["token_share"]) == pytest.approx(1.0)
    assert len(fig1["grad_norm"]["bins"]) == 4 and fig1["grad_norm"]["all"] > 0
    paired, methods = result["figure3_paired"], tuple(lopti.METHODS)
    assert paired["steps"] == 2 and set(paired["methods"]) == set(methods)
    for m in methods:
        counts = paired["methods"][m]
        assert sorted(counts) == sorted(lopti.UPDATE_KEYS) and all(len(v) == 4 for v in counts.values())
        assert counts == {k: [sum(u[m][f"update/{k}"][b] for u in paired["per_step"]) for b in range(4)]
                          for k in lopti.UPDATE_KEYS}  # pooled = the steps' sum
        assert all(r + f <= n for r, f, n in zip(counts["pos_rose"], counts["pos_fell"], counts["pos_tokens"]))
        # paired: every method is counted on the same batch, so the same tokens
        assert counts["pos_tokens"] == paired["methods"]["grpo"]["pos_tokens"] and sum(counts["pos_tokens"]) > 0
    for reference in ("grpo", "grpo_2_epochs", "lopti"):  # each method against the three references
        deltas = paired[f"delta_vs_{reference}"]
        assert set(deltas) == set(methods) - {reference}
        for d in deltas.values():  # (2 steps: p >= 2/4, never resolved)
            assert len(d["delta"]) == len(d["p"]) == 4 and all(p >= 0.5 for p in d["p"]) and not any(d["resolved"])


def test_plot_writes_a_png(cli_run, tmp_path):
    pytest.importorskip("matplotlib")
    assert lopti.main(["plot", str(cli_run), "--out", str(tmp_path / "out.png")]) == 0
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command,target", [("eval", "eval_main"), ("toy", "toy_main")])
def test_sigterm_ends_eval_and_toy_at_once_with_143(command, target, monkeypatch, capsys):
    """SIGTERM (a scheduler) interrupts eval and toy where they are: one line, exit 128 + 15, and the handler that
    was there before is back (the one here fails the test if the signal reaches it)."""
    def reached(*args):
        pytest.fail("SIGTERM reached the handler that main replaces")

    def sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        pytest.fail("SIGTERM did not interrupt the command")

    monkeypatch.setattr(lopti, target, sigterm)
    before = signal.signal(signal.SIGTERM, reached)
    try:
        assert exit_code([command]) == 143
        assert signal.getsignal(signal.SIGTERM) is reached
    finally:
        signal.signal(signal.SIGTERM, before)
    one_line(capsys, f"lopti.py {command}: interrupted")


# --- the README: its commands parse, its Python blocks run


def readme_commands() -> list[str]:
    """Every `python lopti.py ...` line of README.md (bash blocks and the Colab cell)."""
    text = (ROOT / "README.md").read_text()
    return [m.group(1).split("  #")[0].strip() for m in re.finditer(r"^\s*!?python lopti\.py (.+)$", text, re.M)]


def test_readme_commands_parse_into_valid_configs(capsys):
    commands = readme_commands()
    assert commands
    for line in commands:
        argv = shlex.split(line)
        if "--help" in argv:
            continue
        args = parsed(argv)  # (argparse exits on a flag that no longer exists)
        if args["command"] in ("train", "eval", "diagnose") and not args.get("resume"):
            lopti.resolve_config(args)  # a preset with flags that Config refuses raises here


def readme_blocks() -> list[str]:
    """The ```python blocks of README.md, then of toy/README.md (the reward and TRL examples)."""
    texts = [(ROOT / name).read_text() for name in ("README.md", "toy/README.md")]
    return [block for text in texts for block in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


def test_readme_has_python_blocks():
    assert readme_blocks()


@pytest.mark.parametrize("i", range(len(readme_blocks())))
def test_readme_python_block_runs_as_written(i, tiny_model_dir, tmp_path, monkeypatch):
    """Every ```python block of README.md (read when the tests run) runs as written, in an empty folder (with
    tests/ linked in), offline. Conventions for README authors:
    - a block whose first line is `# needs: trl` (or another importable module) is skipped when that module is
      missing, and only then; every other block must run everywhere;
    - a model name that is not a local folder, given to lopti.load_model/load_tokenizer, loads the tiny test
      model instead (no hub in tests), and trl.GRPOConfig is built with max_steps=1, max_completion_length=8,
      save_strategy "no" and, without a GPU, use_cpu=True: a TRL block is a smoke test of its code, not a run."""
    block = readme_blocks()[i]
    needs = re.match(r"# needs: ([\w.]+)", block)
    if needs:
        pytest.importorskip(needs.group(1))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    local = lambda name: name if Path(name).exists() else str(tiny_model_dir)  # noqa: E731
    real_model, real_tokenizer = lopti.load_model, lopti.load_tokenizer
    monkeypatch.setattr(lopti, "load_model", lambda name, *a, **k: real_model(local(name), *a, **k))
    monkeypatch.setattr(lopti, "load_tokenizer", lambda name: real_tokenizer(local(name)))
    try:
        import trl
    except ImportError:  # (a block that needs it without saying so fails)
        trl = None
    if trl is not None:
        real_config = trl.GRPOConfig
        small = dict(max_steps=1, max_completion_length=8, save_strategy="no", disable_tqdm=True,
                     **({} if torch.cuda.is_available() else dict(use_cpu=True)))
        monkeypatch.setattr(trl, "GRPOConfig", lambda *a, **k: real_config(*a, **{**k, **small}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    use_rewards(monkeypatch, lopti.kk_rewards)  # (a block may replace it: restored after)
    exec(compile(block, f"README python block {i}", "exec"), {"__name__": "readme"})


# --- --report_to: every metrics.jsonl record also goes to TensorBoard


def test_report_to_tensorboard_logs_every_record_of_metrics_jsonl_and_the_config(tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    use_rewards(monkeypatch, varied_rewards)
    assert lopti.main(["train", "--model", str(tiny_model_dir), "--output_dir", str(out), *TINY_FLAGS,
                       "--steps", "2", "--report_to", "tensorboard"]) == 0
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    records = lopti.read_jsonl(out / "metrics.jsonl")
    expected = [("reward", r["step"], r["reward"]) for r in records if "reward" in r]
    expected += [("eval/accuracy", r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    expected += [("update/pos_tokens/3", r["step"], r["update/pos_tokens"][3]) for r in records if "reward" in r]
    assert len(expected) == 2 + 2 + 2  # two steps, evaluations at steps 0 and 2
    for tag, step, value in expected:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert (step, pytest.approx(value)) in logged, (tag, step, value, logged)
    assert "eval/correct" not in events.Tags()["scalars"]  # text is not a scalar, but a text
    final = [r for r in records if "eval/correct" in r][-1]
    correct = [e for e in events.Tensors("eval/correct/text_summary") if e.step == final["step"]]
    assert correct[0].tensor_proto.string_val[0].decode() == final["eval/correct"]
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert str(tiny_model_dir) in config_text and '"report_to": "tensorboard"' in config_text


def test_report_to_tensorboard_without_the_package_is_one_line_and_writes_nothing(tmp_path, monkeypatch,
                                                                                  capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # (and an earlier import)
    out = tmp_path / "run"
    assert exit_code(["train", "--output_dir", out, "--report_to", "tensorboard"]) == 2
    one_line(capsys, "pip install tensorboard")
    assert exit_code(["train", "--output_dir", out, "--report_to", "wandb"]) == 2
    one_line(capsys, "report_to must be none or tensorboard")
    assert not out.exists()


def test_a_resumed_tensorboard_run_logs_each_redone_step_once(tiny_model_dir, tmp_path, monkeypatch):
    """A run killed after step 2's record but before its checkpoint: --resume redoes step 2, and TensorBoard, like
    metrics.jsonl, holds it once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, real_save = tmp_path / "run", lopti.save_checkpoint
    use_rewards(monkeypatch, varied_rewards)

    def killed_at_step_2(out, model, tokenizer, optimizer, step):
        if step == 2:
            raise RuntimeError("killed")
        return real_save(out, model, tokenizer, optimizer=optimizer, step=step)

    monkeypatch.setattr(lopti, "save_checkpoint", killed_at_step_2)
    argv = ["train", "--model", str(tiny_model_dir), "--output_dir", str(out), *TINY_FLAGS, "--steps", "2",
            "--report_to", "tensorboard"]
    with pytest.raises(RuntimeError, match="killed"):
        lopti.main(argv)
    monkeypatch.setattr(lopti, "save_checkpoint", real_save)
    assert lopti.main(["train", "--resume", "--output_dir", str(out)]) == 0
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2]
    assert [r["step"] for r in lopti.read_jsonl(out / "metrics.jsonl") if "reward" in r] == [1, 2]


def test_a_tensorboard_run_resumed_from_checkpoint_0_logs_each_step_once(tmp_path):
    """A crash after the warm-up's checkpoint-0 and a few logged steps: the resumed run's steps replace them."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = Config(report_to="tensorboard")
    for first_step, steps in ((0, (0, 1, 2, 3)), (0, (1, 2, 3))):  # the run, then its resume from checkpoint-0
        log = lopti.MetricsLog(tmp_path, cfg, first_step=first_step)
        for step in steps:
            log.write({"step": step, "reward": float(step)})
        log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [0, 1, 2, 3]
