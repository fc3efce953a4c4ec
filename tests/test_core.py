"""The paper's math as pure functions: golden values by hand, invariants, parity, the Sec. 4 bound."""
import math

import pytest
import torch

from lopti import group_advantages, lopti_masks, policy_loss, reweight_advantages, token_logprobs

# ---------------------------------------------------------------- group advantage


def test_group_advantages_golden():
    # group 1: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5; group 2: all equal -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    adv = group_advantages(rewards, group_size=4)
    s = 0.5 + 1e-6
    expected = torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    assert (adv[4:] == 0).all()


def test_group_advantages_paper_example_and_edge_cases():
    adv = group_advantages(torch.tensor([1.0] + [0.0] * 7), group_size=8)  # by hand: +2.47 / -0.35
    assert round(adv[0].item(), 2) == 2.47 and round(adv[1].item(), 2) == -0.35
    # all-equal rewards that are not exactly representable: still exactly 0, never 0/eps noise
    assert (group_advantages(torch.full((6,), 0.1), group_size=3) == 0).all()
    torch.testing.assert_close(group_advantages(torch.tensor([2.0, -1.0]), 1), torch.tensor([2.0, -1.0]) / (1 + 1e-6))
    rewards = torch.tensor([1.0, 2.0])
    group_advantages(rewards, 2)
    assert rewards.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("rewards,g", [
    (torch.ones(6), 4), (torch.ones(6), 0), (torch.ones(6), 2.0), (torch.ones(2, 3), 3),
    (torch.tensor([1.0, float("nan")]), 2), (torch.tensor([1.0, float("inf")]), 2)])
def test_group_advantages_bad_input(rewards, g):
    with pytest.raises(ValueError):
        group_advantages(rewards, g)

# ---------------------------------------------------------------- log-probs


def test_token_logprobs_golden():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # softmax = [1/4, 3/4]
    tokens = torch.tensor([[1]])
    assert token_logprobs(logits, tokens).item() == pytest.approx(math.log(0.75), abs=1e-6)
    # at T = 2 the logits halve: pi = [1, sqrt 3] / (1 + sqrt 3)
    p = math.sqrt(3) / (1 + math.sqrt(3))
    assert token_logprobs(logits, tokens, temperature=2.0).item() == pytest.approx(math.log(p), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_fp64_reference(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 97, generator=g)).to(dtype)
    tokens = torch.randint(0, 97, (3, 5), generator=g)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    for chunk in (2**24, 97 * 4, 1):  # one chunk, several, one row per chunk
        out = token_logprobs(logits, tokens, temperature, chunk_elems=chunk)
        assert out.dtype == torch.float32 and out.shape == (3, 5)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_token_logprobs_gradient_through_chunks():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 4, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (2, 4), generator=g)
    a = base.clone().float().requires_grad_()
    token_logprobs(a, tokens, 0.7, chunk_elems=22).sum().backward()
    b = base.clone().requires_grad_()
    torch.log_softmax(b / 0.7, -1).gather(-1, tokens[..., None]).sum().backward()
    torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-6, rtol=0)


def test_token_logprobs_bad_input():
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    for t in (0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=t)

# ---------------------------------------------------------------- Advantage Reweighting (Eq. 4)


def test_reweight_golden():
    adv = torch.tensor([2.0, -1.0])
    old = torch.log(torch.tensor([[0.5, 1.0], [0.0, 0.25]]))
    out = reweight_advantages(adv, old, alpha=0.3)
    # (0.3 pi + 0.7) A: pi = 0.5 -> 0.85 * 2; pi = 1 -> 2; pi = 0 -> 0.7 * -1; pi = 0.25 -> 0.775 * -1
    torch.testing.assert_close(out, torch.tensor([[1.7, 2.0], [-0.7, -0.775]]))


def test_reweight_alpha_extremes_and_no_grad():
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(4, 6, generator=g)
    old = torch.log(torch.rand(4, 6, generator=g)).requires_grad_()
    assert torch.equal(reweight_advantages(adv, old, 0.0), adv)  # alpha = 0 is GRPO exactly
    assert torch.equal(reweight_advantages(adv[:, 0], old, 0.0), adv[:, :1].expand(4, 6))
    torch.testing.assert_close(reweight_advantages(adv, old, 1.0), old.detach().exp() * adv)
    assert not reweight_advantages(adv, old, 0.5).requires_grad  # the weight is a constant


@pytest.mark.parametrize("alpha", [-0.1, 1.1, float("nan")])
def test_reweight_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        reweight_advantages(torch.ones(2), torch.zeros(2, 3), alpha)


def test_reweight_bad_shape():
    with pytest.raises(ValueError):
        reweight_advantages(torch.ones(3), torch.zeros(2, 3), 0.3)

# ---------------------------------------------------------------- Lopti masks (Algorithm 1)


