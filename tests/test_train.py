"""The LLM path on a tiny random model made in conftest.py (no download): rollout, log-probs, the training
loop, checkpoints, resume, Ctrl-C, evaluation and bad input."""
import dataclasses
import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

import lopti
from lopti import Config

CPU = torch.device("cpu")


def tiny_config(model_dir, out_dir, **overrides) -> Config:
    base = dict(model=str(model_dir), output_dir=str(out_dir), prompts_per_step=2, num_generations=4,
                max_completion_length=12, mini_batch_size=4, micro_batch_size=2, steps=2, num_train=16,
                num_people="3", eval_size=2, eval_every=0, eval_batch_size=4, save_every=1, learning_rate=1e-3,
                weight_decay=0.0)
    return Config(**{**base, **overrides})


def train_args(argv: list[str]) -> dict:
    """What `python lopti.py train ARGV` parses, as resolve_config takes it."""
    return vars(lopti.build_parser().parse_args(["train", *argv]))


def varied_reward(text: str, solution: str) -> float:
    """A stand-in reward with variance inside groups (a random tiny model always scores -3 on K&K)."""
    return float(sum(map(ord, text)) % 5)


# ---------------------------------------------------------------- masks and log-probs


def test_completion_mask_golden_with_pad_equal_to_eos_and_two_eos_ids():
    completions = torch.tensor([[5, 7, 2, 2, 2], [5, 2, 9, 2, 2], [5, 7, 8, 9, 6], [3, 5, 2, 3, 3]])
    mask, truncated = lopti.completion_mask(completions, [2, 3])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]


@pytest.mark.parametrize("arch", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_left_padded_batch_logprobs_equal_each_row_alone(arch, request):
    path = request.getfixturevalue(arch)
    model, tok = lopti.load_model(str(path), CPU).eval(), lopti.load_tokenizer(str(path))
    prompts = ["Who is a knight?", "A very special island is inhabited only by knights and knaves. Zoey said"]
    g = torch.Generator().manual_seed(0)
    completions = torch.randint(3, len(tok), (2, 6), generator=g)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"][0] == 0).any()  # row 0 really is left-padded
    input_ids = torch.cat([enc["input_ids"], completions], 1)
    attention_mask = torch.cat([enc["attention_mask"], torch.ones_like(completions)], 1)
    with torch.no_grad():
        batched = lopti.sequence_logprobs(model, input_ids, attention_mask, 6, 0.7)
        for i, prompt in enumerate(prompts):
            ids = torch.cat([tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"],
                             completions[i : i + 1]], 1)
            alone = lopti.sequence_logprobs(model, ids, torch.ones_like(ids), 6, 0.7)
            torch.testing.assert_close(batched[i : i + 1], alone, atol=1e-5, rtol=1e-5)
        if arch == "tiny_gpt2_dir":  # without position ids an absolute-position model scores row 0 wrongly
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -7:-1]
            naive = lopti.token_logprobs(logits, completions, 0.7)
            assert not torch.allclose(naive[0], batched[0], atol=1e-3)


def test_rollout_and_pi_old_equals_first_update_logprobs(tiny_model_dir):
    """Ratio 1 before any step: pi_old (eval mode, no grad) equals the update's first log-probs (train mode)."""
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    cfg = Config(model=str(tiny_model_dir), max_completion_length=10, micro_batch_size=3)
    torch.manual_seed(0)
    batch = lopti.rollout(model, tok, ["<|im_start|>user\nhi", "Zoey is a"] * 3, cfg, CPU)
    B, C = batch["mask"].shape
    assert B == 6 and C <= 10 and len(batch["texts"]) == 6
    old = lopti.batched_logprobs(model, batch, cfg, CPU)
    model.train()
    new = lopti.sequence_logprobs(model, batch["input_ids"][:2], batch["attention_mask"][:2], C, cfg.temperature)
    assert new.requires_grad
    torch.testing.assert_close(new.detach(), old[:2], atol=1e-5, rtol=0)
    # the mask ends at the first EOS; rows that never stop are flagged as truncated
    eos = torch.tensor(lopti.eos_token_ids(model, tok))
    completions = batch["input_ids"][:, -C:]
    for row, m, trunc in zip(completions, batch["mask"], batch["truncated"]):
        kept = row[m]
        assert bool(trunc) == (not torch.isin(kept, eos).any())
        if not trunc:
            assert torch.isin(kept[-1:], eos).all() and not torch.isin(kept[:-1], eos).any()


