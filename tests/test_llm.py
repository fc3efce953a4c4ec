"""The LLM run (lopti.py's section "The LLM run") on tiny random models made in conftest.py (no download): masks and
log-probs, the shared prompt, rollout and sampling, train_step's rows, the training loop, checkpoints, evaluation."""
import dataclasses
import hashlib
import json
import math
import shutil

import datasets
import pytest
import torch

import lopti
from conftest import tiny_config, varied_reward
from lopti import Config

CPU = torch.device("cpu")


def load(path):
    return lopti.load_model(str(path), CPU), lopti.load_tokenizer(str(path))


def fixed(values):
    """A reward function (Config.reward) that returns `values` whatever was sampled (cycled to the batch's length:
    an evaluation's batch is smaller): advantages chosen by the test."""
    def rewards(completions, solutions):
        return torch.tensor([values[i % len(values)] for i in range(len(completions))], dtype=torch.float)
    return rewards


@pytest.fixture
def kk_reward_read_afresh(monkeypatch):
    """reward_function caches the function of --reward kk: for this test it reads lopti.kk_rewards (and so a
    monkeypatched lopti.kk_reward) at each call, and leaves the cache as it was."""
    monkeypatch.setattr(lopti, "reward_function", getattr(lopti.reward_function, "__wrapped__", lopti.reward_function))


def prompt_batch(tok, prompts, completions):
    """Left-padded prompts followed by `completions` (B, C): input_ids and attention_mask as rollout makes them."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return (torch.cat([enc["input_ids"], completions], 1),
            torch.cat([enc["attention_mask"], torch.ones_like(completions)], 1))


# --- masks and log-probs


def test_completion_mask_golden_with_pad_equal_to_eos_and_two_eos_ids():
    """The mask ends at the first EOS, inclusive, from positions (pad == EOS = 2 here); no EOS is truncated."""
    completions = torch.tensor([[5, 7, 2, 2, 2], [5, 2, 9, 2, 2], [5, 7, 8, 9, 6], [3, 5, 2, 3, 3]])
    mask, truncated = lopti.completion_mask(completions, [2, 3])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]


@pytest.mark.parametrize("arch", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_left_padded_batch_logprobs_equal_each_row_alone(arch, request):
    """Position ids come from the attention mask: a left-padded row scores as it would alone (gpt2: absolute
    positions, where the model's own default positions are wrong)."""
    model, tok = load(request.getfixturevalue(arch))
    prompts = ["Who is a knight?", "A very special island is inhabited only by knights and knaves. Zoey said"]
    completions = torch.randint(3, len(tok), (2, 6), generator=torch.Generator().manual_seed(0))
    input_ids, attention_mask = prompt_batch(tok, prompts, completions)
    assert (attention_mask[0] == 0).any()  # row 0 really is left-padded
    with torch.no_grad():
        batched = lopti.sequence_logprobs(model.eval(), input_ids, attention_mask, 6, 0.7)
        for i, prompt in enumerate(prompts):
            ids = torch.cat([tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"],
                             completions[i:i + 1]], 1)
            alone = lopti.sequence_logprobs(model, ids, torch.ones_like(ids), 6, 0.7)
            torch.testing.assert_close(batched[i:i + 1], alone, atol=1e-5, rtol=1e-5)
        if arch == "tiny_gpt2_dir":  # the check has teeth: default positions score the padded row wrongly
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -7:-1]
            assert not torch.allclose(lopti.token_logprobs(logits, completions, 0.7)[0], batched[0], atol=1e-3)


