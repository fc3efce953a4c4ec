"""Figure 3 as the official code records it: every training step's own update counted per pi_old bin (update_counts
in train_step), pooled over runs by summing their counts."""
import copy

import pytest
import torch
from conftest import tiny_config, varied_reward

import lopti

CPU = torch.device("cpu")
BATCHED_LOGPROBS = lopti.batched_logprobs


def _varied_rewards(completions, solutions):
    """kk_rewards' stand-in: rewards with variance inside groups (a random tiny model always scores -3)."""
    return torch.tensor([varied_reward(c, s) for c, s in zip(completions, solutions)])


def _step(model_dir, monkeypatch, optimizer=None, **overrides):
    """One train_step of the tiny model on 2 prompts x 4 samples; returns its metrics and each batched_logprobs call's
    fp32 flag."""
    cfg = tiny_config(model_dir, "unused", beta=0.0, temperature=1.0, mini_batch_size=8,
                      **{"reward": _varied_rewards, **overrides})
    model, tok = lopti.load_model(str(model_dir), CPU), lopti.load_tokenizer(str(model_dir))
    calls = []

    def spy(model, batch, cfg, device, rows=None, fp32=False):
        calls.append(fp32)
        return BATCHED_LOGPROBS(model, batch, cfg, device, rows, fp32)

    monkeypatch.setattr(lopti, "batched_logprobs", spy)
    torch.manual_seed(0)
    opt = optimizer(model) if optimizer else lopti.make_optimizer(model, cfg)
    return lopti.train_step(cfg, model, None, tok, opt, lopti.kk_generate(2, 3, seed=0), CPU), calls


@pytest.mark.parametrize("bf16", [False, True])
def test_a_token_whose_weights_did_not_move_compares_equal(tiny_model_dir, monkeypatch, bf16):
    """Before and after come from one pass (pi_old's, or under bf16 an fp32 pass): after an update that moves no
    weight (SGD at lr 0) no token rose or fell, in fp32 and under bf16 autocast; an AdamW step moves them."""
    monkeypatch.setattr(lopti, "has_bf16", lambda device: bf16)  # (CPU autocast takes bf16 too)
    m, _ = _step(tiny_model_dir, monkeypatch, lambda model: torch.optim.SGD(model.parameters(), lr=0.0))
    assert sum(m["update/pos_tokens"]) > 0 and sum(m["update/neg_tokens"]) > 0
    for k in ("pos_rose", "pos_fell", "neg_fell", "neg_rose"):
        assert m[f"update/{k}"] == [0] * 4, k
    m, _ = _step(tiny_model_dir, monkeypatch)
    assert sum(m["update/pos_rose"]) > 0 and sum(m["update/neg_fell"]) > 0


def test_under_bf16_the_measurement_is_fp32_and_agrees_with_an_independent_one(tiny_model_dir, monkeypatch):
    """An update at lr 1e-6 moves a log-prob far less than bf16's rounding: under bf16, before and after are fp32
    passes, and the counts equal an fp32 recomputation of the whole batch with the weights from before and after
    the step (binned by training's pi_old); a bf16 measurement would count otherwise."""
    monkeypatch.setattr(lopti, "has_bf16", lambda device: True)  # the bf16 path, on CPU
    cfg = tiny_config(tiny_model_dir, "unused", beta=0.0, temperature=1.0, mini_batch_size=8, learning_rate=1e-6,
                      reward=_varied_rewards)
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    start, seen = copy.deepcopy(model), {}

    def spy(model, batch, cfg, device, rows=None, fp32=False):
        seen.setdefault("batch", batch)
        seen.setdefault("fp32", []).append(fp32)
        return BATCHED_LOGPROBS(model, batch, cfg, device, rows, fp32)

    monkeypatch.setattr(lopti, "batched_logprobs", spy)
    torch.manual_seed(0)
    m = lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), lopti.kk_generate(2, 3, seed=0), CPU)
    assert seen["fp32"] == [False, True, True]  # pi_old under autocast; the measurement's before and after in fp32
    b = seen["batch"]
    with torch.no_grad():
        old, new = (lopti.completion_logprobs(x, b, cfg.temperature) for x in (start, model))  # no autocast: fp32
    expected = lopti.update_counts(old, new, b["advantages"], b["mask"], b["old_logprobs"])
    assert sum(m["update/pos_rose"]) > 0 and {k: m[k] for k in expected} == expected
    bf16 = lopti.update_counts(b["old_logprobs"], BATCHED_LOGPROBS(model, b, cfg, CPU), b["advantages"], b["mask"],
                               b["old_logprobs"])  # what a bf16 measurement would log
    assert bf16 != expected


