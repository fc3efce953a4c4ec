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
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"] == 2


def math_finite(v) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


def test_resume_continues_at_the_right_step_and_matches_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    straight = lopti.train(tiny_config(tiny_model_dir, tmp_path / "a", steps=3))
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "b", steps=2))
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:  # a crash after step 3's log line, mid-write
        f.write(json.dumps({"step": 3, "reward": 99.0}) + "\n" + '{"step": 4, "rew')
    args = vars(lopti.config_parser("t").parse_args(["--resume", "--output_dir", str(tmp_path / "b"), "--steps", "3"]))
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


def test_ctrl_c_finishes_the_step_and_saves(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    real_step = lopti.train_step

    def interrupted_step(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C during the step
        return real_step(*args, **kwargs)

    monkeypatch.setattr(lopti, "train_step", interrupted_step)
    ckpt = lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", steps=5, save_every=0))
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"] == 1
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored


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
    assert torch.load(latest / "trainer_state.pt", weights_only=False)["step"] == 1
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
    with pytest.raises(OSError, match="internet"):  # HF_HUB_OFFLINE=1: fails at once
        lopti.load_model("no-such-org/no-such-model", CPU)


@pytest.mark.parametrize("argv,match", [
    (["--alpha", "1.5"], "alpha"), (["--eta", "0"], "eta"), (["--lopti_order", "sideways"], "lopti_order"),
    (["--micro_batch_size", "0"], "micro_batch_size"), (["--dual_clip", "1"], "dual_clip"),
    (["--max_grad_norm", "-1"], "max_grad_norm"), (["--weight_decay", "-0.1"], "weight_decay"),
    (["--steps", "0"], "steps"), (["--save_every", "-1"], "save_every"),
    (["--generation_batch_size", "-2"], "generation_batch_size")])
def test_bad_config_values(argv, match):
    with pytest.raises(ValueError, match=match):
        lopti.resolve_config(vars(lopti.config_parser("t").parse_args(argv)))


def test_config_precedence_and_bool_parsing():
    parse = lambda argv: lopti.resolve_config(vars(lopti.config_parser("t").parse_args(argv)))  # noqa: E731
    assert parse([]) == Config()
    cfg = parse(["--preset", "cpu", "--num-generations", "2", "--lopti", "false"])
    assert cfg.model == lopti.PRESETS["cpu"]["model"] and cfg.num_generations == 2 and cfg.lopti is False
    with pytest.raises(SystemExit):
        parse(["--lopti", "maybe"])


def test_resume_with_a_config_from_another_version_names_the_unknown_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**dataclasses.asdict(Config()), "warp_factor": 9}))
    with pytest.raises(ValueError, match="warp_factor"):
        lopti.resolve_config(vars(lopti.config_parser("t").parse_args(["--resume", "--output_dir", str(tmp_path)])))


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


def test_cli_without_a_command_prints_usage():
    with pytest.raises(SystemExit, match="usage"):
        lopti.main([])