@pytest.mark.parametrize("arch", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_a_shared_prompt_gives_the_log_probs_and_gradients_of_one_forward_per_row(arch, request):
    """Prefix sharing: a group's prompt runs once and its KV cache is indexed to every row, differentiably; the
    log-probs and the gradient equal those of one forward per row (left padding and absolute positions included)."""
    model, tok = load(request.getfixturevalue(arch))
    model.train()
    completions = torch.randint(3, len(tok), (6, 5), generator=torch.Generator().manual_seed(0))
    input_ids, attention_mask = prompt_batch(tok, [p for p in ("Who is a knight?", "A very special island. Zoey said")
                                                   for _ in range(3)], completions)  # 2 groups of 3
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    calls, real = [], lopti.prefix_cache
    results = []
    for rows in ([slice(None)], [slice(i, i + 1) for i in range(6)]):  # shared, then each row alone
        model.zero_grad()
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lopti, "prefix_cache", lambda *a: calls.append(len(a[1])) or real(*a))
            lp = torch.cat([lopti.sequence_logprobs(model, input_ids[r], attention_mask[r], 5, 0.7) for r in rows])
        (lp * weights).sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in model.parameters()], list(calls)))
    assert results[0][2] == [6] and results[1][2] == []  # the shared path was taken, then the plain one
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for shared, alone in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(shared, alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["tiny_model_dir", "tiny_gpt2_dir"])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, None])  # one position per chunk, 7 (divides no count here), one
def test_chunked_logprobs_equal_the_full_logits_values_and_gradients(arch, rows_per_chunk, request, monkeypatch):
    """sequence_logprobs applies the output layer chunk by chunk to the final hidden states (recomputed in backward);
    log-probs and gradients equal those of log_softmax over the model's own full (B, L, V) logits, with and without
    a shared prompt."""
    model, tok = load(request.getfixturevalue(arch))
    model.train()
    V, real = model.get_output_embeddings().out_features, lopti.hidden_logprobs
    chunk = V * rows_per_chunk if rows_per_chunk else 2**24
    monkeypatch.setattr(lopti, "hidden_logprobs", lambda *a, **k: real(*a, **{**k, "chunk_elems": chunk}))
    completions = torch.randint(3, len(tok), (6, 9), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(6, 9, generator=torch.Generator().manual_seed(1))
    prompts = ["Who is a knight?", "A very special island. Zoey said"]
    for grouped in (False, True):  # distinct neighbours (one forward), then 2 groups of 3 (the shared prompt)
        rows = [p for p in prompts for _ in range(3)] if grouped else prompts * 3
        input_ids, attention_mask = prompt_batch(tok, rows, completions)
        results = []
        for chunked in (True, False):
            model.zero_grad()
            if chunked:
                lp = lopti.sequence_logprobs(model, input_ids, attention_mask, 9, 0.7)
            else:
                logits = model(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=(attention_mask.cumsum(-1) - 1).clamp_min(0)).logits[:, -10:-1]
                lp = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, completions[..., None]).squeeze(-1)
            (lp * weights).sum().backward()
            results.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
        for chunked_grad, full_grad in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(chunked_grad, full_grad, atol=1e-5, rtol=1e-4)


def test_a_model_that_rescales_its_logits_is_scored_right_or_refused(tmp_path):
    """pi_old must be the distribution generate() samples from: the model's own logits. A model whose forward
    rescales the output layer's logits is scored by them, or refused with one ValueError naming the setting."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, logits_scaling=4.0)
    transformers.GraniteForCausalLM(config).save_pretrained(tmp_path)
    try:
        model = lopti.load_model(str(tmp_path), CPU).eval()
    except ValueError as e:
        assert "logits_scaling" in str(e)
        return
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = lopti.sequence_logprobs(model, ids, torch.ones_like(ids), 4, 0.7)
        logits = model(input_ids=ids).logits[:, -5:-1].float()
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, -4:, None]).squeeze(-1),
                               atol=1e-5, rtol=1e-5)


def test_each_micro_batch_runs_only_up_to_its_longest_completion(tiny_model_dir, monkeypatch):
    """Trimming a micro-batch to its longest completion is exact (attention is causal); later columns are 0."""
    model, tok = load(tiny_model_dir)
    cfg = Config(model=str(tiny_model_dir), max_completion_length=10, micro_batch_size=2)
    completions = torch.randint(3, len(tok), (4, 10), generator=torch.Generator().manual_seed(0))
    input_ids, attention_mask = prompt_batch(tok, ["Who is a knight?"] * 4, completions)
    mask = torch.arange(10) < torch.tensor([[3], [5], [2], [0]])  # micro-batches: longest 5, then 2 (and a 0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "mask": mask}
    widths, real = [], lopti.sequence_logprobs
    monkeypatch.setattr(lopti, "sequence_logprobs", lambda m, i, a, c, t: widths.append(c) or real(m, i, a, c, t))
    out = lopti.batched_logprobs(model, batch, cfg, CPU)
    assert widths == [5, 2]
    with torch.no_grad():
        full = real(model, input_ids, attention_mask, 10, cfg.temperature)
    torch.testing.assert_close(out[mask], full[mask], atol=1e-5, rtol=0)
    assert (out[:2, 5:] == 0).all() and (out[2:, 2:] == 0).all()


# --- rollout and sampling


def sample_by_hand(model, input_ids, attention_mask, steps: int, temperature: float | None, seed: int = 0):
    """Plain decoding, one full forward per token (no KV cache): argmax (temperature None), or a draw from
    softmax(z / T) by torch.multinomial, as generate() draws, from torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    ids, att = input_ids, attention_mask
    with torch.no_grad():
        for _ in range(steps):
            z = model(input_ids=ids, attention_mask=att,
                      position_ids=(att.cumsum(-1) - 1).clamp_min(0)).logits[:, -1].float()  # (B, V)
            nxt = z.argmax(-1, keepdim=True) if temperature is None else torch.multinomial(
                torch.softmax(z / temperature, -1), 1)
            ids, att = torch.cat([ids, nxt], 1), torch.cat([att, torch.ones_like(nxt)], 1)
    return ids[:, -steps:]


