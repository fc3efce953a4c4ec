"""update_policy (Algorithm 1: AR before the split, then one GRPO pass or Lopti's two passes with the same pi_old)
and the Figure 1 and 3 measurements (update_counts, pool_counts, figure3_shares, paired_counts, paired_deltas,
method_config, measure_bins), on a linear softmax policy small enough to compute by hand."""
import copy
import dataclasses
import json
import math

import pytest
import torch

import lopti
from lopti import (Config, bin_masks, figure3_shares, group_advantages, lopti_masks, measure_bins, method_config,
                   paired_counts, paired_deltas, policy_loss, pool_counts, reweight_advantages, token_logprobs,
                   update_counts, update_policy)

V, B, T = 11, 6, 5


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, V, generator=g, dtype=torch.float64)
    x = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    with torch.no_grad():
        old = token_logprobs(x @ weight, tokens)
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 0.0, 0.0, 1.0]), group_size=3)
    batch = {"x": x, "tokens": tokens, "mask": mask, "old_logprobs": old, "advantages": adv}
    return weight, batch


def _run(cfg, weight, batch, optim=torch.optim.SGD, **optim_kw):
    w = torch.nn.Parameter(weight.clone())
    opt = optim([w], lr=0.5, **optim_kw)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    stats = update_policy(cfg, lambda mb: token_logprobs(mb["x"] @ w, mb["tokens"]), opt, batch)
    return w.detach(), stats, len(steps)


def _grad(w, batch, adv, stage, n):
    w = w.clone().requires_grad_()
    lp = token_logprobs(batch["x"] @ w, batch["tokens"])
    loss, _ = policy_loss(lp, batch["old_logprobs"], adv * stage, stage, num_tokens=n)
    loss.backward()
    return w.grad


BASE = Config(alpha=0.0, lopti=False, beta=0.0, max_grad_norm=1e9, mini_batch_size=B, micro_batch_size=B,
              prompts_per_step=2, num_generations=3)


class _Linear(torch.nn.Module):
    """The policy of _problem as a module: log pi = log_softmax(x @ weight)[token]."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def logprobs(self, mb):
        return token_logprobs(mb["x"] @ self.weight, mb["tokens"])


# --- update_policy


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_lopti_is_two_sequential_passes_with_the_same_pi_old(order):
    """Algorithm 1 by hand: AR, one split from pi_old, w1 = w0 - lr g_first(w0), w2 = w1 - lr g_second(w1)."""
    weight, batch = _problem()
    cfg = dataclasses.replace(BASE, alpha=0.3, lopti=True, eta=0.5, lopti_order=order)
    got, stats, n_steps = _run(cfg, weight, batch)
    adv = reweight_advantages(batch["advantages"], batch["old_logprobs"], 0.3)
    low, high = lopti_masks(batch["old_logprobs"], batch["mask"], 0.5)
    first, second = (low, high) if order == "low_first" else (high, low)
    n = int(batch["mask"].sum())
    w1 = weight - 0.5 * _grad(weight, batch, adv, first, n)
    w2 = w1 - 0.5 * _grad(w1, batch, adv, second, n)
    torch.testing.assert_close(got, w2)
    assert n_steps == 2
    assert stats["low/token_share"] + stats["high/token_share"] == pytest.approx(1.0)


def test_grpo_is_one_pass():
    """GRPO: one step along the all-token gradient; only all/ and time/ metrics."""
    weight, batch = _problem(1)
    got, stats, n_steps = _run(BASE, weight, batch)
    n = int(batch["mask"].sum())
    adv = batch["advantages"].unsqueeze(1).float()
    torch.testing.assert_close(got, weight - 0.5 * _grad(weight, batch, adv, batch["mask"], n))
    assert n_steps == 1 and set(k.split("/")[0] for k in stats) == {"all", "time"}
    assert stats["all/token_share"] == 1.0


def test_lopti_and_ar_change_the_update():
    """GRPO, AR, Lopti and AR+Lopti are four different updates."""
    weight, batch = _problem(2)
    results = [_run(dataclasses.replace(BASE, alpha=a, lopti=lo), weight, batch)[0]
               for a, lo in [(0.0, False), (0.3, False), (0.0, True), (0.3, True)]]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.allclose(results[i], results[j])


def test_micro_batching_does_not_change_the_update_and_mini_batches_are_optimizer_steps():
    """Micro-batches accumulate to the mini-batch's gradient; one AdamW step per (pass, mini-batch, epoch)."""
    weight, batch = _problem(3)
    cfg = dataclasses.replace(BASE, alpha=0.3, lopti=True, mini_batch_size=3, micro_batch_size=3)
    ref, _, n_ref = _run(cfg, weight, batch, optim=torch.optim.AdamW)
    got, _, n_got = _run(dataclasses.replace(cfg, micro_batch_size=1), weight, batch, optim=torch.optim.AdamW)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    low, high = lopti_masks(batch["old_logprobs"], batch["mask"], cfg.eta)
    expected = sum(bool(m[r: r + 3].any()) for m in (low, high) for r in range(0, B, 3))
    assert 2 <= expected and n_ref == n_got == expected
    _, _, n_epochs = _run(dataclasses.replace(cfg, num_iterations=2), weight, batch)
    assert n_epochs == 2 * expected


