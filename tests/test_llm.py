"""The LLM run (lopti.py's "LLM run" sections) on tiny random models made in conftest.py (no download): masks
and log-probs, the shared prompt, rollout, the training loop, checkpoints and resume, evaluation and plots."""
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

import lopti
from conftest import tiny_config, varied_reward
from lopti import Config

CPU = torch.device("cpu")



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
    tok.pad_token = tok.convert_ids_to_tokens(lopti.eos_token_ids(model, tok)[0])  # pad == EOS, as in SmolLM2
    cfg = Config(model=str(tiny_model_dir), max_completion_length=len(answer) + 3, stop_at_answer=True)
    batch = lopti.rollout(model, tok, ["Zoey is a"], cfg, CPU)
    assert seen["stop"] == ["</answer>"] and batch["mask"].sum() == len(answer) and not batch["truncated"].any()
    assert batch["texts"][0].endswith("</answer>")
    batch = lopti.rollout(model, tok, ["Zoey is a"], dataclasses.replace(cfg, stop_at_answer=False), CPU)
    assert seen["stop"] is None and batch["mask"].sum() == len(answer) + 1  # the first pad reads as an EOS


def test_missing_model_messages(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder"):
        lopti.load_model(str(tmp_path / "nope"), CPU)
    with pytest.raises(OSError, match="not reachable"):  # HF_HUB_OFFLINE=1: fails at once
        lopti.load_model("no-such-org/no-such-model", CPU)


def _documented_metric_keys(lopti_on: bool) -> set[str]:
    """The keys in the metrics table of toy/README.md; `{stage}` expands to the passes of the run."""
    readme = (Path(__file__).resolve().parent.parent / "toy" / "README.md").read_text()
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


def test_pi_old_is_computed_only_for_rows_with_an_advantage(tiny_model_dir, monkeypatch):
    """beta = 0: rows of a group whose rewards are all equal have no gradient; neither pi_old nor the update
    computes them."""
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    rows = lopti.kk_generate(3, 3, seed=0)
    solution_of_group_1 = rows["solution_text_format"][1]
    monkeypatch.setattr(lopti, "kk_reward",
                        lambda text, sol: float(len(text) % 3) if sol == solution_of_group_1 else -3.0)
    computed = []
    real = lopti.batched_logprobs
    monkeypatch.setattr(lopti, "batched_logprobs", lambda *a: computed.append(a[4].tolist()) or real(*a))
    cfg = Config(model=str(tiny_model_dir), beta=0.0, lopti=False, num_generations=4, prompts_per_step=3,
                 mini_batch_size=12, micro_batch_size=4, max_completion_length=6, temperature=1.0)
    torch.manual_seed(0)
    m = lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), rows, CPU)
    assert m["zero_std_groups"] == pytest.approx(2 / 3, abs=1e-6) and 1 / 12 < m["all/rows"] <= 4 / 12 + 1e-6
    assert len(computed) == 2 and not any(computed[0][:4]) and not any(computed[0][8:])
    assert computed[1] == computed[0]  # the update's measurement (measure_update) reads the same rows
    assert sum(computed[0][4:8]) == round(m["all/rows"] * 12)  # pi_old for exactly the rows the update computes


def test_a_step_where_no_row_has_an_advantage_computes_nothing(tiny_model_dir, monkeypatch):
    """beta = 0 and every group's rewards equal (a collapsed policy): no pi_old, no update, no error. A real
    SmolLM2 run crashed here when an empty index still reached the model."""
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    monkeypatch.setattr(lopti, "kk_reward", lambda text, sol: -1.0)
    cfg = Config(model=str(tiny_model_dir), beta=0.0, num_generations=4, prompts_per_step=2, mini_batch_size=8,
                 micro_batch_size=4, max_completion_length=6, temperature=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(0)
    m = lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), lopti.kk_generate(2, 2, seed=0), CPU)
    assert m["zero_std_groups"] == 1.0 and m["low/rows"] == 0.0 and m["high/rows"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_metrics_are_strict_json(tmp_path):
    lopti.append_jsonl(tmp_path / "m.jsonl", {"step": 1, "a": float("nan"), "b": float("inf"), "c": None, "d": 0.5,
                                              "diagnose": {"bins": [0.1, float("nan")]}})  # also inside lists
    line = (tmp_path / "m.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}")) == {
        "step": 1, "a": None, "b": None, "c": None, "d": 0.5, "diagnose/bins": [0.1, None]}


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