@pytest.fixture(params=["set_in_memory", "saved_at_library_defaults"])
def model_with_a_generation_config(request, tiny_model_dir, tmp_path):
    """The tiny model with Qwen-like sampling settings in its generation config: set on the loaded model, or saved
    by transformers and reloaded (transformers fills a generate() argument left at its library default, e.g.
    top_p=1.0, repetition_penalty=1.0, do_sample=False, from the saved config)."""
    model, tok = load(tiny_model_dir)
    model.generation_config.update(do_sample=True, top_k=2, top_p=0.05, repetition_penalty=5.0, temperature=0.3)
    if request.param == "saved_at_library_defaults":
        model.save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)
        model, tok = load(tmp_path)
        assert model.generation_config.top_p == 0.05
    return model, tok


def test_sampling_ignores_the_models_generation_config(model_with_a_generation_config):
    """pi_old must be the distribution the tokens were drawn from: softmax(z / T), no top-k, top-p or repetition
    penalty from the model's generation config; greedy stays greedy; the model's config is restored after."""
    model, tok = model_with_a_generation_config
    cfg = Config(model="unused", max_completion_length=6, temperature=0.7)
    torch.manual_seed(0)
    sampled = lopti.rollout(model, tok, ["Zoey is a"] * 8, cfg, CPU)  # one group: the prompt's cache is shared
    C, m = sampled["mask"].shape[1], sampled["mask"]
    by_hand = sample_by_hand(model, sampled["input_ids"][:, :-C], sampled["attention_mask"][:, :-C], C, 0.7)
    assert torch.equal(torch.where(m, sampled["input_ids"][:, -C:], -1), torch.where(m, by_hand, -1))
    assert len({tuple(r) for r in by_hand.tolist()}) > 1  # top_k 2 / top_p 0.05 would have made most rows agree
    greedy = lopti.rollout(model, tok, ["Zoey is a", "knave"], cfg, CPU, greedy=True)
    C, m = greedy["mask"].shape[1], greedy["mask"]
    by_hand = sample_by_hand(model, greedy["input_ids"][:, :-C], greedy["attention_mask"][:, :-C], C, None)
    assert torch.equal(torch.where(m, greedy["input_ids"][:, -C:], -1), torch.where(m, by_hand, -1))
    assert model.generation_config.top_p == 0.05 and model.generation_config.repetition_penalty == 5.0


def test_rollout_mask_ends_at_the_first_eos_of_either_id_across_generation_chunks(tiny_model_dir, monkeypatch):
    """Both EOS ids (the generation config's and the tokenizer's) end a completion, EOS included; a row without one
    is truncated; a chunk that ended early is padded to the longest chunk without changing its masks."""
    model, tok = load(tiny_model_dir)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert lopti.eos_token_ids(model, tok) == sorted([im_end, endoftext]) and tok.pad_token_id == endoftext
    a, b = tok("Zoey", add_special_tokens=False)["input_ids"][0], tok("knave", add_special_tokens=False)["input_ids"][0]
    bodies = iter([[[a, im_end, endoftext], [a, b, endoftext]],  # chunk 1: both rows ended after 3 tokens
                   [[b, b, b, b, b], [a, im_end, a, b, im_end]]])  # chunk 2: no EOS; text after the EOS

    def fake_generate(input_ids, attention_mask, generation_config, **kw):
        assert sorted(generation_config.eos_token_id) == sorted([im_end, endoftext])
        return torch.cat([input_ids, torch.tensor(next(bodies))], 1)

    monkeypatch.setattr(model, "generate", fake_generate)
    cfg = Config(model="unused", max_completion_length=5, generation_batch_size=2)
    batch = lopti.rollout(model, tok, ["Zoey is a", "knave", "Ella", "Jack said"], cfg, CPU)
    assert batch["mask"].int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["truncated"].tolist() == [False, False, True, False]
    assert batch["input_ids"].shape[1] == batch["attention_mask"].shape[1] and batch["attention_mask"][:, -5:].all()
    assert batch["texts"] == [tok.decode([a]), tok.decode([a, b]), tok.decode([b] * 5), tok.decode([a])]


def test_rollout_in_generation_chunks_equals_one_batch(tiny_model_dir):
    """generation_batch_size bounds the KV cache; the completions are those of one batch (greedy)."""
    model, tok = load(tiny_model_dir)
    prompts = ["Zoey is a", "knave", "If Jack is a knight then", "Ella"]
    cfg = Config(model="unused", max_completion_length=10)
    whole = lopti.rollout(model, tok, prompts, cfg, CPU, greedy=True)
    chunked = lopti.rollout(model, tok, prompts, dataclasses.replace(cfg, generation_batch_size=3), CPU, greedy=True)
    C = whole["mask"].shape[1]
    assert chunked["mask"].shape[1] == C and torch.equal(chunked["mask"], whole["mask"])
    assert torch.equal(torch.where(chunked["mask"], chunked["input_ids"][:, -C:], 0),
                       torch.where(whole["mask"], whole["input_ids"][:, -C:], 0))
    assert chunked["texts"] == whole["texts"] and torch.equal(chunked["truncated"], whole["truncated"])