def test_gradient_clipping_is_applied_per_optimizer_step():
    """max_grad_norm bounds each step: an SGD step's length is lr * max_grad_norm."""
    weight, batch = _problem(4)
    unclipped, stats, _ = _run(BASE, weight, batch)
    clipped, _, _ = _run(dataclasses.replace(BASE, max_grad_norm=1e-3), weight, batch)
    step = (clipped - weight).norm().item()
    assert step == pytest.approx(0.5 * 1e-3, rel=1e-4) and stats["all/grad_norm"] > 1e-3
    assert (unclipped - weight).norm().item() > step


def test_an_empty_lopti_stage_takes_no_optimizer_step():
    """eta tiny: no token is low, so Lopti is one GRPO pass; a step on the empty stage's zero gradient would still
    move AdamW's weights (decay) and its bias correction."""
    weight, batch = _problem(5)
    grpo, _, n_grpo = _run(BASE, weight, batch, optim=torch.optim.AdamW, weight_decay=0.1)
    lopti_w, stats, n_lopti = _run(dataclasses.replace(BASE, lopti=True, eta=1e-9), weight, batch,
                                   optim=torch.optim.AdamW, weight_decay=0.1)
    torch.testing.assert_close(lopti_w, grpo, atol=0, rtol=0)
    assert n_grpo == n_lopti == 1
    assert stats["low/token_share"] == 0.0 and stats["low/clip_high"] == 0.0 and stats["low/grad_norm"] == 0.0


def test_a_non_finite_gradient_is_applied_so_that_the_divergence_shows():
    """A NaN gradient is not skipped: the optimiser steps (AdamW state), the weights turn non-finite and the pass logs
    a non-finite gradient norm; train then refuses to save the step (test_guarantees: a diverging step)."""
    weight, batch = _problem(6)
    w = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW([w], lr=0.5)
    nan_fn = lambda mb: token_logprobs(mb["x"] @ w, mb["tokens"]) * float("nan")  # noqa: E731
    stats = update_policy(BASE, nan_fn, opt, batch)
    assert opt.state and not w.detach().isfinite().all()
    assert math.isnan(stats["all/grad_norm"]) and math.isnan(stats["all/loss"])


