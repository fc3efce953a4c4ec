"""The paper's maths as pure functions (lopti.py "Core maths"): golden values by hand, invariants, parity with fp64
references, and the softmax gradient bound of Sec. 4 (Prop. 4.2)."""
import math

import pytest
import torch

import lopti
from lopti import (group_advantages, hidden_logprobs, lopti_masks, policy_loss, reweight_advantages,
                   token_logprobs)

# ---------------------------------------------------------------- group advantage


def test_group_advantages_golden():
    """GRPO's A = (r - mean) / (unbiased std + eps) per group; equal rewards give exactly 0."""
    # group 1: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5; group 2: all equal -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    adv = group_advantages(rewards, group_size=4)
    s = 0.5 + 1e-6
    expected = torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    assert (adv[4:] == 0).all()


def test_group_advantages_paper_example_and_edge_cases():
    """G = 8 with one success (+2.47 / -0.35); no 0/eps noise; a group of one; the input is not mutated."""
    adv = group_advantages(torch.tensor([1.0] + [0.0] * 7), group_size=8)  # by hand: +2.47 / -0.35
    assert round(adv[0].item(), 2) == 2.47 and round(adv[1].item(), 2) == -0.35
    # all-equal rewards that are not exactly representable: still exactly 0, never 0/eps noise
    assert (group_advantages(torch.full((6,), 0.1), group_size=3) == 0).all()
    torch.testing.assert_close(group_advantages(torch.tensor([2.0, -1.0]), 1), torch.tensor([2.0, -1.0]) / (1 + 1e-6))
    rewards = torch.tensor([1.0, 2.0])
    group_advantages(rewards, 2)
    assert rewards.tolist() == [1.0, 2.0]

# ---------------------------------------------------------------- log-probs


def test_token_logprobs_golden():
    """log softmax(z / T)[o] by hand, at T = 1 and T = 2."""
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # softmax = [1/4, 3/4]
    tokens = torch.tensor([[1]])
    assert token_logprobs(logits, tokens).item() == pytest.approx(math.log(0.75), abs=1e-6)
    # at T = 2 the logits halve: pi = [1, sqrt 3] / (1 + sqrt 3)
    p = math.sqrt(3) / (1 + math.sqrt(3))
    assert token_logprobs(logits, tokens, temperature=2.0).item() == pytest.approx(math.log(p), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_fp64_reference(dtype, temperature):
    """fp32 output equal to an fp64 log_softmax for fp32/bf16/fp16 logits."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 97, generator=g)).to(dtype)
    tokens = torch.randint(0, 97, (3, 5), generator=g)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    out = token_logprobs(logits, tokens, temperature)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_token_logprobs_gradient_is_log_softmaxs():
    """The gradient through the max shift and the fp64 sum is log_softmax's gradient."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 4, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (2, 4), generator=g)
    a = base.clone().float().requires_grad_()
    token_logprobs(a, tokens, 0.7).sum().backward()
    b = base.clone().requires_grad_()
    torch.log_softmax(b / 0.7, -1).gather(-1, tokens[..., None]).sum().backward()
    torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_elems", [2**24, 2 * 23, 1])  # one chunk, several, one row per chunk
def test_hidden_logprobs_in_chunks_equals_the_full_logits(chunk_elems):
    """hidden_logprobs: chunked hidden states through the head (recomputed under autograd) give the full logits'
    values and gradients."""
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(6, 23, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(23, 6, generator=g))
    hidden = torch.randn(3, 4, 6, generator=g, requires_grad=True)
    tokens = torch.randint(0, 23, (3, 4), generator=g)
    hidden_logprobs(hidden, head, tokens, 0.7, chunk_elems=chunk_elems).square().sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    full = token_logprobs(head(hidden), tokens, 0.7)
    full.square().sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(hidden_logprobs(hidden, head, tokens, 0.7, chunk_elems=chunk_elems), full)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], head.weight.grad, rtol=1e-5, atol=1e-5)  # (fp32 sums in another order)


