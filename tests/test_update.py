"""update_policy, Algorithm 1: AR before the split, low pass then high pass from the updated weights, the
same pi_old in both passes, one optimiser step per mini-batch, micro-batching that changes nothing."""
import dataclasses
import json
import math

import pytest
import torch

import lopti
from lopti import (Config, bin_gradients, bin_masks, group_advantages, lopti_masks, measure_bins, policy_loss,
                   reweight_advantages, token_logprobs, update_policy)

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
    loss, _ = policy_loss(lp, batch["old_logprobs"], adv * stage, batch["mask"], kl_mask=stage, num_tokens=n)
    loss.backward()
    return w.grad


BASE = Config(alpha=0.0, lopti=False, beta=0.0, max_grad_norm=1e9, mini_batch_size=B, micro_batch_size=B)


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_lopti_is_two_sequential_passes_with_the_same_pi_old(order):
    weight, batch = _problem()
    cfg = dataclasses.replace(BASE, alpha=0.3, lopti=True, eta=0.5, lopti_order=order)
    got, stats, n_steps = _run(cfg, weight, batch)
    # by hand: AR first, split once from pi_old, then w1 = w0 - lr g_first(w0), w2 = w1 - lr g_second(w1)
    adv = reweight_advantages(batch["advantages"], batch["old_logprobs"], 0.3)
    low, high = lopti_masks(batch["old_logprobs"], batch["mask"], 0.5)
    first, second = (low, high) if order == "low_first" else (high, low)
    n = int(batch["mask"].sum())
    w1 = weight - 0.5 * _grad(weight, batch, adv, first, n)
    w2 = w1 - 0.5 * _grad(w1, batch, adv, second, n)
    torch.testing.assert_close(got, w2)
    assert n_steps == 2
    assert stats["low/token_share"] + stats["high/token_share"] == pytest.approx(1.0)
    # the second pass's first log-ratio already sees the first pass's drift
    assert stats[("high" if order == "low_first" else "low") + "/kl_old"] != 0.0


def test_grpo_is_one_pass_and_alpha_zero_changes_nothing():
    weight, batch = _problem(1)
    got, stats, n_steps = _run(BASE, weight, batch)
    n = int(batch["mask"].sum())
    adv = batch["advantages"].unsqueeze(1).float()
    torch.testing.assert_close(got, weight - 0.5 * _grad(weight, batch, adv, batch["mask"], n))
    assert n_steps == 1 and set(k.split("/")[0] for k in stats if "/" in k) == {"all", "time"}
    assert stats["ar_weight"] == 1.0


def test_lopti_and_ar_change_the_update():
    weight, batch = _problem(2)
    results = [_run(dataclasses.replace(BASE, alpha=a, lopti=lo), weight, batch)[0]
               for a, lo in [(0.0, False), (0.3, False), (0.0, True), (0.3, True)]]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.allclose(results[i], results[j])


def test_micro_batching_does_not_change_the_update_and_mini_batches_are_optimizer_steps():
    weight, batch = _problem(3)
    cfg = dataclasses.replace(BASE, alpha=0.3, lopti=True, mini_batch_size=3, micro_batch_size=3)
    ref, _, n_ref = _run(cfg, weight, batch, optim=torch.optim.AdamW)
    got, _, n_got = _run(dataclasses.replace(cfg, micro_batch_size=1), weight, batch, optim=torch.optim.AdamW)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    # one step per (pass, mini-batch) that holds tokens of that pass
    low, high = lopti_masks(batch["old_logprobs"], batch["mask"], cfg.eta)
    expected = sum(bool(m[r : r + 3].any()) for m in (low, high) for r in range(0, B, 3))
    assert 2 <= expected and n_ref == n_got == expected
    _, _, n_epochs = _run(dataclasses.replace(cfg, num_iterations=2), weight, batch)
    assert n_epochs == 2 * expected


def test_gradient_clipping_is_applied_per_optimizer_step():
    weight, batch = _problem(4)
    unclipped, stats, _ = _run(BASE, weight, batch)
    clipped, _, _ = _run(dataclasses.replace(BASE, max_grad_norm=1e-3), weight, batch)
    step = (clipped - weight).norm().item()
    assert step == pytest.approx(0.5 * 1e-3, rel=1e-4) and stats["all/grad_norm"] > 1e-3
    assert (unclipped - weight).norm().item() > step