@pytest.mark.parametrize("alpha,lopti_on", [(0.0, False), (0.3, True)])
def test_zero_advantage_rows_are_skipped_and_the_step_is_unchanged(alpha, lopti_on):
    """beta = 0: a row with A = 0 has no gradient, so it is never computed (its pi_old never read: a NaN placeholder
    changes nothing), and the step equals the full computation over every row (same token-mean denominator)."""
    weight, batch = _problem(7)
    batch["advantages"] = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 1.0]), group_size=3)
    skipped = batch["advantages"] == 0
    assert skipped.tolist() == [True, True, True, False, False, True]
    seen = []
    w = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW([w], lr=0.5, weight_decay=0.1)
    cfg = dataclasses.replace(BASE, alpha=alpha, lopti=lopti_on, micro_batch_size=2)
    placeholder = {**batch, "old_logprobs": torch.where(skipped[:, None], float("nan"), batch["old_logprobs"])}
    update_policy(cfg, lambda mb: seen.append(len(mb["x"])) or token_logprobs(mb["x"] @ w, mb["tokens"]), opt,
                  placeholder)
    stages = lopti_masks(batch["old_logprobs"], batch["mask"], 0.5) if lopti_on else (batch["mask"],)
    assert sum(seen) == sum(int((m.any(1) & ~skipped).sum()) for m in stages)  # only rows with an advantage
    w_ref = torch.nn.Parameter(weight.clone())
    opt_ref = torch.optim.AdamW([w_ref], lr=0.5, weight_decay=0.1)
    adv = reweight_advantages(batch["advantages"], batch["old_logprobs"], alpha)
    for stage in stages:  # by hand, over all 6 rows
        opt_ref.zero_grad()
        lp = token_logprobs(batch["x"] @ w_ref, batch["tokens"])
        policy_loss(lp, batch["old_logprobs"], adv * stage, stage, num_tokens=batch["mask"].sum())[0].backward()
        opt_ref.step()
    torch.testing.assert_close(w.detach(), w_ref.detach(), atol=1e-12, rtol=0)


def test_a_batch_without_any_gradient_takes_no_step():
    """All A = 0 and beta = 0: no forward, no step (AdamW's decay would move the weights); with beta > 0 the KL
    term gives every row a gradient."""
    weight, batch = _problem(8)
    batch["advantages"] = torch.zeros(B)
    w, stats, n_steps = _run(dataclasses.replace(BASE, alpha=0.3, lopti=True), weight, batch, optim=torch.optim.AdamW,
                             weight_decay=0.1)
    assert torch.equal(w, weight) and n_steps == 0 and stats["low/token_share"] == 0.0
    assert lopti.rows_with_gradient(batch["advantages"], 0.0).tolist() == [False] * B
    assert lopti.rows_with_gradient(batch["advantages"], 0.1).tolist() == [True] * B
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.1
    _, _, n_kl = _run(dataclasses.replace(BASE, beta=0.1), weight, batch)
    assert n_kl == 1


def test_sgd_is_one_plain_step():
    """--optimizer sgd: p - lr * g exactly (no momentum, no decay); update_policy steps along GRPO's gradient."""
    weight, batch = _problem()
    cfg = dataclasses.replace(BASE, learning_rate=1e-3, optimizer="sgd", weight_decay=0.5)  # (SGD ignores decay)
    model = _Linear(weight)
    model.weight.grad = torch.randn_like(weight)
    lopti.make_optimizer(model, cfg).step()
    assert torch.equal(model.weight.detach(), torch.add(weight, model.weight.grad, alpha=-1e-3))
    model = _Linear(weight)
    update_policy(cfg, model.logprobs, lopti.make_optimizer(model, cfg), batch)
    grad = _grad(weight, batch, batch["advantages"][:, None].float(), batch["mask"], int(batch["mask"].sum()))
    torch.testing.assert_close(model.weight.detach(), weight - 1e-3 * grad, rtol=1e-12, atol=1e-15)