def test_token_logprobs_resolves_tiny_changes_of_tokens_near_pi_1():
    """A token with pi = 1 - 5e-6 (logit 25 over 50k logits ~ N(0, 2^2)); all logits move by ~1e-4 noise, which
    changes log pi by ~1e-10. fp32 log_softmax rounds 1 + rest in steps of 6e-8 and ties every row (Figure 3 would
    count no rise and no fall); token_logprobs sums in fp64 and gets the sign of an fp64 reference in every row."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 50_000
    z = 2 * torch.randn(rows, 1, vocab, generator=g)
    z[..., 0] = 25.0
    z_new = z + 1e-4 * torch.randn(rows, 1, vocab, generator=g)
    tokens = torch.zeros(rows, 1, dtype=torch.long)
    ref = lambda x: torch.log_softmax(x.double(), -1)[..., 0]  # noqa: E731
    want = (ref(z_new) - ref(z)).sign()
    assert (want != 0).all() and (ref(z) > -1e-5).all()
    got = (token_logprobs(z_new, tokens) - token_logprobs(z, tokens)).sign()
    assert (got == want).float().mean() >= 0.95, (got == want).float().mean()
    fp32 = torch.log_softmax(z_new, -1)[..., 0] - torch.log_softmax(z, -1)[..., 0]
    assert (fp32 == 0).float().mean() >= 0.5  # the failure this guards against is real

# ---------------------------------------------------------------- Advantage Reweighting (Eq. 4)


def test_reweight_golden():
    """Eq. 4: A <- (alpha pi_old + 1 - alpha) A, by hand."""
    adv = torch.tensor([2.0, -1.0])
    old = torch.log(torch.tensor([[0.5, 1.0], [0.0, 0.25]]))
    out = reweight_advantages(adv, old, alpha=0.3)
    # (0.3 pi + 0.7) A: pi = 0.5 -> 0.85 * 2; pi = 1 -> 2; pi = 0 -> 0.7 * -1; pi = 0.25 -> 0.775 * -1
    torch.testing.assert_close(out, torch.tensor([[1.7, 2.0], [-0.7, -0.775]]))


def test_reweight_alpha_extremes_and_no_grad():
    """alpha = 0 is GRPO exactly, alpha = 1 is pi_old * A, and the weight carries no gradient."""
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(4, 6, generator=g)
    old = torch.log(torch.rand(4, 6, generator=g)).requires_grad_()
    assert torch.equal(reweight_advantages(adv, old, 0.0), adv)  # alpha = 0 is GRPO exactly
    assert torch.equal(reweight_advantages(adv[:, 0], old, 0.0), adv[:, :1].expand(4, 6))
    torch.testing.assert_close(reweight_advantages(adv, old, 1.0), old.detach().exp() * adv)
    assert not reweight_advantages(adv, old, 0.5).requires_grad  # the weight is a constant

# ---------------------------------------------------------------- Lopti masks (Algorithm 1)


def test_lopti_masks_golden():
    """Algorithm 1's split: low = pi_old < eta, high = the rest, a partition of the mask."""
    old = torch.log(torch.tensor([[0.9, 0.2, 0.6, 1.0], [0.5, 0.49, 0.01, 0.3]]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    low, high = lopti_masks(old, mask, eta=0.5)
    assert low.tolist() == [[False, True, False, False], [False, True, True, True]]
    assert high.tolist() == [[True, False, True, False], [True, False, False, False]]
    assert torch.equal(low | high, mask.bool()) and not (low & high).any()



# ---------------------------------------------------------------- loss


def _golden_batch():
    ratio = torch.tensor([[1.0, 1.5, 0.5, 7.0], [1.0, 0.5, 20.0, 1.1]])
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3], [0.6, 0.7, 0.01, 0.4]]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return old + ratio.log(), old, torch.tensor([1.0, -1.0]), mask


def test_policy_loss_golden():
    """The clipped surrogate with asymmetric and dual clip, token-mean, by hand; and its clip stats."""
    logp, old, adv, mask = _golden_batch()
    loss, stats = policy_loss(logp, old, adv, mask)
    # A = +1: r = 1 -> -1; r = 1.5 -> max(-1.5, -1.24) = -1.24; r = 0.5 -> max(-0.5, -0.8) = -0.5; pad skipped
    # A = -1: r = 1 -> 1; r = 0.5 -> max(0.5, 0.8) = 0.8; r = 20 -> 20, dual clip -> 10; r = 1.1 -> 1.1
    assert loss.item() == pytest.approx((-1 - 1.24 - 0.5 + 1 + 0.8 + 10 + 1.1) / 7, abs=1e-6)
    assert (stats["clip_high"], stats["clip_low"], stats["tokens"]) == (1, 1, 7)  # counts: they add up
    assert stats["kl_ref"] == 0.0  # no reference model
    # shared denominator: the same sum over 14 tokens
    loss14, _ = policy_loss(logp, old, adv, mask, num_tokens=14)
    assert loss14.item() == pytest.approx(loss.item() * 7 / 14, abs=1e-6)