def test_lopti_masks_golden():
    old = torch.log(torch.tensor([[0.9, 0.2, 0.6, 1.0], [0.5, 0.49, 0.01, 0.3]]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    low, high = lopti_masks(old, mask, eta=0.5)
    assert low.tolist() == [[False, True, False, False], [False, True, True, True]]
    assert high.tolist() == [[True, False, True, False], [True, False, False, False]]
    assert torch.equal(low | high, mask.bool()) and not (low & high).any()


@pytest.mark.parametrize("eta", [0.0, -0.5, 1.5, float("nan")])
def test_lopti_masks_bad_eta(eta):
    with pytest.raises(ValueError, match="eta"):
        lopti_masks(torch.zeros(1, 2), torch.ones(1, 2), eta)


def test_lopti_masks_bad_shape():
    with pytest.raises(ValueError, match="shape"):
        lopti_masks(torch.zeros(1, 2), torch.ones(1, 3), 0.5)

# ---------------------------------------------------------------- loss


def _golden_batch():
    ratio = torch.tensor([[1.0, 1.5, 0.5, 7.0], [1.0, 0.5, 20.0, 1.1]])
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3], [0.6, 0.7, 0.01, 0.4]]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return old + ratio.log(), old, torch.tensor([1.0, -1.0]), mask


def test_policy_loss_golden():
    logp, old, adv, mask = _golden_batch()
    loss, stats = policy_loss(logp, old, adv, mask)
    # A = +1: r = 1 -> -1; r = 1.5 -> max(-1.5, -1.24) = -1.24; r = 0.5 -> max(-0.5, -0.8) = -0.5; pad skipped
    # A = -1: r = 1 -> 1; r = 0.5 -> max(0.5, 0.8) = 0.8; r = 20 -> 20, dual clip -> 10; r = 1.1 -> 1.1
    assert loss.item() == pytest.approx((-1 - 1.24 - 0.5 + 1 + 0.8 + 10 + 1.1) / 7, abs=1e-6)
    assert stats["clip_high"] == pytest.approx(1 / 7)
    assert stats["clip_low"] == pytest.approx(1 / 7)
    assert stats["clip_dual"] == pytest.approx(1 / 7)
    expected_kl_old = -sum(math.log(r) for r in [1.0, 1.5, 0.5, 1.0, 0.5, 20.0, 1.1]) / 7
    assert stats["kl_old"] == pytest.approx(expected_kl_old, abs=1e-6)
    # shared denominator: the same sum over 14 tokens
    loss14, _ = policy_loss(logp, old, adv, mask, num_tokens=14)
    assert loss14.item() == pytest.approx(loss.item() * 7 / 14, abs=1e-6)


def test_policy_loss_kl_golden():
    logp, old, adv, mask = _golden_batch()
    ref = logp.clone()
    ref[0, 0] += math.log(2.0)  # k3 = 2 - ln 2 - 1
    ref[1, 3] += 10.0  # log-ratio clamped to 5 -> e^5 - 6 = 142.4, KL clamped to 10
    ref[0, 3] += 3.0  # padding: ignored
    base, _ = policy_loss(logp, old, adv, mask)
    loss, stats = policy_loss(logp, old, adv, mask, ref_logprobs=ref, beta=0.1)
    kl_sum = (1 - math.log(2.0)) + 10.0
    assert loss.item() == pytest.approx(base.item() + 0.1 * kl_sum / 7, abs=1e-6)
    assert stats["kl_ref"] == pytest.approx(kl_sum / 7, abs=1e-6)
    # kl_mask restricts the penalty to its tokens, the denominator stays
    only = torch.zeros_like(mask)
    only[0, 0] = True
    loss_m, _ = policy_loss(logp, old, adv, mask, ref_logprobs=ref, beta=0.1, kl_mask=only)
    assert loss_m.item() == pytest.approx(base.item() + 0.1 * (1 - math.log(2.0)) / 7, abs=1e-6)


def test_policy_loss_padding_garbage_gives_no_nan():
    logp, old, adv, mask = _golden_batch()
    logp = logp.clone().requires_grad_()
    old = old.clone()
    old[0, 3] = -float("inf")
    loss, _ = policy_loss(logp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 3] == 0


@pytest.mark.parametrize("gap", [50.0, 90.0, 1e4])
def test_policy_loss_gradient_is_finite_wherever_the_loss_is(gap):
    """exp(log pi - log pi_old) overflows past ~88.7; the clamped log-ratio (upstream verl's [-20, 20]) keeps the
    gradient finite, for positive and negative advantages."""
    logp = torch.tensor([[gap, -gap, 0.0, gap]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4, dtype=torch.bool)
    loss, _ = policy_loss(logp, torch.zeros(1, 4), adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_policy_loss_does_not_mutate_inputs():
    logp, old, adv, mask = _golden_batch()
    copies = [t.clone() for t in (logp, old, adv, mask)]
    policy_loss(logp, old, adv, mask, ref_logprobs=logp, beta=0.1)
    assert all(torch.equal(a, b) for a, b in zip(copies, (logp, old, adv, mask)))


@pytest.mark.parametrize("kwargs", [
    dict(epsilon=-0.1), dict(epsilon_high=-1.0), dict(dual_clip=1.0), dict(dual_clip=0.5),
    dict(num_tokens=-1), dict(beta=0.1), dict(beta=-0.1, ref_logprobs=torch.zeros(2, 4)),
    dict(epsilon=float("nan")), dict(epsilon_high=float("inf")), dict(dual_clip=float("inf")),
    dict(beta=float("inf"), ref_logprobs=torch.zeros(2, 4)), dict(num_tokens=float("nan"))])
def test_policy_loss_bad_input(kwargs):
    logp, old, adv, mask = _golden_batch()
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, **kwargs)


def test_policy_loss_bad_shapes():
    logp, old, adv, mask = _golden_batch()
    with pytest.raises(ValueError, match="shape"):
        policy_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, torch.ones(3), mask)