def test_clip_share_is_a_share_with_two_epochs():
    """clip_high is the share of tokens clipped: every A > 0 token clipped in every epoch gives the same share with
    one epoch or two."""
    weight, batch = _problem(10)
    skewed = {**batch, "old_logprobs": batch["old_logprobs"] - 1.0}  # ratio e > 1.24: every A > 0 token clipped
    cfg = dataclasses.replace(BASE, learning_rate=1e-9)
    one = _run(cfg, weight, skewed)[1]["all/clip_high"]
    two = _run(dataclasses.replace(cfg, num_iterations=2), weight, skewed)[1]["all/clip_high"]
    assert 0 < one <= 1 and two == pytest.approx(one)


# --- update_counts, pool_counts, figure3_shares (Figure 3)


def test_update_counts_golden_with_ties():
    """Per pi_old bin: A > 0 tokens that rose, fell or tied; A < 0 tokens that fell, rose or tied; padding and A = 0
    rows in no count."""
    before = torch.log(torch.tensor([[0.1, 0.3, 0.6, 0.9], [0.2, 0.8, 0.9, 0.4], [0.5, 0.5, 0.5, 0.5]]))
    after = before.clone()
    after[0, 0], after[0, 2], after[0, 3] = math.log(0.2), math.log(0.5), math.log(0.95)  # rose, fell, rose; tie
    after[1, 0], after[1, 1], after[1, 3] = math.log(0.1), math.log(0.85), math.log(0.1)  # fell, rose; tie; padding
    after[2] = 0.0  # A = 0: not counted
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    c = update_counts(before, after, torch.tensor([1.0, -0.5, 0.0]), mask)
    assert c == {"update/pos_tokens": [1, 1, 1, 1], "update/pos_rose": [1, 0, 0, 1], "update/pos_fell": [0, 0, 1, 0],
                 "update/neg_tokens": [1, 0, 0, 2], "update/neg_fell": [1, 0, 0, 0], "update/neg_rose": [0, 0, 0, 1]}
    assert set(c) == {f"update/{k}" for k in lopti.UPDATE_KEYS}
    json.dumps(c, allow_nan=False)
    # binned by old_logprobs when given (training's pi_old), not by `before`
    old = torch.log(torch.full((3, 4), 0.1))
    c = update_counts(before, after, torch.tensor([1.0, -0.5, 0.0]), mask, old)
    assert c["update/pos_tokens"] == [4, 0, 0, 0] and c["update/pos_rose"] == [2, 0, 0, 0]
    assert c["update/neg_tokens"] == [3, 0, 0, 0] and c["update/neg_rose"] == [1, 0, 0, 0]


def test_update_counts_of_one_sgd_step_shows_figure_3s_mechanism():
    """One context, pi = (0.1, 0.8, 0.1); responses token 0 (A = 1), token 1 (A = 1), token 2 (A = -0.1) and a padded
    one. GRPO's ascent direction on the logits is g = sum A (e_o - pi) = (0.81, -0.52, -0.29) and d log pi = g - pi.g
    = (+1.174, -0.156, +0.074): the rare token 0 rises, the likely A > 0 token 1 falls, token 2 (A < 0) rises."""
    z = torch.log(torch.tensor([[0.1, 0.8, 0.1]], dtype=torch.float64))
    model = _Linear(z)
    batch = {"x": torch.ones(4, 1, 1, dtype=torch.float64), "tokens": torch.tensor([[0], [1], [2], [1]]),
             "mask": torch.tensor([[True], [True], [True], [False]]),
             "advantages": torch.tensor([1.0, 1.0, -0.1, 0.0], dtype=torch.float64)}
    batch["old_logprobs"] = model.logprobs(batch).detach()
    cfg = dataclasses.replace(BASE, micro_batch_size=2, mini_batch_size=4, prompts_per_step=1, num_generations=4,
                              optimizer="sgd", learning_rate=1e-2)
    update_policy(cfg, model.logprobs, lopti.make_optimizer(model, cfg), batch)
    with torch.no_grad():
        c = update_counts(batch["old_logprobs"], model.logprobs(batch), batch["advantages"], batch["mask"])
    assert (c["update/pos_tokens"], c["update/pos_rose"], c["update/pos_fell"]) == ([1, 0, 0, 1], [1, 0, 0, 0],
                                                                                     [0, 0, 0, 1])
    assert (c["update/neg_tokens"], c["update/neg_fell"], c["update/neg_rose"]) == ([1, 0, 0, 0], [0] * 4,
                                                                                     [1, 0, 0, 0])