def test_policy_loss_kl_golden():
    """k3 KL with the official clamps, over the mask, with the loss's denominator."""
    logp, old, adv, mask = _golden_batch()
    ref = logp.clone()
    ref[0, 0] += math.log(2.0)  # k3 = 2 - ln 2 - 1
    ref[1, 3] += 10.0  # log-ratio clamped to 5 -> e^5 - 6 = 142.4, KL clamped to 10
    ref[0, 3] += 3.0  # padding: ignored
    base, _ = policy_loss(logp, old, adv, mask)
    loss, stats = policy_loss(logp, old, adv, mask, ref_logprobs=ref, beta=0.1)
    kl_sum = (1 - math.log(2.0)) + 10.0
    assert loss.item() == pytest.approx(base.item() + 0.1 * kl_sum / 7, abs=1e-6)
    assert stats["kl_ref"] == pytest.approx(kl_sum, abs=1e-5) and stats["tokens"] == 7
    # a Lopti stage as the mask restricts both terms to its tokens; the denominator stays the mini-batch's
    only = torch.zeros_like(mask)
    only[0, 0] = True
    base_m, _ = policy_loss(logp, old, adv[:, None] * only, only, num_tokens=7)
    loss_m, stats_m = policy_loss(logp, old, adv[:, None] * only, only, ref_logprobs=ref, beta=0.1, num_tokens=7)
    assert loss_m.item() == pytest.approx(base_m.item() + 0.1 * (1 - math.log(2.0)) / 7, abs=1e-6)
    assert stats_m["tokens"] == 1 and stats_m["kl_ref"] == pytest.approx(1 - math.log(2.0), abs=1e-6)


def test_policy_loss_padding_garbage_gives_no_nan():
    """-inf in a padded pi_old gives a finite loss and a zero gradient there."""
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
    """A pure function: its inputs are unchanged."""
    logp, old, adv, mask = _golden_batch()
    copies = [t.clone() for t in (logp, old, adv, mask)]
    policy_loss(logp, old, adv, mask, ref_logprobs=logp, beta=0.1)
    assert all(torch.equal(a, b) for a, b in zip(copies, (logp, old, adv, mask)))






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
    """At the same weights the low and high stages' gradients (shared denominator, KL per stage) add up to GRPO's."""
    weight, x, tokens, mask, old, ref, adv = _setup()
    adv = reweight_advantages(adv, old, 0.3)
    low, high = lopti_masks(old, mask, eta=0.5)
    assert low.any() and high.any()
    n = int(mask.sum())
    kw = dict(ref_logprobs=ref, beta=0.01, num_tokens=n)
    full = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv, mask, **kw))
    g_low = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv * low, low, **kw))
    g_high = _grad(weight, x, tokens, lambda lp: policy_loss(lp, old, adv * high, high, **kw))
    torch.testing.assert_close(g_low + g_high, full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(g_low, full, atol=1e-3)  # each stage alone is a different update


def test_micro_batches_with_shared_token_count_give_the_same_gradient():
    """Accumulating micro-batches with the mini-batch's token count is the whole batch's gradient."""
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
    """AR with alpha = 0 changes no bit of the gradient."""
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
    """Prop. 4.2: sqrt(N / (N - 1)) (1 - pi_j) <= ||d log pi_j / dz|| <= sqrt(2) (1 - pi_j)."""
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
    """Both bounds of Prop. 4.2 are reached: the rest uniform (lower), the rest on one token (upper)."""
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


def test_logit_gradient_bounds_is_the_autograd_norm_between_its_bounds():
    """logit_gradient_bounds computes ||e_j - pi|| itself: it equals autograd's gradient norm of log pi_j, lies
    between the bounds, and meets each bound in its tight case."""
    g = torch.Generator().manual_seed(3)
    z = 3 * torch.randn(6, 7, dtype=torch.float64, generator=g)
    tokens = torch.randint(0, 7, (6,), generator=g)
    lower, norm, upper = lopti.logit_gradient_bounds(z.softmax(-1), tokens)
    for i in range(6):
        autograd_norm, gap = _grad_norm_and_gap(z[i], int(tokens[i]))
        assert norm[i].item() == pytest.approx(autograd_norm, rel=1e-9)
        assert lower[i].item() == pytest.approx(math.sqrt(7 / 6) * gap, rel=1e-12)
        assert upper[i].item() == pytest.approx(math.sqrt(2) * gap, rel=1e-12)
    assert ((lower <= norm) & (norm <= upper)).all()
    uniform_rest = torch.tensor([[2.0, 0, 0, 0]], dtype=torch.float64)
    one_rival = torch.tensor([[2.0, 0, -1e4, -1e4]], dtype=torch.float64)
    lower, norm, _ = lopti.logit_gradient_bounds(uniform_rest.softmax(-1), torch.tensor([0]))
    assert norm.item() == pytest.approx(lower.item(), rel=1e-12)
    _, norm, upper = lopti.logit_gradient_bounds(one_rival.softmax(-1), torch.tensor([0]))
    assert norm.item() == pytest.approx(upper.item(), rel=1e-12)