def test_rollout_runs_a_groups_prompt_once_and_samples_the_same(tiny_model_dir, monkeypatch):
    """Rollout prefills a group's shared prompt once (prefix_cache), and completes it as it would each prompt alone."""
    model, tok = load(tiny_model_dir)
    cfg = Config(model="unused", max_completion_length=8)
    prompts = ["Zoey is a", "If Jack is a knight then"]
    alone = lopti.rollout(model, tok, prompts, cfg, CPU, greedy=True)
    calls, real = [], lopti.prefix_cache
    monkeypatch.setattr(lopti, "prefix_cache", lambda m, ids, att: calls.append(len(ids)) or real(m, ids, att))
    grouped = lopti.rollout(model, tok, [p for p in prompts for _ in range(3)], cfg, CPU, greedy=True)
    assert calls == [6]  # one prefill call for the 6 rows (prefix_cache runs their 2 distinct prompts)
    assert grouped["texts"] == [t for t in alone["texts"] for _ in range(3)]


def test_cut_at_ends_the_mask_at_the_token_that_completes_the_stop_text(tiny_model_dir):
    """stop_at_answer's cut: the mask keeps the token that completes '</answer>' (even split over tokens), no later."""
    tok = lopti.load_tokenizer(str(tiny_model_dir))
    texts = ["<think> r </think><answer> Zoey is a knight </answer> and then more", "no answer here",
             "split </ans" + "wer> x"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    C = max(map(len, rows)) + 2
    completions = torch.tensor([r + [tok.pad_token_id] * (C - len(r)) for r in rows])  # (3, C)
    mask = torch.arange(C) < torch.tensor([len(r) for r in rows])[:, None]
    given = mask.clone()
    cut, stopped = lopti.cut_at(tok, completions, mask, "</answer>")
    assert torch.equal(mask, given)  # the input is not mutated
    assert stopped.tolist() == [True, False, True]
    kept = tok.batch_decode(torch.where(cut, completions, tok.pad_token_id), skip_special_tokens=True)
    assert kept[0].endswith("</answer>") and "more" not in kept[0]
    assert kept[1] == texts[1] and torch.equal(cut[1], mask[1])
    assert "</answer>" in kept[2] and "x" not in kept[2].split("</answer>")[1]
    for i in (0, 2):  # the token that completes "</answer>" is kept, and no token after it
        n = int(cut[i].sum())
        assert "</answer>" not in tok.decode(completions[i, :n - 1]) and "</answer>" in tok.decode(completions[i, :n])
        assert cut[i, :n].all() and not cut[i, n:].any()


@pytest.mark.parametrize("stop_at_answer", [True, False])
def test_stop_at_answer_in_rollout(tiny_model_dir, monkeypatch, stop_at_answer):
    """With stop_at_answer the completion ends at '</answer>' and is not truncated; without, it runs on (here to
    max_completion_length without an EOS: truncated). pad == EOS, as in SmolLM2."""
    model, tok = load(tiny_model_dir)
    answer = tok("<answer> Zoey is a knight </answer>", add_special_tokens=False)["input_ids"]
    more = tok(" and more", add_special_tokens=False)["input_ids"]

    def fake_generate(input_ids, attention_mask, generation_config, **kw):
        return torch.cat([input_ids, torch.tensor(answer + more).expand(len(input_ids), -1)], 1)

    monkeypatch.setattr(model, "generate", fake_generate)
    tok.pad_token = tok.convert_ids_to_tokens(lopti.eos_token_ids(model, tok)[0])
    cfg = Config(model="unused", max_completion_length=len(answer + more), stop_at_answer=stop_at_answer)
    batch = lopti.rollout(model, tok, ["Zoey is a"], cfg, CPU)
    assert int(batch["mask"].sum()) == (len(answer) if stop_at_answer else len(answer + more))
    assert batch["truncated"].tolist() == [not stop_at_answer]
    assert batch["texts"][0].endswith("</answer>" if stop_at_answer else "more")


# --- train_step: pi_old, the rows it computes, and the loop


def tiny_step(cfg, model, tok, rows=None):
    """One train_step on 3-person puzzles, from seed 0."""
    torch.manual_seed(0)
    rows = lopti.kk_generate(cfg.prompts_per_step, 3, seed=0) if rows is None else rows
    return lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), rows, CPU)


@pytest.mark.parametrize("arch,checkpointing", [("tiny_model_dir", False), ("tiny_model_dir", True),
                                                 ("tiny_gpt2_dir", False)])