def test_switched_off_it_runs_no_forward(tiny_model_dir, monkeypatch):
    """measure_update true costs one no-grad fp32 pass after the update (without bf16, before is pi_old's); false
    none, and no update/ key."""
    on, calls_on = _step(tiny_model_dir, monkeypatch)
    off, calls_off = _step(tiny_model_dir, monkeypatch, measure_update=False)
    assert calls_on == [False, True] and calls_off == [False]  # pi_old's pass, then (on) the measurement's
    assert not [k for k in off if k.startswith("update/")] and "time/measure" not in off
    assert sum(on["update/pos_tokens"]) > 0 and "time/measure" in on
    assert (on["low/loss"], on["high/loss"]) == (off["low/loss"], off["high/loss"])  # the same step either way


def test_a_step_with_nothing_to_measure_counts_zeros(tiny_model_dir, monkeypatch):
    """Every group scored alike: no advantage, all counts 0 and every share None (never NaN)."""
    cfg = tiny_config(tiny_model_dir, "unused", beta=0.0, mini_batch_size=8,
                      reward=lambda c, s: torch.full((len(c),), -1.0))
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    m = lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), lopti.kk_generate(2, 3, seed=0), CPU)
    assert all(m[f"update/{k}"] == [0] * 4 for k in lopti.UPDATE_KEYS)
    assert lopti.figure3_shares(m) == {k: [None] * 4 for k in ("rose", "rose_of_moved", "ties")}


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir, tmp_path_factory):
    """Two tiny GRPO runs of 2 steps (seeds 0 and 1) with the varied reward."""
    out = tmp_path_factory.mktemp("fig3")
    for seed in (0, 1):
        lopti.train(tiny_config(tiny_model_dir, out / f"s{seed}", seed=seed, steps=2, mini_batch_size=8, alpha=0.0,
                                lopti=False, beta=0.0, save_every=0, reward=_varied_rewards))
    return out / "s0", out / "s1"


def test_runs_pool_by_summing_their_counts(two_runs):
    """Two runs' logged steps pool by summing their counts (pool_counts); the shares by hand: rose / A > 0 tokens,
    rose / (rose + fell), unmoved / tokens."""
    lines = [r for run in two_runs for r in lopti.read_jsonl(run / "metrics.jsonl") if "update/pos_tokens" in r]
    assert len(lines) == 4
    n, rose, fell = ([sum(r[f"update/pos_{k}"][b] for r in lines) for b in range(4)] for k in ("tokens", "rose",
                                                                                                  "fell"))
    assert sum(n) > 0 and sum(rose) > 0
    pooled = lopti.pool_counts(lines)
    assert pooled["update/pos_tokens"] == n and pooled["update/pos_rose"] == rose
    shares = lopti.figure3_shares(pooled)
    assert shares["rose"] == [r / k if k else None for r, k in zip(rose, n)]
    assert shares["rose_of_moved"] == [r / (r + f) if r + f else None for r, f in zip(rose, fell)]
    assert shares["ties"] == [(k - r - f) / k if k else None for k, r, f in zip(n, rose, fell)]
