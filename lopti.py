"""lopti.py: GRPO with Advantage Reweighting and Lopti, in one file.

Reference implementation of "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs"
(Yang et al., ICLR 2026, arXiv 2505.12929). Official code: github.com/zhyang2226/AR-Lopti (verl 0.1).

    python lopti.py toy      # the paper's mechanism on a toy softmax policy, CPU, < 1 minute
    python lopti.py train    # GRPO (+AR, +Lopti) on Knights-and-Knaves with a Hugging Face causal LM
    python lopti.py eval     # greedy K&K accuracy of a model

Sections (grep -n '^# ===' lopti.py): core math -> K&K task -> config -> model I/O -> rollout ->
update (Algorithm 1) -> train loop -> evaluation -> toy experiment -> CLI.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


# ====== Config: one dataclass, paper defaults (PAPER.md Sec. 1, 3, 4) ======


@dataclass
class Config:
    """Every field is settable as `--field value`; presets (PRESETS) change a few for smaller machines.
    Names shared with TRL's GRPOConfig keep TRL's spelling."""

    # --- method
    alpha: float = 0.3
    """Advantage Reweighting strength, Eq. 4; 0 turns AR off (paper: 0.3 on K&K, 0.1 on math)."""
    lopti: bool = True
    """Lopti: two update passes per step, low-probability tokens first (Algorithm 1)."""
    eta: float = 0.5
    """Lopti's probability threshold: tokens with pi_old < eta are updated in the first pass."""
    lopti_order: str = "low_first"
    """'low_first' is the paper's method; 'high_first' is its ablation (worse than GRPO in the paper)."""
    # --- PPO / GRPO update
    epsilon: float = 0.2
    """Lower clip range of the ratio (official clip_ratio_low)."""
    epsilon_high: float = 0.24
    """Upper clip range of the ratio (official clip_ratio_high)."""
    dual_clip: float = 10.0
    """Dual-clip constant c for negative advantages (official code; not in the paper's text)."""
    beta: float = 0.001
    """Weight of the k3 KL penalty to the reference model; 0 loads no reference model."""
    learning_rate: float = 1e-6
    """AdamW learning rate, constant."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip per optimiser step."""
    mini_batch_size: int = 256
    """Responses per optimiser step (paper: 512 responses per RL step -> 2 steps per pass)."""
    micro_batch_size: int = 4
    """Responses per forward/backward; gradients accumulate over a mini-batch's micro-batches."""
    num_iterations: int = 1
    """PPO epochs over the rollout batch per update pass (paper: 1)."""


# ====== Core math: group advantage, log-probs, AR (Eq. 4), Lopti masks (Alg. 1), loss ======
# Pure tensor functions. None of them mutates its inputs; each can be copied into another trainer.


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}; these tensors must all be (B, T)")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage, one value per response (PAPER.md Sec. 1):

        A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)

    `rewards` is (B,) with the G = `group_size` responses of one prompt in consecutive rows.
    std is torch's unbiased std, as the official code uses. A group whose rewards are all equal gets
    A = 0 (not 0/eps noise); a group of one gets mean 0, std 1, as in the official code.
    Example: G = 8, rewards [1, 0, 0, 0, 0, 0, 0, 0] -> A = [2.47, -0.35, ..., -0.35].
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide the batch of {rewards.numel()} rewards")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; fix the reward function before computing advantages")
    r = rewards.float().view(-1, group_size)  # (P, G)
    if group_size == 1:
        return (r / (1.0 + eps)).view(-1)  # official: mean 0, std 1 for a single sample
    mean = r.mean(dim=1, keepdim=True)  # (P, 1)
    std = r.std(dim=1, keepdim=True)  # (P, 1), unbiased
    adv = (r - mean) / (std + eps)  # (P, G)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)  # (P, 1)
    return torch.where(all_equal, torch.zeros_like(adv), adv).view(-1)  # (B,)