def test_pi_old_equals_the_first_update_log_probs(arch, checkpointing, request, tmp_path, monkeypatch):
    """Ratio 1 (kl_old 0) before the first optimiser step: pi_old (eval, no grad, the prompt's shared cache) equals
    the update's log-probs (train, grad; under gradient checkpointing a full forward without the cache; gpt2's
    config has dropout 0.1, which load_model turns off)."""
    tiny_model_dir = request.getfixturevalue(arch)
    model, tok = load(tiny_model_dir)
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    seen, real = [], lopti.policy_loss

    def spy(logprobs, old, advantages, mask, **kw):
        seen.append(((logprobs.detach() - old)[mask.bool()].abs().max(), logprobs.requires_grad))
        return real(logprobs, old, advantages, mask, **kw)

    monkeypatch.setattr(lopti, "policy_loss", spy)
    cfg = tiny_config(tiny_model_dir, tmp_path, mini_batch_size=8, micro_batch_size=2, beta=0.0,
                      reward=fixed([0.0, 1.0, 2.0, 3.0] * 2),
                      **lopti.METHODS["grpo"])  # one optimiser step: every micro-batch sees the old weights
    m = tiny_step(cfg, model, tok)
    assert len(seen) == 4 and all(grad for _, grad in seen) and max(d for d, _ in seen) <= 1e-5, seen
    assert m["all/clip_high"] == 0 and m["all/clip_low"] == 0


def test_pi_old_and_the_update_compute_only_rows_with_an_advantage(tiny_model_dir, tmp_path, monkeypatch):
    """beta = 0: a group whose rewards are equal has no gradient; neither pi_old, the update nor Figure 3's
    measurement runs its rows (they still count in the update's token denominator)."""
    model, tok = load(tiny_model_dir)
    passes, forwards = [], {True: 0, False: 0}
    real_batched, real_completion = lopti.batched_logprobs, lopti.completion_logprobs
    monkeypatch.setattr(lopti, "batched_logprobs",
                        lambda *a, rows, **k: passes.append(rows.tolist()) or real_batched(*a, rows=rows, **k))

    def completion_spy(model, micro, temperature):
        forwards[torch.is_grad_enabled()] += len(micro["mask"])
        return real_completion(model, micro, temperature)

    monkeypatch.setattr(lopti, "completion_logprobs", completion_spy)
    cfg = tiny_config(tiny_model_dir, tmp_path, prompts_per_step=3, mini_batch_size=12, micro_batch_size=2,
                      beta=0.0, reward=fixed([-3.0] * 4 + [0.0, 1.0, 2.0, 3.0] + [-3.0] * 4), **lopti.METHODS["grpo"])
    m = tiny_step(cfg, model, tok)
    needed = [False] * 4 + [True] * 4 + [False] * 4
    assert passes == [needed, needed]  # pi_old, then Figure 3's measurement after the update
    assert forwards == {False: 8, True: 4}  # 4 rows each: pi_old, measurement; the update
    assert m["zero_std_groups"] == pytest.approx(2 / 3) and m["all/token_share"] == 1.0


def test_a_step_where_no_row_has_an_advantage_computes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    """beta = 0 and every group's rewards equal (a collapsed policy): no forward at all, no optimiser step (AdamW's
    momentum and decay would move the weights), no error."""
    model, tok = load(tiny_model_dir)
    calls, real = [], lopti.completion_logprobs
    monkeypatch.setattr(lopti, "completion_logprobs", lambda *a: calls.append(1) or real(*a))
    cfg = tiny_config(tiny_model_dir, tmp_path, beta=0.0, weight_decay=0.1, reward=fixed([-1.0] * 8))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = lopti.make_optimizer(model, cfg)
    torch.manual_seed(0)
    m = lopti.train_step(cfg, model, None, tok, optimizer, lopti.kk_generate(2, 3, seed=0), CPU)
    assert calls == [] and not optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert m["zero_std_groups"] == 1.0 and m["low/token_share"] == m["high/token_share"] == 0.0
    assert m["update/pos_tokens"] == m["update/neg_tokens"] == [0, 0, 0, 0]


STAGE_KEYS = ("loss", "grad_norm", "token_share", "clip_high", "clip_low", "kl_ref")
STEP_KEYS = {"step", "learning_rate", "reward", "accuracy", "format_error", "zero_std_groups",
             "completion_length", "truncated", "time/rollout", "time/logprobs", "time/measure",
             *(f"update/{k}" for k in lopti.UPDATE_KEYS)}


def strict_json_lines(path):
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"{path.name}: non-finite {c}"))
            for line in path.read_text().splitlines()]