def test_sampling_ignores_the_models_generation_config(tiny_model_dir):
    """pi_old must be the distribution sampled from: the model's own top_k / repetition penalty are off."""
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    model.generation_config.top_k = 1  # would make sampling greedy
    model.generation_config.repetition_penalty = 5.0
    cfg = Config(model=str(tiny_model_dir), max_completion_length=8, temperature=1.0)
    torch.manual_seed(0)
    batch = lopti.rollout(model, tok, ["Zoey is a"] * 8, cfg, CPU)
    assert len({tuple(r.tolist()) for r in batch["input_ids"]}) > 1  # top_k = 1 would give 8 equal rows


def test_sampling_ignores_a_saved_generation_config_at_library_defaults(tiny_model_dir, tmp_path):
    """transformers 4.50-4.57 replace fields passed at their library default (do_sample=False, top_p=1.0,
    repetition_penalty=1.0) by the model's saved values; greedy must stay greedy and sampling plain."""
    model = lopti.load_model(str(tiny_model_dir), CPU)
    model.generation_config.update(do_sample=True, top_p=0.01, repetition_penalty=5.0, temperature=0.3)
    model.save_pretrained(tmp_path)  # a checkpoint written by transformers itself, as lopti's are
    lopti.load_tokenizer(str(tiny_model_dir)).save_pretrained(tmp_path)
    model, tok = lopti.load_model(str(tmp_path), CPU), lopti.load_tokenizer(str(tmp_path))
    cfg = Config(model=str(tmp_path), max_completion_length=6, temperature=1.0)
    prompts = ["Zoey is a", "knave"]
    greedy = lopti.rollout(model, tok, prompts, cfg, CPU, greedy=True)
    C = greedy["mask"].shape[1]
    ids, attn = greedy["input_ids"][:, :-C], greedy["attention_mask"][:, :-C]  # the left-padded prompts
    with torch.no_grad():  # argmax decoding by hand, without a KV cache
        for _ in range(C):
            pos = (attn.cumsum(-1) - 1).clamp_min(0)
            nxt = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].argmax(-1)  # (B,)
            ids, attn = torch.cat([ids, nxt[:, None]], 1), torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
    m = greedy["mask"]  # compare up to and including each row's first EOS
    assert torch.equal(torch.where(m, ids[:, -C:], -1), torch.where(m, greedy["input_ids"][:, -C:], -1))
    torch.manual_seed(0)
    sampled = lopti.rollout(model, tok, ["Zoey is a"] * 8, cfg, CPU)
    assert len({tuple(r.tolist()) for r in sampled["input_ids"]}) > 1  # top_p 0.01 would give 8 equal rows
    assert model.generation_config.top_p == 0.01  # the model's own config is restored


def test_rollout_in_generation_chunks_equals_one_batch(tiny_model_dir):
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    prompts = ["Zoey is a", "knave", "If Jack is a knight then", "Ella"]
    cfg = Config(model=str(tiny_model_dir), max_completion_length=10)
    whole = lopti.rollout(model, tok, prompts, cfg, CPU, greedy=True)
    chunked = lopti.rollout(model, tok, prompts, dataclasses.replace(cfg, generation_batch_size=3), CPU, greedy=True)
    C = whole["mask"].shape[1]
    assert chunked["mask"].shape[1] == C and torch.equal(chunked["mask"], whole["mask"])
    assert torch.equal(torch.where(chunked["mask"], chunked["input_ids"][:, -C:], 0),
                       torch.where(whole["mask"], whole["input_ids"][:, -C:], 0))
    assert chunked["texts"] == whole["texts"]


# ---------------------------------------------------------------- the training loop