def test_evaluate_accuracy_per_number_of_people(tiny_model_dir, monkeypatch):
    # a stand-in reward: right on 3-person puzzles, wrong on 4-person ones
    monkeypatch.setattr(lopti, "kk_reward", lambda text, sol: 3.0 if sol.count("\n") == 2 else -0.5)
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    from datasets import concatenate_datasets

    rows = concatenate_datasets([lopti.kk_generate(3, 3, seed=1), lopti.kk_generate(2, 4, seed=1)])
    out = lopti.evaluate(model, tok, rows, Config(max_completion_length=4, eval_batch_size=2), CPU)
    assert out == {"eval/accuracy_3ppl": 1.0, "eval/reward_3ppl": 3.0, "eval/accuracy_4ppl": 0.0,
                   "eval/reward_4ppl": -0.5, "eval/accuracy": 0.6}


def test_plot_writes_one_png_of_runs(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    for name, lopti_on in (("grpo", False), ("ar_lopti", True)):
        lopti.train(tiny_config(tiny_model_dir, tmp_path / name, steps=2, lopti=lopti_on, alpha=0.3 * lopti_on))
    out = tmp_path / "curves.png"
    assert lopti.main(["plot", str(tmp_path / "grpo"), str(tmp_path / "ar_lopti"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lopti.main(["plot", str(tmp_path / "nothing")]) == 2


def test_folders_that_hold_a_run_are_never_overwritten_or_resumed_wrongly(tiny_model_dir, tmp_path):
    """A folder with only samples.jsonl (killed between the two lines of step 1) holds a run; a folder written by
    --engine trl (checkpoint/ without trainer_state.pt) is not resumed as if it had no checkpoint."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "samples.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(FileExistsError, match="--resume"):
        lopti.train(tiny_config(tiny_model_dir, tmp_path / "a"))
    trl_run = tmp_path / "b"
    (trl_run / "checkpoint").mkdir(parents=True)
    (trl_run / "config.json").write_text("{}")
    (trl_run / "metrics.jsonl").write_text('{"step": 1, "reward": -3.0}\n')
    with pytest.raises(ValueError, match="engine trl"):
        lopti.train(tiny_config(tiny_model_dir, trl_run), resume=True)
    assert (trl_run / "metrics.jsonl").read_text() == '{"step": 1, "reward": -3.0}\n'  # untouched


def test_plot_skips_a_line_torn_by_a_crash(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": -3.0, "accuracy": 0.0}\n{"step": 2, "rew')
    assert lopti.main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0



@pytest.mark.parametrize("arch", ["tiny_model_dir", "tiny_gpt2_dir"])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, None])  # one position per chunk, 7 (divides no C here), one chunk
def test_chunked_logprobs_equal_the_full_logits_values_and_gradients(arch, rows_per_chunk, request, monkeypatch):
    """sequence_logprobs applies the output layer chunk by chunk to the final hidden states (recomputed in backward);
    log-probs and gradients equal those of the model's own full (B, L, V) logits, with and without a shared prompt."""
    path = request.getfixturevalue(arch)
    model, tok = lopti.load_model(str(path), CPU).train(), lopti.load_tokenizer(str(path))
    V = model.get_output_embeddings().out_features
    real = lopti.token_logprobs
    chunk = V * rows_per_chunk if rows_per_chunk else 2**24
    monkeypatch.setattr(lopti, "token_logprobs", lambda *a, **k: real(*a, **k, chunk_elems=chunk))
    enc = tok(["Who is a knight?", "A very special island. Zoey said"], return_tensors="pt", padding=True,
              add_special_tokens=False)
    completions = torch.randint(3, len(tok), (6, 9), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(6, 9, generator=torch.Generator().manual_seed(1))
    for repeat in (False, True):  # distinct prompts (one forward), then 2 groups of 3 (the shared-prompt path)
        ids, att = [enc[k].repeat_interleave(3, 0) if repeat else enc[k].repeat(3, 1)
                    for k in ("input_ids", "attention_mask")]
        input_ids, attention_mask = torch.cat([ids, completions], 1), torch.cat([att, torch.ones_like(completions)], 1)
        results = []
        for chunked in (True, False):
            model.zero_grad()
            if chunked:
                lp = lopti.sequence_logprobs(model, input_ids, attention_mask, 9, 0.7)
            else:  # today's reference: the model's own logits, log-softmax over the whole vocabulary
                logits = model(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=(attention_mask.cumsum(-1) - 1).clamp_min(0)).logits[:, -10:-1]
                lp = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, completions[..., None]).squeeze(-1)
            (lp * weights).sum().backward()
            results.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
        for chunked_grad, full_grad in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(chunked_grad, full_grad, atol=1e-5, rtol=1e-4)


def test_each_micro_batch_runs_only_up_to_its_longest_completion(tiny_model_dir, monkeypatch):
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    cfg = Config(model=str(tiny_model_dir), max_completion_length=10, micro_batch_size=2)
    enc = tok(["Who is a knight?"] * 4, return_tensors="pt", add_special_tokens=False)
    completions = torch.randint(3, len(tok), (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(10) < torch.tensor([[3], [5], [2], [0]])  # micro-batches: longest 5, then 2 (a row of 0)
    batch = {"input_ids": torch.cat([enc["input_ids"], completions], 1), "mask": mask,
             "attention_mask": torch.ones(4, enc["input_ids"].shape[1] + 10, dtype=torch.long)}
    widths, real = [], lopti.sequence_logprobs
    monkeypatch.setattr(lopti, "sequence_logprobs", lambda m, i, a, c, t: widths.append(c) or real(m, i, a, c, t))
    out = lopti.batched_logprobs(model, batch, cfg, CPU)
    assert widths == [5, 2]
    with torch.no_grad():
        full = real(model, batch["input_ids"], batch["attention_mask"], 10, cfg.temperature)
    torch.testing.assert_close(out[mask], full[mask], atol=1e-5, rtol=0)
    assert (out[:, 5:] == 0).all() and (out[2:, 2:] == 0).all()


def test_models_that_rescale_their_logits_are_refused(tiny_model_dir):
    model = lopti.load_model(str(tiny_model_dir), CPU)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's tanh cap after the output layer
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        lopti.sequence_logprobs(model, torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), 2, 1.0)


@pytest.mark.parametrize("phase,target,lower", [("rollout", "rollout", "generation_batch_size"),
                                                ("pi_old pass", "batched_logprobs", "micro_batch_size"),
                                                ("update", "update_policy", "micro_batch_size")])
def test_out_of_gpu_memory_is_one_line_naming_the_phase_and_the_checkpoint_stays(
        tiny_model_dir, tmp_path, monkeypatch, capsys, phase, target, lower):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_model_dir), "--output-dir", str(out), "--steps", "2", "--save-every", "1",
            "--prompts-per-step", "2", "--num-generations", "4", "--mini-batch-size", "4", "--micro-batch-size", "2",
            "--max-completion-length", "4", "--num-people", "3", "--num-train", "8", "--eval-every", "0",
            "--eval-size", "1", "--beta", "0"]
    calls, real = [], getattr(lopti, target)

    def fail_at_step_2(*a):
        calls.append(1)
        if len(calls) > (2 if target == "batched_logprobs" else 1):  # (step 1 has pi_old's and the measurement's)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*a)

    monkeypatch.setattr(lopti, target, fail_at_step_2)
    assert lopti.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lopti.py")]  # not progress bars
    assert len(err) == 1 and f"out of GPU memory in the {phase}; lower --{lower}" in err[0], err
    ckpt = lopti.latest_checkpoint(str(out))
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"] == 1
    lopti.load_model(str(ckpt), CPU)  # loads
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_checkpointed_policy_shares_the_prompt_in_pi_old_and_not_in_the_update(tiny_model_dir, monkeypatch):
    """HF drops the KV cache only when training with gradient checkpointing: pi_old (eval, no grad) still runs a
    group's prompt once, and equals the update's log-probs, which run every row's prompt."""
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = Config(model=str(tiny_model_dir), max_completion_length=8, micro_batch_size=3)
    torch.manual_seed(0)
    batch = lopti.rollout(model, tok, ["Zoey is a"] * 3, cfg, CPU)
    calls, real = [], lopti.prefix_cache
    monkeypatch.setattr(lopti, "prefix_cache", lambda *a: calls.append(len(a[1])) or real(*a))
    old = lopti.batched_logprobs(model, batch, cfg, CPU)
    assert calls == [3]
    model.train()
    new = lopti.completion_logprobs(model, batch, cfg.temperature)
    assert calls == [3] and new.requires_grad
    torch.testing.assert_close(new.detach(), old, atol=1e-5, rtol=0)


# --- diagnose: the paper's Figure 1 on a model's rollouts (measure_bins inside train_step)

TINY_FLAGS = ["--prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
              "--micro_batch_size", "2", "--mini_batch_size", "8", "--num_train", "16", "--num_people", "3"]


def test_diagnose_leaves_the_weights_bit_identical_and_writes_the_papers_keys(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    cfg = tiny_config(tiny_model_dir, tmp_path, mini_batch_size=8)
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    before = [p.detach().clone() for p in model.parameters()]
    m = lopti.train_step(cfg, model, None, tok, None, lopti.kk_generate(2, 3, seed=0), CPU, measure=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # every probe undone, bit for bit
    d = m["diagnose"]
    assert sum(d["token_share"]["all"]) == pytest.approx(1.0)
    assert d["grad_norm"]["all"] > 0 and set(d["prob_change"]) == {"all", "lowest_only", "highest_only"}
    json.dumps(d, allow_nan=False)  # an empty bin is None, never NaN
    assert lopti.main(["diagnose", "--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "d"),
                       *TINY_FLAGS]) == 0
    r = json.loads((tmp_path / "d" / f"diagnose_{tiny_model_dir.name}_seed0.json").read_text())
    assert list(r) == ["bins", "token_share", "grad_norm", "prob_change", "paper"]
    assert r["paper"]["token_share"] == [0.1922, 0.1015, 0.1009, 0.6054]


def test_train_diagnose_every_logs_flat_keys_changes_nothing_and_plots(tiny_model_dir, tmp_path, monkeypatch):
    """The measurement restores the weights and draws no random numbers: a run that measures every step trains
    exactly as one that does not."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "a", steps=2, mini_batch_size=8))
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "b", steps=2, mini_batch_size=8, diagnose_every=2))
    a, b = (lopti.read_jsonl(tmp_path / r / "metrics.jsonl") for r in "ab")
    for key in ("reward", "low/loss", "high/loss", "low/grad_norm"):
        assert [x[key] for x in a] == [x[key] for x in b], key
    assert "diagnose/grad_norm/all" not in b[0] and len(b[1]["diagnose/grad_norm/bins"]) == 4
    wa, wb = (lopti.load_model(str(tmp_path / r / "checkpoint"), CPU).state_dict() for r in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    pytest.importorskip("matplotlib")
    assert lopti.main(["plot", str(tmp_path / "b"), "--out", str(tmp_path / "c.png")]) == 0