def test_an_empty_lopti_stage_takes_no_optimizer_step():
    # eta tiny: no token is "low", so Lopti must be exactly one GRPO pass. A step on the empty stage's zero
    # gradient would still move AdamW's weights (weight decay) and shift its bias correction.
    weight, batch = _problem(5)
    grpo, _, n_grpo = _run(BASE, weight, batch, optim=torch.optim.AdamW, weight_decay=0.1)
    lopti, stats, n_lopti = _run(dataclasses.replace(BASE, lopti=True, eta=1e-9), weight, batch,
                                 optim=torch.optim.AdamW, weight_decay=0.1)
    torch.testing.assert_close(lopti, grpo, atol=0, rtol=0)
    assert n_grpo == n_lopti == 1
    assert stats["low/token_share"] == 0.0 and stats["low/clip_high"] == 0.0 and stats["low/grad_norm"] == 0.0


def test_a_non_finite_gradient_skips_the_step_instead_of_corrupting_the_weights():
    weight, batch = _problem(6)
    w = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW([w], lr=0.5)
    nan_fn = lambda mb: token_logprobs(mb["x"] @ w, mb["tokens"]) * float("nan")  # noqa: E731
    stats = update_policy(BASE, nan_fn, opt, batch)
    assert torch.equal(w.detach(), weight) and stats["all/skipped_steps"] == 1 and not opt.state
    assert w.grad is None


@pytest.mark.parametrize("alpha,lopti_on", [(0.0, False), (0.3, True)])
def test_zero_advantage_rows_are_skipped_and_the_step_is_unchanged(alpha, lopti_on):
    """beta = 0: a row whose advantage is 0 (a group whose rewards are all equal) has no gradient, so it is not
    computed, and the parameters after the step equal those of the full computation over every row (same
    token-mean denominator). Its pi_old is never read: a NaN placeholder changes nothing."""
    weight, batch = _problem(7)
    # group 1's rewards are all equal; in group 2, reward 1 is the mean: advantage exactly 0 as well
    batch["advantages"] = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 1.0]), group_size=3)
    skipped = batch["advantages"] == 0
    assert skipped.tolist() == [True, True, True, False, False, True]
    seen = []
    w = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW([w], lr=0.5, weight_decay=0.1)
    cfg = dataclasses.replace(BASE, alpha=alpha, lopti=lopti_on, micro_batch_size=2)
    placeholder = {**batch, "old_logprobs": torch.where(skipped[:, None], float("nan"), batch["old_logprobs"])}
    stats = update_policy(cfg, lambda mb: seen.append(len(mb["x"])) or token_logprobs(mb["x"] @ w, mb["tokens"]),
                          opt, placeholder)
    stages = lopti_masks(batch["old_logprobs"], batch["mask"], 0.5) if lopti_on else (batch["mask"],)
    assert sum(seen) == sum(int((m.any(1) & ~skipped).sum()) for m in stages)  # only rows with an advantage
    # by hand, over all 6 rows: AR, the split, and AdamW steps on the full batch's gradients
    w_ref = torch.nn.Parameter(weight.clone())
    opt_ref = torch.optim.AdamW([w_ref], lr=0.5, weight_decay=0.1)
    adv = reweight_advantages(batch["advantages"], batch["old_logprobs"], alpha)
    for stage in stages:
        opt_ref.zero_grad()
        lp = token_logprobs(batch["x"] @ w_ref, batch["tokens"])
        policy_loss(lp, batch["old_logprobs"], adv * stage, batch["mask"], kl_mask=stage)[0].backward()
        opt_ref.step()
    torch.testing.assert_close(w.detach(), w_ref.detach(), atol=1e-12, rtol=0)
    for name, stage in zip(("low", "high") if lopti_on else ("all",), stages):
        assert stats[f"{name}/rows"] == pytest.approx(float((stage.any(1) & ~skipped).float().mean()))


def test_a_batch_without_any_gradient_takes_no_step():
    weight, batch = _problem(8)
    batch["advantages"] = torch.zeros(B)
    w, stats, n_steps = _run(dataclasses.replace(BASE, alpha=0.3, lopti=True), weight, batch, optim=torch.optim.AdamW,
                             weight_decay=0.1)
    assert torch.equal(w, weight) and n_steps == 0
    assert stats["ar_weight"] is None and stats["low/token_share"] is None and stats["low/rows"] == 0.0
    # with a KL penalty every row has a gradient, advantage or not
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.1
    _, _, n_kl = _run(dataclasses.replace(BASE, beta=0.1), weight, batch)
    assert n_kl == 1


# --- update_counts (Figure 3 of an update) and measure_bins (Figure 1 for any policy: the toy's and diagnose's)