def test_pool_counts_sums_per_bin():
    """Steps and runs pool by summing; a metrics line without counts adds 0."""
    a = {"update/pos_tokens": [2, 0, 1, 3], "update/pos_rose": [1, 0, 1, 1], "update/pos_fell": [1, 0, 0, 1],
         "update/neg_tokens": [1, 1, 0, 0], "update/neg_fell": [1, 0, 0, 0], "update/neg_rose": [0, 1, 0, 0]}
    b = {**a, "update/pos_tokens": [1, 0, 0, 1], "update/pos_rose": [1, 0, 0, 0]}
    p = pool_counts([a, b, {"step": 3}])
    assert p == {"update/pos_tokens": [3, 0, 1, 4], "update/pos_rose": [2, 0, 1, 1], "update/pos_fell": [2, 0, 0, 2],
                 "update/neg_tokens": [2, 2, 0, 0], "update/neg_fell": [2, 0, 0, 0], "update/neg_rose": [0, 2, 0, 0]}
    assert pool_counts([]) == {f"update/{k}": [0] * 4 for k in lopti.UPDATE_KEYS}


def test_figure3_shares_golden():
    """rose = rose / A > 0 tokens; rose_of_moved = rose / (rose + fell); ties = unmoved / tokens; None when empty."""
    c = {"update/pos_tokens": [4, 0, 2, 10], "update/pos_rose": [2, 0, 1, 5], "update/pos_fell": [1, 0, 1, 0]}
    assert figure3_shares(c) == {"rose": [0.5, None, 0.5, 0.5], "rose_of_moved": [pytest.approx(2 / 3), None, 0.5, 1.0],
                                 "ties": [0.25, None, 0.0, 0.5]}
    tied = {"update/pos_tokens": [3, 0, 0, 0], "update/pos_rose": [0] * 4, "update/pos_fell": [0] * 4}
    assert figure3_shares(tied)["rose_of_moved"][0] is None and figure3_shares(tied)["ties"][0] == 1.0


# --- method_config, paired_counts, paired_deltas (Figure 3 paired)


def test_method_config():
    """Each method of METHODS from one cfg: AR keeps cfg's alpha (or the paper's 0.3 if cfg's is 0); grpo_2_epochs
    doubles the epochs (the compute-matched control); the ablation is high_first; the rest are untouched."""
    cfg = dataclasses.replace(BASE, alpha=0.1, lopti=True, lopti_order="high_first", num_iterations=3, eta=0.4)
    got = {m: method_config(cfg, m) for m in lopti.METHODS}
    assert {m: (c.alpha, c.lopti, c.lopti_order, c.num_iterations) for m, c in got.items()} == {
        "grpo": (0.0, False, "low_first", 3), "ar": (0.1, False, "low_first", 3), "lopti": (0.0, True, "low_first", 3),
        "ar_lopti": (0.1, True, "low_first", 3), "grpo_2_epochs": (0.0, False, "low_first", 6),
        "lopti_high_first": (0.0, True, "high_first", 3)}
    assert all((c.eta, c.learning_rate, c.mini_batch_size) == (0.4, cfg.learning_rate, B) for c in got.values())
    zero = dataclasses.replace(cfg, alpha=0.0)
    assert method_config(zero, "ar").alpha == method_config(zero, "ar_lopti").alpha == 0.3
    assert lopti.method_name(dataclasses.asdict(method_config(cfg, "ar_lopti"))) == "ar_lopti_3_epochs"
    one_epoch = dataclasses.replace(cfg, num_iterations=1)
    assert {m: lopti.method_name(dataclasses.asdict(method_config(one_epoch, m))) for m in lopti.METHODS} == {
        m: m for m in lopti.METHODS}  # a run's config names its method