def _logprobs_fp32(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float() / temperature  # (n, V), one chunk in fp32
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(dim=-1)  # (n,)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, chunk_elems: int = 2**24
) -> torch.Tensor:
    """log pi(o_t) = log softmax(z_t / T)[o_t], in float32, for logits (B, T, V) and tokens (B, T).

    Every log-prob (current, old, reference) uses the sampling temperature T (PAPER.md Sec. 1): scoring
    with softmax(z) while sampling from softmax(z / T) makes the first ratio != 1 and moves Lopti's split.
    The chosen logit minus logsumexp is computed in fp32 over chunks of about `chunk_elems` logits, so a
    bf16 (B, T, 150k) tensor is never copied to fp32 whole; under autograd each chunk is recomputed in the
    backward pass (activation checkpointing) instead of being stored.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} must be (B, T, V), (B, T)")
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (B*T, V), a view
    flat_tokens = tokens.reshape(-1)  # (B*T,)
    rows = max(1, chunk_elems // logits.shape[-1])
    grad = torch.is_grad_enabled() and logits.requires_grad
    out = []
    for i in range(0, flat_logits.shape[0], rows):
        args = (flat_logits[i : i + rows], flat_tokens[i : i + rows], temperature)
        out.append(checkpoint(_logprobs_fp32, *args, use_reentrant=False) if grad else _logprobs_fp32(*args))
    if not out:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(out).view(tokens.shape)  # (B, T) float32


def reweight_advantages(advantages: torch.Tensor, old_logprobs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting, Eq. 4:

        A_{i,t} <- (alpha * pi_old(o_{i,t}) + 1 - alpha) * A_{i,t}

    `advantages` is (B,) (broadcast over tokens) or (B, T); `old_logprobs` is (B, T) log pi_old at the
    sampling temperature. The weight is a constant: no gradient flows through `old_logprobs`.
    alpha = 0 returns the advantages unchanged (plain GRPO); paper: 0.3 on K&K, 0.1 on math.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # (B, 1)
    if adv.dim() != 2 or adv.shape[0] != old_logprobs.shape[0] or adv.shape[1] not in (1, old_logprobs.shape[1]):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be (B,) or (B, T) for old_logprobs (B, T) "
                         f"= {tuple(old_logprobs.shape)}")
    pi_old = old_logprobs.detach().float().exp()  # (B, T)
    return (alpha * pi_old + 1.0 - alpha) * adv  # (B, T)


def lopti_masks(old_logprobs: torch.Tensor, mask: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lopti's split of the response tokens (Algorithm 1): low = pi_old < eta, high = the rest.

    Both masks are (B, T) booleans that partition `mask` (padding is in neither). The split is made once
    per RL step from pi_old and kept for both stages. Official name of eta: `seperate_prob`.
    Example, eta = 0.5: pi_old = [[0.9, 0.2, 0.6, 1.0]], mask = [[1, 1, 1, 0]]
        -> low = [[F, T, F, F]], high = [[T, F, T, F]]
    """
    if not 0.0 < eta <= 1.0:
        raise ValueError(f"eta must be in (0, 1], got {eta}")
    _check_same_shape(old_logprobs=old_logprobs, mask=mask)
    mask = mask.bool()
    low = mask & (old_logprobs.detach().float().exp() < eta)  # (B, T)
    return low, mask & ~low


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float = 0.24,
    dual_clip: float = 10.0,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_mask: torch.Tensor | None = None,
    num_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's clipped surrogate with a k3 KL penalty, aggregated token-mean (PAPER.md Sec. 1):

        ratio = exp(logp - old_logp)
        pg    = max(-A * ratio, -A * clip(ratio, 1 - epsilon, 1 + epsilon_high))
        pg    = min(pg, -A * dual_clip)                  where A < 0
        kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1
        loss  = (sum_{mask} pg + beta * sum_{kl_mask} kl) / num_tokens

    All inputs are (B, T) (`advantages` may be (B,)). `num_tokens` defaults to mask.sum(); pass the whole
    mini-batch's token count when this call sees one micro-batch, so that accumulation gives the same
    gradient as one big batch, and the full count in a Lopti stage (Sec. 4 of PAPER.md: a stage is not
    renormalised over its own tokens, so the two stages' gradients add up to GRPO's).
    The dual clip and the per-stage `kl_mask` are the official code's; the paper's text has neither.
    """
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon}, {epsilon_high}")
    if dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask, ref_logprobs=ref_logprobs,
                      kl_mask=kl_mask)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    if advantages.dim() != 2 or advantages.shape[0] != logprobs.shape[0] or advantages.shape[1] not in (
        1, logprobs.shape[1]):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be (B,) or (B, T) for logprobs "
                         f"{tuple(logprobs.shape)}")
    logprobs, old_logprobs = logprobs.float(), old_logprobs.float()  # the ratio is sensitive: fp32
    mask = mask.bool()
    kl_mask = mask if kl_mask is None else kl_mask.bool()
    if num_tokens is None:
        num_tokens = mask.sum()
    if float(num_tokens) < 0:
        raise ValueError(f"num_tokens must be >= 0, got {float(num_tokens)}")
    denom = max(float(num_tokens), 1.0)
    adv = advantages.float().expand_as(logprobs)  # (B, T)

    # Padding may hold -inf or garbage log-probs: zero the log-ratio there before exp (no NaN gradients).
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - epsilon, 1 + epsilon_high))  # (B, T)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)  # (B, T), dual clip
    loss = torch.where(mask, pg, torch.zeros_like(pg)).sum() / denom

    kl_ref = torch.zeros_like(pg)
    if ref_logprobs is not None:
        # k3 estimator; official clamps: log-ratio to [-5, 5], KL to [-10, 10].
        d = torch.where(kl_mask, ref_logprobs.float() - logprobs, torch.zeros_like(pg)).clamp(-5, 5)  # (B, T)
        kl_ref = (d.exp() - d - 1).clamp(-10, 10)  # (B, T)
        if beta > 0:
            loss = loss + beta * torch.where(kl_mask, kl_ref, torch.zeros_like(pg)).sum() / denom

    with torch.no_grad():
        n, n_kl = max(int(mask.sum()), 1), max(int(kl_mask.sum()), 1)
        frac = lambda x: float((x & mask).sum()) / n  # noqa: E731
        stats = {
            "clip_high": frac((ratio > 1 + epsilon_high) & (adv > 0)),
            "clip_low": frac((ratio < 1 - epsilon) & (adv < 0)),
            "clip_dual": frac((ratio > dual_clip) & (adv < 0)),
            "kl_ref": float(kl_ref[kl_mask].sum()) / n_kl,
            "kl_old": float(-log_ratio[mask].sum()) / n,  # the official "ppo_kl"
            "tokens": float(mask.sum()),
        }
    return loss, stats


# ====== The update: Algorithm 1 (one GRPO pass, or Lopti's two passes) ======


def update_policy(
    cfg: Config,
    logprob_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
) -> dict[str, float]:
    """One RL step's update on a rollout batch: Advantage Reweighting (Eq. 4), then one GRPO pass or,
    with `cfg.lopti`, Lopti's two complete passes (Algorithm 1).

    `batch` holds (B, T) `old_logprobs` and `mask`, (B,) `advantages`, optionally `ref_logprobs`, and
    whatever `logprob_fn` needs; `logprob_fn(micro_batch)` returns the current (b, T) log-probs with
    gradients. Each pass walks the batch in mini-batches of `cfg.mini_batch_size` rows, one AdamW step
    each, accumulating over micro-batches of `cfg.micro_batch_size` rows with the mini-batch's token
    count as the shared denominator. Lopti's split is made once from pi_old; stage 2 starts from stage
    1's weights, keeps the same old log-probs (its ratio already sees stage 1's drift) and the optimiser
    state. Returns per-pass means of the loss statistics and grad norms.
    """
    B = batch["mask"].shape[0]
    mask = batch["mask"].bool()
    adv = reweight_advantages(batch["advantages"], batch["old_logprobs"], cfg.alpha)  # (B, T); AR before Lopti
    if cfg.lopti:
        low, high = lopti_masks(batch["old_logprobs"], mask, cfg.eta)
        stages = [("low", low), ("high", high)]
        if cfg.lopti_order == "high_first":
            stages.reverse()
    else:
        stages = [("all", mask)]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {"ar_weight": float((cfg.alpha * batch["old_logprobs"].float().exp() + 1 - cfg.alpha)[mask].mean())}
    for name, stage_mask in stages:
        token_sums: dict[str, float] = {}  # token-weighted sums of policy_loss's stats
        losses, grad_norms, total = [], [], 0.0
        for _ in range(cfg.num_iterations):
            for start in range(0, B, cfg.mini_batch_size):
                rows = slice(start, min(start + cfg.mini_batch_size, B))
                n = int(mask[rows].sum())  # token-mean over the whole mini-batch, in every stage
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for m in range(rows.start, rows.stop, cfg.micro_batch_size):
                    micro = slice(m, min(m + cfg.micro_batch_size, rows.stop))
                    sub = {k: v[micro] for k, v in batch.items()}
                    loss, stats = policy_loss(
                        logprob_fn(sub), sub["old_logprobs"], adv[micro] * stage_mask[micro], mask[micro],
                        epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, dual_clip=cfg.dual_clip,
                        ref_logprobs=sub.get("ref_logprobs"), beta=cfg.beta, kl_mask=stage_mask[micro],
                        num_tokens=n)
                    loss.backward()
                    loss_sum += loss.item()
                    t = stats.pop("tokens")
                    total += t
                    for k, v in stats.items():
                        token_sums[k] = token_sums.get(k, 0.0) + v * t
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
                optimizer.step()
                losses.append(loss_sum)
        out.update({f"{name}/{k}": v / max(total, 1.0) for k, v in token_sums.items()})
        out[f"{name}/loss"] = sum(losses) / max(len(losses), 1)
        out[f"{name}/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        out[f"{name}/token_share"] = float(stage_mask.sum()) / max(float(mask.sum()), 1.0)
    return out