class _Linear(torch.nn.Module):
    """The policy of _problem as a module: log pi = log_softmax(x @ weight)[token]."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def logprobs(self, mb):
        return token_logprobs(mb["x"] @ self.weight, mb["tokens"])


def test_the_four_bins_gradients_add_up_to_the_all_token_gradient():
    weight, batch = _problem()
    model = _Linear(weight)
    bins = bin_masks(batch["old_logprobs"], batch["mask"])
    assert (bins.sum(0) == batch["mask"]).all() and all(b.any() for b in bins)  # a partition; no bin empty
    cfg = Config(micro_batch_size=4)
    grads = bin_gradients(cfg, model, model.logprobs, batch)
    whole = _grad(weight, batch, batch["advantages"][:, None].expand(B, T), batch["mask"], int(batch["mask"].sum()))
    torch.testing.assert_close(sum(g[0] for g in grads), whole, rtol=1e-12, atol=1e-12)
    for g, b in zip(grads, bins):  # and each bin's is the loss's gradient with only that bin's advantages
        torch.testing.assert_close(g[0], _grad(weight, batch, batch["advantages"][:, None] * b, batch["mask"],
                                               int(batch["mask"].sum())), rtol=1e-12, atol=1e-12)


def test_one_token_gradient_norm_by_hand():
    """One token of pi = 0.8 over two choices, A = 1.5: d(-A pi/pi_old)/dz = -A (e_0 - pi), whose norm is
    A (1 - pi) sqrt(2) = 0.3 sqrt(2); it falls in bin (.75, 1] and the other bins' norms are 0."""
    z = torch.tensor([[math.log(4.0), 0.0]], dtype=torch.float64)  # pi = (0.8, 0.2)
    model = _Linear(z)
    batch = {"x": torch.ones(1, 1, 1, dtype=torch.float64), "tokens": torch.tensor([[0]]),
             "mask": torch.tensor([[True]]), "advantages": torch.tensor([1.5], dtype=torch.float64)}
    batch["old_logprobs"] = model.logprobs(batch).detach()
    r = measure_bins(Config(micro_batch_size=1), model, model.logprobs, batch)
    assert r["grad_norm"]["bins"] == pytest.approx([0, 0, 0, 0.3 * math.sqrt(2)], rel=1e-6)  # policy_loss is fp32
    assert r["grad_norm"]["all"] == pytest.approx(0.3 * math.sqrt(2), rel=1e-6)
    assert r["token_share"] == {"all": [0, 0, 0, 1], "nonzero_advantage": [0, 0, 0, 1]}
    assert r["prob_change"]["all"]["mean"][:3] == [None] * 3  # an empty bin is None, never NaN


def test_update_counts_of_a_known_case_by_hand():
    """One shared context, pi = (0.1, 0.8, 0.1); responses: token 0 (A = 1), token 1 (A = 1), token 2 (A = -0.1),
    and a padded one. GRPO's ascent direction on the logits is g = sum A (e_o - pi) = (0.81, -0.52, -0.29), and
    d log pi_j = g_j - pi . g = (+1.174, -0.156, +0.074): the rare token 0 rises and the likely token 1 falls (Figure
    3's mechanism, a low-probability token pushing a likely one down), and token 2 (A < 0) rises too. So after one
    plain SGD step of GRPO: A > 0 tokens [1, 0, 0, 1] per bin, of which rose [1, 0, 0, 0]; A < 0 tokens [1, 0, 0, 0],
    of which fell [0, 0, 0, 0]; the padded row is in no count."""
    z = torch.log(torch.tensor([[0.1, 0.8, 0.1]], dtype=torch.float64))
    model = _Linear(z)
    batch = {"x": torch.ones(4, 1, 1, dtype=torch.float64), "tokens": torch.tensor([[0], [1], [2], [1]]),
             "mask": torch.tensor([[True], [True], [True], [False]]),
             "advantages": torch.tensor([1.0, 1.0, -0.1, 0.0], dtype=torch.float64)}
    batch["old_logprobs"] = model.logprobs(batch).detach()
    cfg = Config(micro_batch_size=2, mini_batch_size=4, alpha=0.0, lopti=False, beta=0.0, optimizer="sgd",
                 learning_rate=1e-2)
    update_policy(cfg, model.logprobs, lopti.make_optimizer(model, cfg), batch)
    with torch.no_grad():
        c = lopti.update_counts(batch["old_logprobs"], model.logprobs(batch), batch["advantages"], batch["mask"])
    assert (c["update/pos_tokens"], c["update/pos_rose"]) == ([1, 0, 0, 1], [1, 0, 0, 0])
    assert (c["update/neg_tokens"], c["update/neg_fell"]) == ([1, 0, 0, 0], [0, 0, 0, 0])
    assert c["update/pos_change"][0] > 0 > c["update/pos_change"][3] and c["update/pos_change"][1] is None
    assert c["update/neg_change"][0] > 0 and c["update/neg_change"][1:] == [None] * 3
    json.dumps(c, allow_nan=False)