def _paired_setup():
    """A _Linear policy after one AdamW update (a non-empty optimiser state), and a fresh batch to measure."""
    weight, batch = _problem(9)
    model = _Linear(weight)
    cfg = dataclasses.replace(BASE, alpha=0.3, lopti=True, mini_batch_size=3, micro_batch_size=3, learning_rate=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    update_policy(cfg, model.logprobs, opt, _problem(10)[1])
    with torch.no_grad():
        batch["old_logprobs"] = model.logprobs(batch)
    return cfg, model, opt, batch


def _measure(model, batch):
    with torch.no_grad():
        return model.logprobs(batch)


def test_paired_counts_restores_weights_and_optimizer_state_bit_for_bit():
    """After every method's update, the weights and AdamW's state are those from before, and the next update is
    the one that would have followed without the paired measurement."""
    cfg, model, opt, batch = _paired_setup()
    weights, state = model.weight.detach().clone(), copy.deepcopy(opt.state_dict())
    twin = _Linear(weights)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.05, weight_decay=0.1)
    twin_opt.load_state_dict(copy.deepcopy(state))
    out = paired_counts(cfg, model, opt, model.logprobs, batch, lambda: _measure(model, batch),
                        _measure(model, batch), list(lopti.METHODS))
    assert list(out) == list(lopti.METHODS)
    assert torch.equal(model.weight.detach(), weights)
    now = opt.state_dict()
    assert now["param_groups"] == state["param_groups"]
    for k, s in state["state"].items():
        assert set(now["state"][k]) == set(s) and all(torch.equal(now["state"][k][n], v) for n, v in s.items())
    update_policy(cfg, model.logprobs, opt, batch)
    update_policy(cfg, twin.logprobs, twin_opt, batch)
    assert torch.equal(model.weight.detach(), twin.weight.detach())


def test_paired_counts_equal_each_method_run_alone_from_the_same_state():
    """Each method's counts are those of its whole update (method_config) from the shared weights and state."""
    cfg, model, opt, batch = _paired_setup()
    weights, state, before = model.weight.detach().clone(), copy.deepcopy(opt.state_dict()), _measure(model, batch)
    out = paired_counts(cfg, model, opt, model.logprobs, batch, lambda: _measure(model, batch), before,
                        list(lopti.METHODS))
    moved = {}
    for m in lopti.METHODS:
        alone = _Linear(weights)
        alone_opt = torch.optim.AdamW(alone.parameters(), lr=0.05, weight_decay=0.1)
        alone_opt.load_state_dict(copy.deepcopy(state))
        update_policy(method_config(cfg, m), alone.logprobs, alone_opt, batch)
        after = _measure(alone, batch)
        assert out[m] == update_counts(before, after, batch["advantages"], batch["mask"], batch["old_logprobs"]), m
        moved[m] = alone.weight.detach()
    assert not torch.equal(moved["grpo"], moved["lopti"]) and not torch.equal(moved["grpo"], moved["grpo_2_epochs"])


def _unit(n, rose_ref, rose_m):
    return {"grpo": {"update/pos_tokens": n, "update/pos_rose": rose_ref},
            "lopti": {"update/pos_tokens": n, "update/pos_rose": rose_m}}