# ---------------------------------------------------------------- invariants on gradients


def _setup(seed=0, B=6, T=7, V=13):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, V, generator=g, dtype=torch.float64)
    x = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    with torch.no_grad():
        old = token_logprobs(x @ weight, tokens)
        old = old + 0.05 * torch.randn(B, T, generator=g)  # a slightly stale pi_old, so that some ratios clip
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    adv = group_advantages(torch.randint(0, 3, (B,), generator=g).double(), group_size=3)
    return weight, x, tokens, mask, old.float(), ref.float(), adv


def _grad(weight, x, tokens, loss_fn):
    w = weight.clone().requires_grad_()
    loss, _ = loss_fn(token_logprobs(x @ w, tokens))
    loss.backward()
    return w.grad


def test_lopti_stages_sum_to_grpo_gradient():
    weight, x, tokens, mask, old, ref, adv = _setup()
    adv = reweight_advantages(adv, old, 0.3)
    low, high = lopti_masks(old, mask, eta=0.5)
    assert low.any() and high.any()
    n = int(mask.sum())
    kw = dict(ref_logprobs=ref, beta=0.01, num_tokens=n)
    full = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv, mask, **kw))
    g_low = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv * low, mask, kl_mask=low, **kw))
    g_high = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv * high, mask, kl_mask=high, **kw))
    torch.testing.assert_close(g_low + g_high, full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(g_low, full, atol=1e-3)  # each stage alone is a different update


def test_micro_batches_with_shared_token_count_give_the_same_gradient():
    weight, x, tokens, mask, old, ref, adv = _setup(seed=3)
    n = int(mask.sum())
    full = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv, mask, ref_logprobs=ref, beta=0.01))
    w = weight.clone().requires_grad_()
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        lp = token_logprobs(x[rows] @ w, tokens[rows])
        loss, _ = policy_loss(lp, old[rows], adv[rows], mask[rows], ref_logprobs=ref[rows], beta=0.01, num_tokens=n)
        loss.backward()
    torch.testing.assert_close(w.grad, full, atol=1e-6, rtol=1e-6)


def test_alpha_zero_is_grpo_exactly():
    weight, x, tokens, mask, old, ref, adv = _setup(seed=4)
    g0 = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv, mask))
    g1 = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, reweight_advantages(adv, old, 0.0), mask))
    assert torch.equal(g0, g1)

# ---------------------------------------------------------------- Sec. 4: the softmax gradient bound


def _grad_norm_and_gap(z, j):
    z = z.clone().requires_grad_()
    torch.log_softmax(z, -1)[j].backward()
    p = torch.softmax(z.detach(), -1)
    one_minus = p.sum() - p[j]  # sum over k != j: `1 - p[j]` loses precision near 1
    return z.grad.norm().item(), one_minus.item()


@pytest.mark.parametrize("N", [2, 3, 10, 151])
@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0, 20.0])
def test_softmax_gradient_bound_on_random_logits(N, scale):
    g = torch.Generator().manual_seed(N * 100 + int(scale * 10))
    lo_k, hi_k = math.sqrt(N / (N - 1)), math.sqrt(2.0)
    for _ in range(50):
        z = scale * torch.randn(N, generator=g, dtype=torch.float64)
        j = int(torch.randint(0, N, (1,), generator=g))
        norm, gap = _grad_norm_and_gap(z, j)
        # autograd's j-th coordinate is computed as 1 - p_j: allow its absolute rounding error (~1e-16)
        assert lo_k * gap * (1 - 1e-9) - 1e-14 <= norm <= hi_k * gap * (1 + 1e-9) + 1e-14


@pytest.mark.parametrize("N", [2, 5, 100])
@pytest.mark.parametrize("zj", [-3.0, 0.0, 4.0])
def test_softmax_gradient_bound_tight_cases(N, zj):
    # lower bound: the rest of the mass uniform over the other N - 1 tokens
    z = torch.zeros(N, dtype=torch.float64)
    z[0] = zj
    norm, gap = _grad_norm_and_gap(z, 0)
    assert norm == pytest.approx(math.sqrt(N / (N - 1)) * gap, rel=1e-9)
    # upper bound: all the rest on one rival token
    z = torch.full((N,), -1e4, dtype=torch.float64)
    z[0], z[1] = zj, 0.0
    norm, gap = _grad_norm_and_gap(z, 0)
    assert norm == pytest.approx(math.sqrt(2.0) * gap, rel=1e-9)