def test_pooling_sums_counts_and_weights_changes_by_tokens():
    a = {"update/pos_tokens": [2, 0, 1, 3], "update/pos_rose": [1, 0, 1, 1], "update/neg_tokens": [1, 1, 0, 0],
         "update/neg_fell": [1, 0, 0, 0], "update/pos_change": [0.1, None, -0.2, 0.3],
         "update/neg_change": [-0.5, 0.25, None, None]}
    b = {**a, "update/pos_tokens": [1, 0, 0, 1], "update/pos_rose": [1, 0, 0, 0],
         "update/pos_change": [0.4, None, None, -0.3]}
    p = lopti.pool_update_counts([a, b, {"step": 3}])  # a line without the measurement adds nothing
    assert p["pos_tokens"] == [3, 0, 1, 4] and p["pos_rose"] == [2, 0, 1, 1] and p["neg_tokens"] == [2, 2, 0, 0]
    assert p["pos_change"] == pytest.approx([0.2, None, -0.2, 0.15]) and p["neg_change"][:2] == [-0.5, 0.25]
    assert lopti.fig3_ratio(p) == [2 / 3, None, 1.0, 0.25]


def test_measure_bins_takes_pi_old_from_its_own_forward():
    """diagnose measures in fp32 while a bf16 run's old_logprobs come from the autocast pass: measure_bins recomputes
    pi_old itself, so the ratio is 1 and no token loses its gradient to a clip bound through rounding alone."""
    weight, batch = _problem()
    model = _Linear(weight)
    exact = measure_bins(Config(micro_batch_size=4), model, model.logprobs, batch)
    skewed = {**batch, "old_logprobs": batch["old_logprobs"] + 0.3 * torch.rand(B, T, dtype=batch["x"].dtype)}
    assert measure_bins(Config(micro_batch_size=4), model, model.logprobs, skewed) == exact


def test_a_batch_without_advantages_has_nothing_to_measure():
    """Every group scored alike (a policy collapsed onto one answer): no gradient, no step, no A > 0 token."""
    weight, batch = _problem()
    model = _Linear(weight)
    r = measure_bins(Config(micro_batch_size=4), model, model.logprobs, {**batch, "advantages": torch.zeros(B)})
    assert r["grad_norm"] == {"bins": [0.0] * 4, "all": 0.0} and r["token_share"]["nonzero_advantage"] == [None] * 4
    assert r["prob_change"]["all"]["mean"] == [0.0] * 4 and torch.equal(model.weight.detach(), weight)


def test_sgd_is_one_plain_step_and_measure_bins_probe_is_update_policys_sgd_step():
    """--optimizer sgd: p - lr * g exactly (no momentum, no decay), the official code's analysis optimiser;
    update_policy with it steps along GRPO's gradient, and so does measure_bins' first probe (bin_gradients' sum)."""
    weight, batch = _problem()
    cfg = Config(micro_batch_size=4, mini_batch_size=B, learning_rate=1e-3, optimizer="sgd", max_grad_norm=1e30,
                 beta=0.0, alpha=0.0, lopti=False, weight_decay=0.5)  # (a decay that SGD must not apply)
    model = _Linear(weight)
    model.weight.grad = torch.randn_like(weight)
    lopti.make_optimizer(model, cfg).step()
    assert torch.equal(model.weight.detach(), torch.add(weight, model.weight.grad, alpha=-1e-3))  # p + (-lr) g
    model = _Linear(weight)
    grad = sum(g[0] for g in bin_gradients(cfg, model, model.logprobs, batch))
    update_policy(cfg, model.logprobs, lopti.make_optimizer(model, cfg), batch)
    torch.testing.assert_close(model.weight.detach(), weight - 1e-3 * grad, rtol=1e-12, atol=1e-15)
    stepped, real, probe = [], torch._foreach_add_, _Linear(weight)
    with pytest.MonkeyPatch.context() as mp:  # the weights of measure_bins' first probe (GRPO, all tokens)
        mp.setattr(torch, "_foreach_add_", lambda ps, g, alpha: (real(ps, g, alpha=alpha), stepped.append(
            ps[0].detach().clone())))
        measure_bins(cfg, probe, probe.logprobs, batch)
    torch.testing.assert_close(stepped[0], model.weight.detach(), rtol=1e-12, atol=1e-15)