def test_paired_deltas_golden():
    """delta = pooled (rose_m - rose_ref) / pooled A > 0 tokens. The sign-flip test enumerates the 8 sign patterns of
    the units' differences: 3 units that agree give p = 2/8, never 'resolved'. Bins: units agree (+), disagree,
    empty, all zero."""
    units = [_unit([10, 10, 0, 5], [5, 5, 0, 1], [6, 7, 0, 1]),
             _unit([20, 10, 0, 5], [10, 5, 0, 1], [14, 4, 0, 1]),
             _unit([10, 10, 0, 5], [5, 5, 0, 1], [7, 5, 0, 1])]
    d = paired_deltas(units)
    assert list(d) == ["lopti"]
    d = d["lopti"]
    assert d["delta"] == [pytest.approx(7 / 40), pytest.approx(1 / 30), None, 0.0]
    # bin 0: differences (1, 4, 2), sum 7: only all-plus and all-minus reach |7|; bin 1: (2, -1, 0): every pattern
    # reaches |1|
    assert d["p"] == pytest.approx([2 / 8, 1.0, 1.0, 1.0])
    assert d["resolved"] == [False, False, False, False]


def test_paired_deltas_resolves_six_agreeing_units_and_not_five():
    """A sign test over n agreeing units has p = 2/2^n: 2/32 with 5 units (not resolved), 2/64 with 6."""
    unit = _unit([10, 0, 0, 0], [5, 0, 0, 0], [7, 0, 0, 0])
    assert paired_deltas([unit] * 5)["lopti"]["p"][0] == pytest.approx(2 / 32)
    assert not paired_deltas([unit] * 5)["lopti"]["resolved"][0]
    assert paired_deltas([unit] * 6)["lopti"]["p"][0] == pytest.approx(2 / 64)
    assert paired_deltas([unit] * 6)["lopti"]["resolved"][0]


def test_paired_deltas_over_many_units_never_reports_p_zero():
    """Past 12 units the sign patterns are drawn at random: the observed one counts too, so p >= 1/(resamples+1)."""
    unit = _unit([10, 0, 0, 0], [5, 0, 0, 0], [7, 0, 0, 0])
    p = paired_deltas([unit] * 20, resamples=100)["lopti"]["p"][0]
    assert p == pytest.approx(1 / 101)


# --- measure_bins (Figure 1)


def test_the_four_bins_gradients_add_up_to_the_all_token_gradient():
    """Per bin, the norm of GRPO's gradient with only that bin's advantages (at ratio 1, token-mean over the whole
    batch); 'all' is the norm of their sum, the whole batch's gradient."""
    weight, batch = _problem()
    model = _Linear(weight)
    bins = bin_masks(batch["old_logprobs"], batch["mask"])
    assert (bins.sum(0) == batch["mask"]).all() and all(b.any() for b in bins)  # a partition; no bin empty
    r = measure_bins(2, model, model.logprobs, batch)
    n, adv = int(batch["mask"].sum()), batch["advantages"][:, None].expand(B, T)
    assert r["grad_norm"]["all"] == pytest.approx(_grad(weight, batch, adv, batch["mask"], n).norm().item(), rel=1e-5)
    assert r["grad_norm"]["bins"] == pytest.approx([_grad(weight, batch, adv * b, batch["mask"], n).norm().item()
                                                    for b in bins], rel=1e-5)
    assert torch.equal(model.weight.detach(), weight)  # measuring moves nothing
    active = batch["mask"] & (batch["advantages"] != 0)[:, None]  # shares over rows with an advantage
    assert r["token_share"] == pytest.approx([float((b & active).sum() / active.sum()) for b in bins])


def test_one_token_gradient_norm_by_hand():
    """One token of pi = 0.8 over two choices, A = 1.5: d(-A pi/pi_old)/dz = -A (e_0 - pi), of norm
    A (1 - pi) sqrt(2) = 0.3 sqrt(2), in bin (.75, 1]; the other bins' norms are 0."""
    z = torch.tensor([[math.log(4.0), 0.0]], dtype=torch.float64)  # pi = (0.8, 0.2)
    model = _Linear(z)
    batch = {"x": torch.ones(1, 1, 1, dtype=torch.float64), "tokens": torch.tensor([[0]]),
             "mask": torch.tensor([[True]]), "advantages": torch.tensor([1.5], dtype=torch.float64)}
    batch["old_logprobs"] = model.logprobs(batch).detach()
    r = measure_bins(1, model, model.logprobs, batch)
    assert r["grad_norm"]["bins"] == pytest.approx([0, 0, 0, 0.3 * math.sqrt(2)], rel=1e-6)  # policy_loss is fp32
    assert r["grad_norm"]["all"] == pytest.approx(0.3 * math.sqrt(2), rel=1e-6)
    assert r["token_share"] == [0, 0, 0, 1]