def _documented_metric_keys(lopti_on: bool) -> set[str]:
    """The keys in the README's metrics table; `{stage}` expands to the passes of the run."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("## Logged metrics", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for key in re.findall(r"^\| `([^`]+)` \|", table, flags=re.M):
        for stage in (("low", "high") if lopti_on else ("all",)):
            keys.add(key.replace("{stage}", stage))
    return {k for k in keys if not k.startswith("eval/") or "{n}" not in k}


@pytest.mark.parametrize("alpha,lopti_on", [(0.3, True), (0.0, False)])
def test_train_two_steps(tiny_model_dir, tmp_path, monkeypatch, alpha, lopti_on):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", alpha=alpha, lopti=lopti_on, beta=0.01)
    before = lopti.load_model(str(tiny_model_dir), CPU).state_dict()
    ckpt = lopti.train(cfg)
    after = lopti.load_model(str(ckpt), CPU).state_dict()  # the checkpoint reloads
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    documented = _documented_metric_keys(lopti_on)
    assert documented and documented <= set(lines[-1]), documented - set(lines[-1])
    assert all(math_finite(v) for line in lines for v in line.values())
    assert "eval/accuracy_3ppl" in lines[-1]  # evaluation at the end
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"] == 2


def math_finite(v) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


def test_resume_continues_at_the_right_step_and_matches_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    straight = lopti.train(tiny_config(tiny_model_dir, tmp_path / "a", steps=3))
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "b", steps=2))
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:  # a crash after step 3's log line, mid-write
        f.write(json.dumps({"step": 3, "reward": 99.0}) + "\n" + '{"step": 4, "rew')
    args = train_args(["--resume", "--output_dir", str(tmp_path / "b"), "--steps", "3"])
    cfg = lopti.resolve_config(args)
    assert cfg.model == str(tiny_model_dir) and cfg.steps == 3  # the saved config, with the explicit override
    resumed = lopti.train(cfg, resume=True)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # (the torn line and step 3 written before the "crash" are dropped on resume)
    a, b = (lopti.load_model(str(p), CPU).state_dict() for p in (straight, resumed))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    last = [json.loads((tmp_path / p / "metrics.jsonl").read_text().splitlines()[-1]) for p in "ab"]
    assert last[0]["reward"] == last[1]["reward"]


def test_ctrl_c_finishes_the_step_saves_and_exits_130(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    real_step = lopti.train_step

    def interrupted_step(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C during the step
        return real_step(*args, **kwargs)

    monkeypatch.setattr(lopti, "train_step", interrupted_step)
    monkeypatch.setattr(lopti, "evaluate", lambda *a: pytest.fail("Ctrl-C saves without evaluating"))
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", steps=5, save_every=0)
    with pytest.raises(KeyboardInterrupt, match="after step 1"):
        lopti.train(cfg)
    ckpt = tmp_path / "run" / "checkpoint"
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"] == 1
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored
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


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run")
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    opt = torch.optim.AdamW(model.parameters())
    lopti.save_checkpoint(cfg, model, tok, opt, step=1)

    def crash(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tok, "save_pretrained", crash)
    with pytest.raises(RuntimeError):
        lopti.save_checkpoint(cfg, model, tok, opt, step=2)
    latest = lopti.latest_checkpoint(cfg.output_dir)
    assert torch.load(latest / "trainer_state.pt", weights_only=True)["step"] == 1
    lopti.load_model(str(latest), CPU)
    # a crash between the two renames: only checkpoint.old is complete, and it is found and restored
    (tmp_path / "run" / "checkpoint").rename(tmp_path / "run" / "checkpoint.old")
    assert lopti.latest_checkpoint(cfg.output_dir).name == "checkpoint.old"
    monkeypatch.undo()
    lopti.save_checkpoint(cfg, model, tok, opt, step=3)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint"]


def test_step_rows_are_a_pure_function_of_seed_and_step():
    cfg = Config(prompts_per_step=3, seed=7)
    rows = [lopti.step_rows(5, cfg, s) for s in range(5)]  # 15 draws = 3 epochs of 5 rows
    flat = [i for r in rows for i in r]
    for epoch in range(3):
        assert sorted(flat[5 * epoch : 5 * epoch + 5]) == list(range(5))
    assert rows == [lopti.step_rows(5, cfg, s) for s in range(5)]
    assert flat[:5] != flat[5:10] or flat[5:10] != flat[10:15]  # reshuffled per epoch


def test_evaluate_accuracy_per_number_of_people(tiny_model_dir, monkeypatch):
    # a stand-in reward: right on 3-person puzzles, wrong on 4-person ones
    monkeypatch.setattr(lopti, "kk_reward", lambda text, sol: 3.0 if sol.count("\n") == 2 else -0.5)
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    from datasets import concatenate_datasets

    rows = concatenate_datasets([lopti.kk_generate(3, 3, seed=1), lopti.kk_generate(2, 4, seed=1)])
    out = lopti.evaluate(model, tok, rows, Config(max_completion_length=4, eval_batch_size=2), CPU)
    assert out == {"eval/accuracy_3ppl": 1.0, "eval/reward_3ppl": 3.0, "eval/accuracy_4ppl": 0.0,
                   "eval/reward_4ppl": -0.5, "eval/accuracy": 0.6}


# ---------------------------------------------------------------- bad input: clear errors before any work


def test_output_dir_of_another_run_needs_resume(tiny_model_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(FileExistsError, match="--resume"):
        lopti.train(tiny_config(tmp_path / "no-such-model", tmp_path / "run"))  # raised before loading
    with pytest.raises(FileNotFoundError, match="--resume"):
        lopti.train(tiny_config(tiny_model_dir, tmp_path / "empty"), resume=True)


def test_batch_sizes_must_divide(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="mini_batch_size"):
        lopti.train(tiny_config(tiny_model_dir, tmp_path / "r", mini_batch_size=3))
    with pytest.raises(ValueError, match="micro_batch_size"):
        lopti.train(tiny_config(tiny_model_dir, tmp_path / "r", micro_batch_size=3))


def test_missing_model_messages(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder"):
        lopti.load_model(str(tmp_path / "nope"), CPU)
    with pytest.raises(OSError, match="not reachable"):  # HF_HUB_OFFLINE=1: fails at once
        lopti.load_model("no-such-org/no-such-model", CPU)


@pytest.mark.parametrize("argv,match", [
    (["--alpha", "1.5"], "alpha"), (["--eta", "0"], "eta"), (["--lopti_order", "sideways"], "lopti_order"),
    (["--micro_batch_size", "0"], "micro_batch_size"), (["--dual_clip", "1"], "dual_clip"),
    (["--max_grad_norm", "-1"], "max_grad_norm"), (["--weight_decay", "-0.1"], "weight_decay"),
    (["--steps", "0"], "steps"), (["--save_every", "-1"], "save_every"),
    (["--generation_batch_size", "-2"], "generation_batch_size")])
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


# ---------------------------------------------------------------- the command line


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
    assert ("--alpha" in out) == (command in ("train", "toy")) and ("--eval-data" in out) == (command in ("train", "eval"))
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


# ---------------------------------------------------------------- work that is never thrown away


@pytest.mark.parametrize("arch", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_a_shared_prompt_gives_the_log_probs_and_gradients_of_one_forward_per_row(arch, request):
    """Rows of a group share their prompt: its KV cache is computed once and indexed for every row. The log-probs
    and the gradient equal those of one full forward per row (left padding and absolute positions included)."""
    path = request.getfixturevalue(arch)
    model, tok = lopti.load_model(str(path), CPU).train(), lopti.load_tokenizer(str(path))
    enc = tok(["Who is a knight?", "A very special island. Zoey said"], return_tensors="pt", padding=True,
              add_special_tokens=False)
    ids, att = enc["input_ids"].repeat_interleave(3, 0), enc["attention_mask"].repeat_interleave(3, 0)  # 2 groups
    completions = torch.randint(3, len(tok), (6, 5), generator=torch.Generator().manual_seed(0))
    input_ids, attention_mask = torch.cat([ids, completions], 1), torch.cat([att, torch.ones_like(completions)], 1)
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    grads = []
    for rows in ([slice(None)], [slice(i, i + 1) for i in range(6)]):  # shared, then each row alone
        model.zero_grad()
        lp = torch.cat([lopti.sequence_logprobs(model, input_ids[r], attention_mask[r], 5, 0.7) for r in rows])
        (lp * weights).sum().backward()
        grads.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    for shared, alone in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(shared, alone, atol=1e-5, rtol=1e-4)


def test_rollout_runs_a_groups_prompt_once_and_samples_the_same(tiny_model_dir, monkeypatch):
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    cfg = Config(model=str(tiny_model_dir), max_completion_length=8)
    prompts = ["Zoey is a", "If Jack is a knight then"]
    alone = lopti.rollout(model, tok, prompts, cfg, CPU, greedy=True)
    calls = []
    real_prefix = lopti.prefix_cache
    monkeypatch.setattr(lopti, "prefix_cache", lambda m, ids, att: calls.append(len(ids)) or real_prefix(m, ids, att))
    grouped = lopti.rollout(model, tok, [p for p in prompts for _ in range(3)], cfg, CPU, greedy=True)
    assert calls == [6]  # one prefill for the 6 rows, of their 2 distinct prompts (prefix_cache dedups them)
    assert [grouped["texts"][i] for i in (0, 3)] == alone["texts"]
    assert grouped["texts"][0] == grouped["texts"][2] and grouped["texts"][3] == grouped["texts"][5]


def test_cut_at_ends_the_mask_at_the_token_that_completes_the_stop_text(tiny_model_dir):
    tok = lopti.load_tokenizer(str(tiny_model_dir))
    texts = ["<think> r </think><answer> Zoey is a knight </answer> and then more", "no answer here",
             "split </ans" + "wer> x"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    C = max(map(len, rows)) + 2
    completions = torch.tensor([r + [tok.pad_token_id] * (C - len(r)) for r in rows])  # (3, C)
    mask = torch.arange(C) < torch.tensor([len(r) for r in rows])[:, None]
    cut, stopped = lopti.cut_at(tok, completions, mask, "</answer>")
    assert stopped.tolist() == [True, False, True]
    kept = tok.batch_decode(torch.where(cut, completions, tok.pad_token_id), skip_special_tokens=True)
    assert kept[0].endswith("</answer>") and "more" not in kept[0]
    assert kept[1] == texts[1] and torch.equal(cut[1], mask[1])
    assert "</answer>" in kept[2] and kept[2].endswith(tok.decode(completions[2, int(cut[2].sum()) - 1]))
    # the token that completes "</answer>" is kept, the one before it is not enough
    n = int(cut[0].sum())
    assert "</answer>" not in tok.decode(completions[0, : n - 1]) and "</answer>" in tok.decode(completions[0, :n])


def test_stop_at_answer_in_rollout(tiny_model_dir, monkeypatch):
    """generate stops at '</answer>' (stop_strings) and pads; with pad == EOS the mask must still end at the stop."""
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    answer = tok("<answer> Zoey is a knight </answer>", add_special_tokens=False)["input_ids"]
    seen = {}

    def fake_generate(input_ids, attention_mask, generation_config, tokenizer, **kw):
        seen["stop"] = generation_config.stop_strings
        body = torch.tensor(answer + [tok.pad_token_id] * 3).expand(len(input_ids), -1)
        return torch.cat([input_ids, body], 1)

    monkeypatch.setattr(model, "generate", fake_generate)
    monkeypatch.setattr(tok, "pad_token_id", lopti.eos_token_ids(model, tok)[0])  # pad == EOS, as in SmolLM2
    cfg = Config(model=str(tiny_model_dir), max_completion_length=len(answer) + 3, stop_at_answer=True)
    batch = lopti.rollout(model, tok, ["Zoey is a"], cfg, CPU)
    assert seen["stop"] == ["</answer>"] and batch["mask"].sum() == len(answer) and not batch["truncated"].any()
    assert batch["texts"][0].endswith("</answer>")
    batch = lopti.rollout(model, tok, ["Zoey is a"], dataclasses.replace(cfg, stop_at_answer=False), CPU)
    assert seen["stop"] is None and batch["mask"].sum() == len(answer) + 1  # the first pad reads as an EOS


def test_pi_old_is_computed_only_for_rows_with_an_advantage(tiny_model_dir, monkeypatch):
    """beta = 0: rows of a group whose rewards are all equal have no gradient; neither pi_old nor the update
    computes them."""
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    rows = lopti.kk_generate(3, 3, seed=0)
    solution_of_group_1 = rows["solution_text_format"][1]
    monkeypatch.setattr(lopti, "kk_reward", lambda text, sol: float(len(text) % 3) if sol == solution_of_group_1 else -3.0)
    computed = []
    real = lopti.batched_logprobs
    monkeypatch.setattr(lopti, "batched_logprobs", lambda *a: computed.append(a[-1].tolist()) or real(*a))
    cfg = Config(model=str(tiny_model_dir), beta=0.0, lopti=False, num_generations=4, prompts_per_step=3, mini_batch_size=12,
                 micro_batch_size=4, max_completion_length=6, temperature=1.0)
    torch.manual_seed(0)
    m = lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), rows, CPU)
    assert m["zero_std_groups"] == pytest.approx(2 / 3, abs=1e-6) and m["all/rows"] <= 4 / 12 + 1e-6
    assert computed and all(not any(r[:4]) and not any(r[8:]) for r in computed)


def test_metrics_are_strict_json(tmp_path):
    lopti.append_jsonl(tmp_path / "m.jsonl", {"step": 1, "a": float("nan"), "b": float("inf"), "c": None, "d": 0.5})
    line = (tmp_path / "m.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}")) == {
        "step": 1, "a": None, "b": None, "c": None, "d": 0.5}


def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(tiny_model_dir, tmp_path, monkeypatch):
    """A crash (here an error standing in for kill -9) after step 2 was logged but before any checkpoint: --resume
    starts over from step 1, and no step is logged twice."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    real_step = lopti.train_step
    done = []

    def crashing_step(*a, **k):
        if len(done) == 2:
            raise SystemExit("killed")
        done.append(1)
        return real_step(*a, **k)

    monkeypatch.setattr(lopti, "train_step", crashing_step)
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", steps=3, save_every=0)
    with pytest.raises(SystemExit):
        lopti.train(cfg)
    assert lopti.latest_checkpoint(cfg.output_dir) is None
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(FileExistsError, match="--resume"):
        lopti.train(cfg)  # a fresh start does not overwrite the run
    monkeypatch.setattr(lopti, "train_step", real_step)
    assert lopti.main(["train", "--resume", "--output_dir", str(cfg.output_dir)]) == 0
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    straight = lopti.train(tiny_config(tiny_model_dir, tmp_path / "straight", steps=3, save_every=0))
    a, b = (lopti.load_model(str(p), CPU).state_dict() for p in (straight, tmp_path / "run" / "checkpoint"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same run as one that was never interrupted


def test_resume_never_unpickles_code(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    ckpt = lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", steps=1))

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    torch.save({**state, "evil": Payload()}, ckpt / "trainer_state.pt")
    with pytest.raises(Exception, match="[Ww]eights"):
        lopti.train(dataclasses.replace(tiny_config(tiny_model_dir, tmp_path / "run"), steps=2), resume=True)
    assert not (tmp_path / "pwned").exists()


def test_plot_writes_one_png_of_runs(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    for name, lopti_on in (("grpo", False), ("ar_lopti", True)):
        lopti.train(tiny_config(tiny_model_dir, tmp_path / name, steps=2, lopti=lopti_on, alpha=0.3 * lopti_on))
    out = tmp_path / "curves.png"
    assert lopti.main(["plot", str(tmp_path / "grpo"), str(tmp_path / "ar_lopti"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lopti.main(["plot", str(tmp_path / "nothing")]) == 2