@pytest.mark.parametrize("method", ["grpo", "ar", "lopti"])
def test_train_two_steps(tiny_model_dir, tmp_path, monkeypatch, kk_reward_read_afresh, method):
    """Two RL steps (beta > 0: a reference model) with --reward kk (its kk_reward varied): the weights change and stay
    finite; config.json holds every setting, the method and the version; metrics.jsonl has a line per step with the
    stages' and Figure 3's keys, then the final evaluation; samples.jsonl the first group's completions;
    checkpoint-2/ alone remains and loads as a model."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    out = tmp_path / "run"
    cfg = tiny_config(tiny_model_dir, out, beta=0.01, **lopti.METHODS[method])
    ckpt = lopti.train(cfg)
    assert ckpt == out / "checkpoint-2" and lopti.checkpoints(out) == [ckpt]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "config.json", "metrics.jsonl", "samples.jsonl"]
    before, after = (lopti.load_model(str(p), CPU).state_dict() for p in (tiny_model_dir, ckpt))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(v.isfinite().all() for v in after.values())
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"] == 2
    assert lopti.load_tokenizer(str(ckpt)).chat_template
    saved = json.loads((out / "config.json").read_text())
    assert saved == {**dataclasses.asdict(cfg), "method": method, "version": lopti.lopti_version()}
    assert saved["reward"] == "kk" and "lopti.py sha256" in saved["version"]

    lines = strict_json_lines(out / "metrics.jsonl")
    assert [x["step"] for x in lines] == [0, 1, 2, 2] and "reward" not in lines[0] and "reward" not in lines[3]
    assert "eval/gain" not in lines[0] and lines[3]["eval/gain"] == lines[3]["eval/accuracy"] - lines[0]["eval/accuracy"]
    stages = ("low", "high") if cfg.lopti else ("all",)
    for line in lines[1:3]:
        expected = STEP_KEYS | {f"{s}/{k}" for s in stages for k in STAGE_KEYS} | {f"time/update_{s}" for s in stages}
        assert set(line) == expected, set(line) ^ expected
        assert sum(line[f"{s}/token_share"] for s in stages) == pytest.approx(1.0)
        assert all(len(line[f"update/{k}"]) == 4 for k in lopti.UPDATE_KEYS)
        for sign, a, b in (("pos", "rose", "fell"), ("neg", "fell", "rose")):
            assert all(x + y <= n for x, y, n in zip(line[f"update/{sign}_{a}"], line[f"update/{sign}_{b}"],
                                                      line[f"update/{sign}_tokens"]))
        moved = sum(line["update/pos_rose"]) + sum(line["update/pos_fell"])
        assert moved > 0  # the update moved some A > 0 token
        assert all(math.isfinite(v) for k, v in line.items() if isinstance(v, float))
    samples = strict_json_lines(out / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 2] and all(len(s["samples"]) == cfg.num_generations for s in samples)
    assert all(x["completion"].startswith(lopti.THINK_PREFIX) and isinstance(x["reward"], float)
               for s in samples for x in s["samples"])


@pytest.mark.parametrize("content", ["model", "a file"])
def test_train_refuses_a_non_empty_folder_that_is_not_a_run(tiny_model_dir, tmp_path, content):
    """A non-empty --output_dir (here a model's folder, or any file) is never written into without --resume."""
    out = tmp_path / "out"
    if content == "model":
        shutil.copytree(tiny_model_dir, out)
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="not empty"):
        lopti.train(tiny_config(tiny_model_dir, out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_step_rows_are_a_pure_function_of_seed_and_step():
    """Per-epoch shuffles of (seed, epoch), sliced by step: --resume replays a step's rows whatever ran before."""
    cfg = Config(prompts_per_step=3, num_generations=4, mini_batch_size=12, seed=7)
    rows = [lopti.step_rows(5, cfg, s) for s in range(5)]  # 15 draws = 3 epochs of 5 rows
    flat = [i for r in rows for i in r]
    for epoch in range(3):
        assert sorted(flat[5 * epoch:5 * epoch + 5]) == list(range(5))
    assert flat[:5] != flat[5:10] or flat[5:10] != flat[10:15]  # reshuffled per epoch
    torch.manual_seed(123)  # the global generator plays no part; neither do other fields, nor the order of calls
    other = dataclasses.replace(cfg, num_generations=2, mini_batch_size=6, micro_batch_size=2, learning_rate=1.0)
    assert [lopti.step_rows(5, other, s) for s in reversed(range(5))][::-1] == rows
    assert [lopti.step_rows(5, dataclasses.replace(cfg, seed=8), s) for s in range(5)] != rows


def hand_rows(solutions: list[list[bool]]) -> datasets.Dataset:
    """K&K rows with these solutions (quizzes are placeholders: the reward is monkeypatched)."""
    rows = []
    for i, sol in enumerate(solutions):
        names = list(lopti.KK_NAMES[:len(sol)])
        text, text_format = lopti._kk_solution_texts(names, sol)
        rows.append({"quiz": f"puzzle {i}", "names": names, "solution": sol, "solution_text": text,
                     "solution_text_format": text_format, "statements": "()", "num_people": len(sol)})
    return datasets.Dataset.from_list(rows)


def test_evaluate_accuracy_per_number_of_people_and_the_constant_answers(tiny_model_dir, monkeypatch,
                                                                         kk_reward_read_afresh):
    """Accuracy and mean reward per size, and the best constant answer's accuracy: per size, the most frequent
    solution (3 people: 2 of 3 share one; 4 people: 1 of 2) -> (2 + 1) / 5. The default --reward kk scores with
    kk_reward; a --reward function replaces it."""
    monkeypatch.setattr(lopti, "kk_reward", lambda text, sol: 3.0 if sol.count("\n") == 3 else -0.5)  # 4 people
    model, tok = load(tiny_model_dir)
    T, F = True, False
    rows = hand_rows([[T, F, T], [F, F, F], [T, F, T], [T, T, T, T], [F, T, F, T]])
    out = lopti.evaluate(model, tok, rows, Config(model="unused", max_completion_length=3, eval_batch_size=2), CPU)
    puzzles = hashlib.sha256("\n".join(rows["quiz"]).encode()).hexdigest()[:12]
    assert out == {"eval/accuracy": 0.4, "eval/constant_accuracy": 0.6, "eval/correct": "00011",
                   "eval/puzzles": puzzles, "eval/accuracy_3ppl": 0.0, "eval/reward_3ppl": -0.5, "eval/accuracy_4ppl": 1.0,
                   "eval/reward_4ppl": 3.0}
    everything_right = Config(model="unused", max_completion_length=3, eval_batch_size=2,
                              reward=lambda texts, solutions: [3.0] * len(texts))
    out = lopti.evaluate(model, tok, rows, everything_right, CPU)
    assert out["eval/accuracy"] == 1.0 and out["eval/correct"] == "11111" and out["eval/reward_3ppl"] == 3.0


# --- the supervised warm-up (Config.warmup_steps): the solver's case analysis as the target


def demonstration_logprob(model, tok, cfg, rows) -> float:
    """Mean log-prob per token of kk_case_analysis + EOS after each puzzle's prompt, at temperature 1."""
    total, count = 0.0, 0
    for i in range(len(rows)):
        row = {k: rows[k][i] for k in rows.column_names}
        p = tok(lopti.kk_prompt(tok, row["quiz"]), add_special_tokens=False).input_ids
        t = tok(lopti.kk_case_analysis(row) + tok.eos_token, add_special_tokens=False).input_ids
        ids = torch.tensor([p + t])
        with torch.no_grad():
            lp = lopti.sequence_logprobs(model, ids, torch.ones_like(ids), len(t), 1.0)
        total, count = total + float(lp.sum()), count + len(t)
    return total / count


def test_warm_up_raises_the_demonstrations_log_prob_and_trains_on_them_only(tiny_model_dir, tmp_path, monkeypatch):
    """Cross-entropy on the target tokens of its own puzzles (warmup_puzzles: not RL's, and none of the evaluation's
    statements): their demonstrations get likelier, one forward per step."""
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", warmup_steps=3, warmup_learning_rate=3e-3, num_people="2-3")
    model, tok = load(tiny_model_dir)
    train, evals = lopti.load_task_data(cfg)
    rows = lopti.warmup_puzzles(cfg, evals)  # warm_up's own puzzles
    assert len(rows) == 6 and not set(rows["quiz"]) & (set(train["quiz"]) | set(evals["quiz"]))
    assert not set(rows["statements"]) & set(evals["statements"])
    before = demonstration_logprob(model, tok, cfg, rows)
    calls = []
    real = lopti.sequence_logprobs
    monkeypatch.setattr(lopti, "sequence_logprobs", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    lopti.warm_up(cfg, model, tok, torch.device("cpu"), rows)
    monkeypatch.setattr(lopti, "sequence_logprobs", real)
    assert len(calls) == 3  # one forward per step: prompts_per_step puzzles each
    assert demonstration_logprob(model, tok, cfg, rows) > before + 0.5


def test_warm_up_is_adamw_whatever_the_rl_optimizer(tiny_model_dir, tmp_path):
    """The warm-up is supervised learning: with --optimizer sgd it gives the very weights it gives with adamw, and
    they moved (plain SGD at the warm-up's learning rate would barely move them)."""
    weights = {}
    for optimizer in ("adamw", "sgd"):
        cfg = tiny_config(tiny_model_dir, tmp_path / "run", warmup_steps=2, warmup_learning_rate=3e-3,
                          num_people="2", optimizer=optimizer)
        model, tok = load(tiny_model_dir)
        torch.manual_seed(0)
        lopti.warm_up(cfg, model, tok, CPU, lopti.kk_generate(4, 2, seed=1))
        weights[optimizer] = model.state_dict()
    start = load(tiny_model_dir)[0].state_dict()
    assert all(torch.equal(weights["adamw"][k], weights["sgd"][k]) for k in start)
    assert any(not torch.equal(weights["sgd"][k], start[k]) for k in start)


def test_train_evaluates_step_0_after_the_warm_up_and_before_any_rl_step(tiny_model_dir, tmp_path, monkeypatch):
    """The order of a run: warm-up, evaluation (step 0), RL steps, the final evaluation on the same puzzles; the
    final record carries RL's paired gain over step 0."""
    calls, real_step, real_evaluate = [], lopti.train_step, lopti.evaluate
    monkeypatch.setattr(lopti, "warm_up", lambda *a, **k: calls.append("warm_up"))
    monkeypatch.setattr(lopti, "train_step", lambda *a, **k: calls.append("step") or real_step(*a, **k))

    def evaluate(model, tokenizer, rows, *args, **kwargs):
        calls.append(("evaluate", tuple(rows["quiz"])))
        return real_evaluate(model, tokenizer, rows, *args, **kwargs)

    monkeypatch.setattr(lopti, "evaluate", evaluate)
    out = tmp_path / "run"
    lopti.train(tiny_config(tiny_model_dir, out, warmup_steps=1, steps=2, reward=fixed([1.0, 0, 0, 0, 0, 1, 0, 0])))
    assert [c if isinstance(c, str) else c[0] for c in calls] == ["warm_up", "evaluate", "step", "step", "evaluate"]
    assert calls[1] == calls[4]  # the same puzzles
    first, last = [r for r in lopti.read_jsonl(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert first["step"] == 0 and last["step"] == 2
    assert last["eval/gain"] == pytest.approx(last["eval/accuracy"] - first["eval/accuracy"])
    assert {"eval/gained", "eval/lost", "eval/gain_p"} <= set(last) and "eval/gain" not in first


def test_train_warms_up_only_at_the_start_of_a_run(tiny_model_dir, tmp_path, monkeypatch, kk_reward_read_afresh):
    """A resumed run starts from its checkpoint: no second warm-up."""
    monkeypatch.setattr(lopti, "kk_rewards", fixed([1.0, 0, 0, 0, 0, 1, 0, 0]))
    warmed = []
    monkeypatch.setattr(lopti, "warm_up", lambda *a, **k: warmed.append(True))
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", warmup_steps=2, steps=1)
    lopti.train(cfg)
    lopti.train(dataclasses.replace(cfg, steps=2), resume=True)
    assert warmed == [True]


def test_load_policy_checkpoints_and_keeps_the_reference_cold_and_never_warms_up(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """train and diagnose share load_policy: gradient checkpointing on when asked (diagnose --preset colab/gpu needs
    it too), a frozen reference that is cfg.model, and no warm-up (train's Run and diagnose warm up after it, when
    needs_warm_up: not from a run's checkpoint)."""
    warmed = []
    monkeypatch.setattr(lopti, "warm_up", lambda cfg, model, *a, **k: warmed.append(model))
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", warmup_steps=1, beta=0.01, gradient_checkpointing=True)
    model, tok, ref = lopti.load_policy(cfg, torch.device("cpu"))
    assert model.is_activation_checkpointing and warmed == [] and ref is not model
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert lopti.needs_warm_up(cfg, cfg.model) and not lopti.needs_warm_up(dataclasses.replace(cfg, warmup_steps=0),
                                                                            cfg.model)
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.pt").write_bytes(b"")
    assert not lopti.needs_warm_up(cfg, str(tmp_path / "checkpoint-3"))


@pytest.mark.parametrize("arch", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_the_plain_lm_logprobs_equal_the_chunked_prefix_shared_ones(arch, request):
    """lm_logprobs (the first read's: the model's own logits, shifted by one, at temperature T) gives the values and
    gradients of completion_logprobs (chunked, a group's prompt run once), left padding and a shared prompt
    included."""
    model, tok = load(request.getfixturevalue(arch))
    model.train()
    completions = torch.randint(3, len(tok), (4, 5), generator=torch.Generator().manual_seed(0))
    prompts = [p for p in ("Who is a knight?", "A very special island. Zoey said") for _ in range(2)]
    input_ids, attention_mask = prompt_batch(tok, prompts, completions)
    mask = torch.ones_like(completions, dtype=torch.bool)
    weights = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    results = []
    for logprob_fn in (lambda: lopti.lm_logprobs(model, input_ids, attention_mask, 5, 0.7),
                       lambda: lopti.completion_logprobs(model, {"input_ids": input_ids, "mask": mask,
                                                                 "attention_mask": attention_mask}, 0.7)):
        model.zero_grad()
        logprobs = logprob_fn()
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for plain, chunked in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(plain, chunked, atol=1e-5, rtol=1e-4)
    # the shift matters: the logits at the last position would score nothing of the completion
    shifted = lopti.token_logprobs(model(input_ids=input_ids).logits[:, -5:], completions, 0.7)
    assert not torch.allclose(shifted.detach(), results[0][0], atol=1e-3)