def test_measure_bins_takes_pi_old_from_its_own_forward():
    """A bf16 run's old_logprobs differ from diagnose's fp32 pass: measure_bins' ratio is 1 whatever the batch's
    pi_old (here shifted by +-0.25 in log, which would clip, within each token's bin)."""
    weight, batch = _problem()
    model = _Linear(weight)
    cfg = dataclasses.replace(BASE, micro_batch_size=3)
    exact = measure_bins(cfg.micro_batch_size, model, model.logprobs, batch)
    old = batch["old_logprobs"]
    shift = 0.25 * torch.where(torch.rand(B, T, generator=torch.Generator().manual_seed(0)) < 0.5, 1.0, -1.0)
    keep = (bin_masks(old + shift, batch["mask"]) == bin_masks(old, batch["mask"])).all(0)
    skewed = {**batch, "old_logprobs": torch.where(keep, old + shift, old)}
    assert (keep & batch["mask"]).sum() >= 10
    assert measure_bins(cfg.micro_batch_size, model, model.logprobs, skewed) == exact


def test_a_batch_without_advantages_has_nothing_to_measure():
    """Every group scored alike: zero gradients (no NaN), no token shares (no row has pi_old), nothing moves."""
    weight, batch = _problem()
    model = _Linear(weight)
    r = measure_bins(3, model, model.logprobs,
                     {**batch, "advantages": torch.zeros(B)})
    assert r["grad_norm"] == {"bins": [0.0] * 4, "all": 0.0} and r["token_share"] == [None] * 4
    assert torch.equal(model.weight.detach(), weight)
    json.dumps(r, allow_nan=False)


# --- copied out: the update's functions run in a module of their own


COPIED = ("broadcast_to_tokens", "reweight_advantages", "lopti_masks", "policy_loss", "rows_with_gradient",
          "lopti_stages", "update_policy", "update_pass", "divide")


def test_the_update_copied_with_what_the_readme_names_runs_alone():
    """The README's "Use one function" names what update_policy needs: its functions' source, `from __future__
    import annotations`, collections, math, time, torch (Tensor, Callable) and a config object with the update's
    fields. Copied into a fresh module, it gives the very weights lopti's does."""
    import inspect
    import types

    source = "\n\n".join(inspect.getsource(getattr(lopti, name)) for name in COPIED)
    header = ("from __future__ import annotations\nimport collections, math, time\nimport torch\n"
              "from torch import Tensor\nfrom typing import Callable\n")
    module = types.ModuleType("copied")
    exec(compile(header + source, "copied", "exec"), module.__dict__)
    assert "import lopti" not in source and "lopti.update" not in source  # (a NameError would show it too)
    fields = ("alpha", "lopti", "eta", "lopti_order", "epsilon", "epsilon_high", "dual_clip", "beta",
              "num_iterations", "mini_batch_size", "micro_batch_size", "max_grad_norm")
    cfg = dataclasses.replace(BASE, alpha=0.3, lopti=True, beta=0.0)
    plain = types.SimpleNamespace(**{f: getattr(cfg, f) for f in fields})
    weight, batch = _problem(3)
    weights = []
    for update in (lopti.update_policy, module.update_policy):
        w = torch.nn.Parameter(weight.clone())
        opt = torch.optim.AdamW([w], lr=0.1)
        update(plain, lambda mb: token_logprobs(mb["x"] @ w, mb["tokens"]), opt, batch)
        weights.append(w.detach())
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weight)
