"""lopti.py: GRPO with Advantage Reweighting and Lopti, in one file.

Reference implementation of "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs" (Yang et al.,
ICLR 2026, arXiv 2505.12929). Official code: github.com/zhyang2226/AR-Lopti (a verl 0.1 fork).

    python lopti.py toy      # the paper's mechanism on a toy softmax policy, CPU, < 1 minute
    python lopti.py train    # GRPO (+AR, +Lopti) on Knights and Knaves with a Hugging Face causal LM
    python lopti.py eval     # greedy K&K accuracy of a model;  python lopti.py plot RUN_DIR ...  # curves

Sections (grep -n '^# ===' lopti.py), the method first, each name defined above its first use: config -> core
math -> the update (Algorithm 1) -> toy experiment -> the K&K task -> LLM run (rollout, evaluation, training loop)
-> TRL -> CLI.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import errno
import functools
import hashlib
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import datasets
import torch
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm


# ====== Config: one dataclass, the paper's K&K settings ======


def _people_range(spec: str) -> tuple[int, int]:
    """'3-7' -> (3, 7); '5' -> (5, 5)."""
    lo, _, hi = spec.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"num_people must be 'lo-hi' or a number, e.g. '3-7', got {spec!r}") from None


@dataclass
class Config:
    """Every field is a flag (`--field value`); PRESETS change a few for smaller machines. Defaults are the
    paper's K&K run (Qwen2.5-3B-Instruct, as the official scripts/train_kklogic_*.sh set it); names shared with
    TRL's GRPOConfig keep TRL's spelling (num_generations, epsilon, epsilon_high, beta, ...)."""

    # --- method
    alpha: float = 0.3
    """Advantage Reweighting strength, Eq. 4; 0 is GRPO (paper: 0.3 on K&K, 0.1 on math; official: reweight_k)."""
    lopti: bool = True
    """Lopti: two update passes per step, low-probability tokens first (Algorithm 1)."""
    eta: float = 0.5
    """Lopti's threshold: tokens with pi_old < eta go in the low pass (official name: seperate_prob)."""
    lopti_order: str = "low_first"
    """'low_first' is the paper's method; 'high_first' is its ablation (worse than GRPO in the paper)."""
    # --- PPO / GRPO update
    epsilon: float = 0.2
    """Lower clip range of the ratio."""
    epsilon_high: float = 0.24
    """Upper clip range of the ratio (the official K&K scripts clip asymmetrically)."""
    dual_clip: float = 10.0
    """Dual-clip constant c for negative advantages (official code, verl's clip_ratio_c; not in the paper's text)."""
    beta: float = 0.001
    """Weight of the k3 KL penalty to the reference model; 0 loads no reference model."""
    learning_rate: float = 1e-6
    """Constant learning rate."""
    optimizer: str = "adamw"
    """'adamw' (betas 0.9/0.999, the training scripts') or 'sgd': plain SGD, no momentum or decay (the official code's
    actor.optim.type sgd, verl/workers/fsdp_workers.py; the paper's analysis figures: SGD, lr 1e-3)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip per optimiser step."""
    mini_batch_size: int = 256
    """Responses per optimiser step (paper: 512 responses per RL step -> 2 optimiser steps per pass)."""
    micro_batch_size: int = 4
    """Responses per forward/backward; gradients accumulate over a mini-batch's micro-batches."""
    num_iterations: int = 1
    """PPO epochs over the rollout batch in each update pass (paper: 1)."""
    # --- rollout
    model: str = "Qwen/Qwen2.5-3B-Instruct"
    """Hugging Face hub id or local folder of a causal LM (an instruct model with a chat template)."""
    prompts_per_step: int = 64
    """Prompts per RL step; each gets num_generations samples."""
    num_generations: int = 8
    """Group size G: samples per prompt."""
    temperature: float = 0.7
    """Sampling temperature T; every log-prob is computed from logits / T."""
    max_completion_length: int = 4096
    """Longest generated completion, in tokens."""
    mask_truncated: bool = False
    """Leave completions that hit max_completion_length without EOS out of the loss."""
    generation_batch_size: int = 0
    """Sequences per generate() call in a rollout (0 = all at once); smaller bounds the KV cache's memory."""
    stop_at_answer: bool = False
    """End completions at their first '</answer>', as many K&K reproductions do (the paper's end at EOS)."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in the update's forward passes."""
    # --- task, reward and schedule
    format_reward: float = 0.0
    """Weight of kk_format_credit added to the training reward (0 = the paper's reward; metrics stay Logic-RL's)."""
    train_data: str = "generate"
    """'generate' (fresh puzzles), a .jsonl/.parquet file, or a hub dataset (see kk_load)."""
    num_people: str = "3-7"
    """Puzzle sizes to generate: 'lo-hi' or one number, within 2..8."""
    num_train: int = 4480
    """Generated training puzzles (paper: 70 steps of 64 prompts per data epoch)."""
    steps: int = 350
    """RL steps (paper: 5 data epochs)."""
    eval_data: str = "generate"
    """'generate' (puzzles from a seed disjoint from training) or a file / hub dataset."""
    eval_size: int = 20
    """Generated evaluation puzzles per number of people."""
    eval_every: int = 50
    """Evaluate every this many steps (0 = only at the end)."""
    eval_batch_size: int = 32
    """Prompts per greedy-generation batch in evaluation."""
    save_every: int = 50
    """Checkpoint every this many steps (and always at the end or on Ctrl-C)."""
    diagnose_every: int = 0
    """Log Figure 1 (measure_bins: 5 forwards, 4 backwards) before the update every this many steps (0 = off)."""
    measure_update: bool = True
    """Log Figure 3 of every step's own update (update_counts: a no-grad forward after it; under bf16 two, fp32)."""
    output_dir: str = "runs/lopti"
    """Checkpoints, metrics.jsonl, samples.jsonl and config.json go here."""
    seed: int = 0
    """Seeds data order, sampling and generated puzzles."""

    def __post_init__(self):  # every value is checked here, before anything is loaded
        for f in fields(self):
            value, kind = getattr(self, f.name), {"float": (int, float), "int": int, "bool": bool, "str": str}[f.type]
            if not isinstance(value, kind) or (isinstance(value, bool) and f.type != "bool") or (
                    f.type == "float" and not math.isfinite(value)):
                raise ValueError(f"{f.name} must be a{' finite' if f.type == 'float' else ''} {f.type}, got {value!r}")
        lo, hi = _people_range(self.num_people)
        at_least = {0: ("epsilon", "epsilon_high", "beta", "weight_decay", "format_reward", "generation_batch_size",
                        "eval_every", "save_every", "seed", "diagnose_every"),
                    1: ("mini_batch_size", "micro_batch_size", "num_iterations", "prompts_per_step", "num_generations",
                        "max_completion_length", "num_train", "steps", "eval_size", "eval_batch_size")}
        checks = [(f, getattr(self, f) >= n, f">= {n}") for n, names in at_least.items() for f in names] + [
            ("num_people", 2 <= lo <= hi <= 8, "'lo-hi' or one number within 2..8, e.g. '3-7'"),
            ("alpha", 0 <= self.alpha <= 1, "in [0, 1]"), ("eta", 0 < self.eta <= 1, "in (0, 1]"),
            ("lopti_order", self.lopti_order in ("low_first", "high_first"), "'low_first' or 'high_first'"),
            ("optimizer", self.optimizer in ("adamw", "sgd"), "'adamw' or 'sgd'"),
            ("dual_clip", self.dual_clip > 1, "> 1"), ("learning_rate", self.learning_rate > 0, "> 0"),
            ("temperature", self.temperature > 0, "> 0"), ("max_grad_norm", self.max_grad_norm > 0, "> 0")]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")


# ====== Core math: group advantage, log-probs, AR (Eq. 4), Lopti's split (Algorithm 1), the loss ======
# Pure tensor functions. None of them mutates its inputs; each can be copied into another trainer.


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}; these tensors must all be (B, T)")


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages as a float (B, T) view for (B, T) per-token tensors like `like`."""
    adv = advantages.float().unsqueeze(-1) if advantages.dim() == 1 else advantages.float()  # (B, 1) or (B, T)
    if adv.dim() != 2 or adv.shape[0] != like.shape[0] or adv.shape[1] not in (1, like.shape[1]):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be (B,) or (B, T) "
                         f"for (B, T) = {tuple(like.shape)}")
    return adv.expand(like.shape)  # (B, T)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage, one value per response (official: compute_grpo_outcome_advantage):

        A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)

    `rewards` is (B,) with the G = `group_size` responses of one prompt in consecutive rows.
    std is torch's unbiased std, as the official code uses. A group whose rewards are all equal gets
    A = 0 (not 0/eps noise); a group of one gets mean 0, std 1, as in the official code.
    Example: G = 8, rewards [1, 0, 0, 0, 0, 0, 0, 0] -> A = [2.47, -0.35, ..., -0.35]."""
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


def _logprobs_fp32(x: torch.Tensor, tokens: torch.Tensor, temperature: float, head) -> torch.Tensor:
    z = (x if head is None else head(x)).float() / temperature  # (n, V), one chunk of logits in fp32
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(dim=-1)  # (n,)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   chunk_elems: int = 2**24, head: torch.nn.Linear | None = None) -> torch.Tensor:
    """log pi(o_t) = log softmax(z_t / T)[o_t], in float32, for logits (B, T, V) and tokens (B, T); with `head`
    (an LM's output layer), `logits` are the final hidden states (B, T, H) and z_t = head(h_t).
    Every log-prob (current, old, reference) uses the sampling temperature T, as the official actor does: scoring
    with softmax(z) while sampling from softmax(z / T) makes the first ratio != 1 and moves Lopti's split.
    The chosen logit minus logsumexp is computed in fp32 over chunks of positions, about `chunk_elems` logits each,
    so the (B, T, V) logits never exist whole; under autograd each chunk (and its head) is recomputed in the
    backward pass (activation checkpointing) instead of being stored. Chunks of positions, not TRL's vocabulary
    chunks with an online logsumexp: a row of V logits always fits, so torch's logsumexp and autograd suffice."""
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} must be (B, T, V), (B, T)")
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (B*T, V or H): a view if contiguous, else a copy
    flat_tokens = tokens.reshape(-1)  # (B*T,)
    rows = max(1, chunk_elems // (logits.shape[-1] if head is None else head.out_features))
    grad = torch.is_grad_enabled() and (logits.requires_grad or head is not None and head.weight.requires_grad)
    out = []
    for i in range(0, flat_logits.shape[0], rows):
        args = (flat_logits[i : i + rows], flat_tokens[i : i + rows], temperature, head)
        out.append(checkpoint(_logprobs_fp32, *args, use_reentrant=False) if grad else _logprobs_fp32(*args))
    if not out:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(out).view(tokens.shape)  # (B, T) float32


def reweight_advantages(advantages: torch.Tensor, old_logprobs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting, Eq. 4:

        A_{i,t} <- (alpha * pi_old(o_{i,t}) + 1 - alpha) * A_{i,t}

    `advantages` is (B,) (broadcast over tokens) or (B, T); `old_logprobs` is (B, T) log pi_old at the
    sampling temperature. The weight is a constant: no gradient flows through `old_logprobs`.
    alpha = 0 returns the advantages unchanged (plain GRPO); paper: 0.3 on K&K, 0.1 on math."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    pi_old = old_logprobs.detach().float().exp()  # (B, T)
    return (alpha * pi_old + 1.0 - alpha) * _token_advantages(advantages, old_logprobs)  # (B, T)


def lopti_masks(old_logprobs: torch.Tensor, mask: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lopti's split of the response tokens (Algorithm 1): low = pi_old < eta, high = the rest.
    Both masks are (B, T) booleans that partition `mask` (padding is in neither). The split is made once
    per RL step from pi_old and kept for both stages. Official name of eta: `seperate_prob`.
    Example, eta = 0.5: pi_old = [[0.9, 0.2, 0.6, 1.0]], mask = [[1, 1, 1, 0]]
        -> low = [[F, T, F, F]], high = [[T, F, T, F]]"""
    if not 0.0 < eta <= 1.0:
        raise ValueError(f"eta must be in (0, 1], got {eta}")
    _check_same_shape(old_logprobs=old_logprobs, mask=mask)
    mask = mask.bool()
    low = mask & (old_logprobs.detach().float().exp() < eta)  # (B, T)
    return low, mask & ~low


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                epsilon: float = 0.2, epsilon_high: float = 0.24, dual_clip: float = 10.0,
                ref_logprobs: torch.Tensor | None = None, beta: float = 0.0, kl_mask: torch.Tensor | None = None,
                num_tokens: int | float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped surrogate with a k3 KL penalty, aggregated token-mean (official: core_algos.py):

        ratio = exp(logp - old_logp)
        pg    = max(-A * ratio, -A * clip(ratio, 1 - epsilon, 1 + epsilon_high))
        pg    = min(pg, -A * dual_clip)                  where A < 0
        kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1
        loss  = (sum_{mask} pg + beta * sum_{kl_mask} kl) / num_tokens

    All inputs are (B, T) (`advantages` may be (B,)). `num_tokens` defaults to mask.sum(); pass the whole
    mini-batch's token count when this call sees one micro-batch, so that accumulation gives the same
    gradient as one big batch, and the full count in a Lopti stage (official code: a stage is not
    renormalised over its own tokens, so the two stages' gradients add up to GRPO's).
    The dual clip, the per-stage `kl_mask`, the token-mean (the paper's GRPO objective averages each response
    with 1/|o_i| first) and the shared denominator are the official code's; the paper's text has none of them."""
    for name, value, lo in (("epsilon", epsilon, 0), ("epsilon_high", epsilon_high, 0), ("beta", beta, 0)):
        if not lo <= value < math.inf:
            raise ValueError(f"{name} must be finite and >= {lo}, got {value}")
    if not 1 < dual_clip < math.inf:
        raise ValueError(f"dual_clip must be finite and > 1, got {dual_clip}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask, ref_logprobs=ref_logprobs,
                      kl_mask=kl_mask)
    adv = _token_advantages(advantages, logprobs)  # (B, T)
    logprobs, old_logprobs = logprobs.float(), old_logprobs.float()  # the ratio is sensitive: fp32
    mask = mask.bool()
    kl_mask = mask if kl_mask is None else kl_mask.bool() & mask  # never on padding
    if num_tokens is None:
        num_tokens = mask.sum()  # (a tensor stays on the device: it is not checked)
    elif not isinstance(num_tokens, torch.Tensor) and not 0 <= num_tokens < math.inf:
        raise ValueError(f"num_tokens must be finite and >= 0, got {num_tokens}")
    denom = num_tokens.clamp(min=1) if isinstance(num_tokens, torch.Tensor) else max(num_tokens, 1)

    # Padding may hold -inf or garbage log-probs: zero the log-ratio there before exp (no NaN gradients). The
    # clamp to [-20, 20] is upstream verl's (the official fork has none): past ~88.7 exp() overflows and the
    # gradient turns NaN while the clipped loss stays finite.
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs)).clamp(-20, 20)  # (B, T)
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

    with torch.no_grad():  # 0-dim tensors: no GPU sync (log_ratio is 0 off `mask`, kl_ref off `kl_mask`)
        n, n_kl = mask.sum().clamp(min=1), kl_mask.sum().clamp(min=1)
        frac = lambda x: (x & mask).sum() / n  # noqa: E731
        stats = {
            "clip_high": frac((ratio > 1 + epsilon_high) & (adv > 0)),
            "clip_low": frac((ratio < 1 - epsilon) & (adv < 0)),
            "clip_dual": frac((ratio > dual_clip) & (adv < 0)),
            "kl_ref": kl_ref.sum() / n_kl,
            "kl_old": -log_ratio.sum() / n,  # the official "ppo_kl"
            "tokens": mask.sum(),
        }
    return loss, stats


# ====== The update: Algorithm 1 (one GRPO pass, or Lopti's two passes) ======


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW as the official scripts train: betas 0.9/0.999, constant learning rate. Fused: the default holds
    temporaries as large as the parameters during the step (a Qwen2.5-0.5B-shaped model's step: 1.1 GB, on CPU).
    Or plain SGD (Config.optimizer), as the official code's analysis option: p - lr * g."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
    return torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.999),
                             weight_decay=cfg.weight_decay, fused=True)


def rows_with_gradient(advantages: torch.Tensor, beta: float) -> torch.Tensor:
    """(B,) bool: the rows whose loss can have a gradient, for (B,) or (B, T) advantages taken before AR: a
    non-zero advantage, or any row when beta > 0 (its KL term). The others need no pi_old, forward or backward."""
    return (advantages != 0).view(len(advantages), -1).any(1) | (beta > 0)


def update_policy(cfg: Config, logprob_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                  optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """One RL step's update on a rollout batch: Advantage Reweighting (Eq. 4), then one GRPO pass or,
    with `cfg.lopti`, Lopti's two complete passes (Algorithm 1).
    `batch` holds (B, T) `old_logprobs` and `mask`, (B,) `advantages`, optionally `ref_logprobs`, and
    whatever `logprob_fn` needs; `logprob_fn(micro_batch)` returns the current (b, T) log-probs with
    gradients. Each pass walks the batch in mini-batches of `cfg.mini_batch_size` rows, one AdamW step
    each, accumulating over micro-batches of `cfg.micro_batch_size` rows with the mini-batch's token
    count as the shared denominator. Lopti's split is made once from pi_old; stage 2 starts from stage
    1's weights, keeps the same old log-probs (its ratio already sees stage 1's drift) and the optimiser
    state. Returns per-pass means of the loss statistics and grad norms.
    A row with no gradient in a pass (no token of the pass, or rows_with_gradient() false) is not computed (no
    forward, no backward) but still counts in its mini-batch's denominator, so the step is the one computed over
    every row (tested); with beta = 0 its old_logprobs may hold anything, even NaN. Statistics are over computed rows.
    """
    B = batch["mask"].shape[0]
    mask = batch["mask"].bool()
    adv = reweight_advantages(batch["advantages"], batch["old_logprobs"], cfg.alpha)  # (B, T); AR before Lopti
    stages = [("all", mask)]
    if cfg.lopti:  # low-probability tokens first; "high_first" is the paper's ablation
        low, high = lopti_masks(batch["old_logprobs"], mask, cfg.eta)
        stages = [("low", low), ("high", high)] if cfg.lopti_order == "low_first" else [("high", high), ("low", low)]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    active = mask & rows_with_gradient(batch["advantages"], cfg.beta)[:, None]  # (B, T) tokens of rows with a gradient
    weight = reweight_advantages(torch.ones(B, device=mask.device), batch["old_logprobs"], cfg.alpha)  # (B, T)
    out = {"ar_weight": float(weight[active].mean()) if active.any() else None}
    for name, stage_mask in stages:
        in_pass = (active & stage_mask).any(1).cpu()  # (B,) rows with a gradient in this pass
        t0 = time.perf_counter()  # (.cpu() waited for a GPU's queued work; so does float() at the end of the pass)
        # token-weighted sums of policy_loss's stats (tensors: no GPU sync), every key present even for an empty stage
        token_sums = dict.fromkeys(("clip_high", "clip_low", "clip_dual", "kl_ref", "kl_old"), 0.0)
        losses, grad_norms, total, kl_total, skipped = [], [], 0.0, 0.0, 0
        for _ in range(cfg.num_iterations):
            for start in range(0, B, cfg.mini_batch_size):
                rows = torch.arange(start, min(start + cfg.mini_batch_size, B))
                todo = rows[in_pass[rows]]  # the rows to compute
                if len(todo) == 0:  # no gradient: no step (our choice; the official code steps anyway, and a step
                    continue  # on a zero gradient would still move the weights through AdamW's momentum and decay)
                # The whole mini-batch's token count, in every stage (policy_loss's num_tokens). Our choice, where
                # verl averages per-micro-batch token-means: it makes gradient accumulation exact.
                n = mask[rows].sum()
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for micro in todo.split(cfg.micro_batch_size):
                    sub = {k: v[micro] for k, v in batch.items()}
                    loss, stats = policy_loss(
                        logprob_fn(sub), sub["old_logprobs"], adv[micro] * stage_mask[micro], mask[micro],
                        epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, dual_clip=cfg.dual_clip,
                        ref_logprobs=sub.get("ref_logprobs"), beta=cfg.beta, kl_mask=stage_mask[micro],
                        num_tokens=n)
                    loss.backward()
                    loss_sum += loss.detach()
                    t, t_kl = stats.pop("tokens"), stage_mask[micro].sum()
                    total, kl_total = total + t, kl_total + t_kl
                    for k, v in stats.items():
                        token_sums[k] += v * (t_kl if k == "kl_ref" else t)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
                if not math.isfinite(grad_norm):  # a NaN/inf step would corrupt the weights for good
                    optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                grad_norms.append(grad_norm)
                optimizer.step()
                losses.append(float(loss_sum))
        out.update({f"{name}/{k}": float(v) / max(float(kl_total if k == "kl_ref" else total), 1.0)
                    for k, v in token_sums.items()})
        share = float((stage_mask & active).sum()) / float(active.sum()) if active.any() else None
        out.update({f"{name}/skipped_steps": skipped, f"{name}/loss": sum(losses) / max(len(losses), 1),
                    f"{name}/grad_norm": sum(grad_norms) / max(len(grad_norms), 1), f"{name}/token_share": share,
                    f"{name}/rows": float(in_pass.float().mean()), f"time/update_{name}": time.perf_counter() - t0})
    optimizer.zero_grad(set_to_none=True)  # free the gradients before the next rollout
    return out


# --- Figures 1 and 3 per pi_old bin: Figure 3 on every training step's own update (update_counts), Figure 1 on one
# scored batch for any policy (measure_bins: the toy's and `python lopti.py diagnose`'s)

BIN_NAMES = ("[0,.25]", "(.25,.5]", "(.5,.75]", "(.75,1]")  # the paper's pi_old bins (Figures 1 and 3)
PAPER_FIGURES = {  # the paper's GRPO run on K&K (Qwen2.5-7B-Instruct-1M): Figure 1 (a) and (d), Figure 3
    "token_share": [0.1922, 0.1015, 0.1009, 0.6054], "grad_norm": {"bins": [0.71, 0.36, 0.24, 0.15], "all": 0.82},
    "pos_rose": {"GRPO": [0.530, 0.514, 0.501, 0.497], "AR": [0.520, 0.525, 0.530, 0.526],
                 "Lopti": [0.524, 0.517, 0.512, 0.534]}}
UPDATE_KEYS = ("pos_tokens", "pos_rose", "neg_tokens", "neg_fell", "pos_change", "neg_change")  # update/..., per bin


def bin_masks(old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(4, B, T) bool: the completion tokens of each pi_old bin [0,.25], (.25,.5], (.5,.75], (.75,1]."""
    bins = torch.bucketize(old_logprobs.float().exp(), torch.tensor([0.25, 0.5, 0.75], device=mask.device))
    return torch.stack([(bins == b) & mask.bool() for b in range(4)])


def update_counts(old_logprobs: torch.Tensor, new_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, bins: torch.Tensor | None = None) -> dict[str, list]:
    """Figure 3 as the official code records it at every step (verl/trainer/ppo/ray_trainer.py, plot_fig_type
    "prob_stat"): per pi_old bin, the tokens with A > 0 and with A < 0 (A before AR: its `old_advantages`), how many
    of them rose (A > 0) or fell (A < 0) from pi_old to pi after the step's whole update, and the mean change of pi
    per sign (None where a bin has no token). Counts, so that steps and runs pool by summing. Figure 3's ratio is
    update/pos_rose / update/pos_tokens. `bins`: the log-probs that bin the tokens, if not old_logprobs."""
    masks = bin_masks(old_logprobs if bins is None else bins, mask)  # (4, B, T)
    adv = _token_advantages(advantages, old_logprobs)  # (B, T)
    rise, change = (new_logprobs - old_logprobs).sign(), new_logprobs.double().exp() - old_logprobs.double().exp()
    out = {}
    for sign, name, moved in ((1, "pos", "rose"), (-1, "neg", "fell")):
        m = masks & (adv.sign() == sign)  # (4, B, T)
        n = m.sum((1, 2))  # (4,)
        out[f"update/{name}_tokens"] = n.tolist()
        out[f"update/{name}_{moved}"] = (m & (rise == sign)).sum((1, 2)).tolist()
        out[f"update/{name}_change"] = [None if k == 0 else float(c / k) for c, k in zip((change * m).sum((1, 2)), n)]
    return out


def pool_update_counts(records: list[dict]) -> dict[str, list]:
    """update_counts of several steps or runs (metrics lines; the "update/" prefix optional) pooled exactly: counts
    summed per bin, mean changes weighted by their token counts."""
    get = lambda r, k: r.get(f"update/{k}", r.get(k)) or [0] * 4  # noqa: E731 (a line without the measurement: 0)
    out = {k: [sum(get(r, k)[b] for r in records) for b in range(4)] for k in UPDATE_KEYS if "change" not in k}
    for sign in ("pos", "neg"):
        sums = [sum(get(r, f"{sign}_tokens")[b] * (get(r, f"{sign}_change")[b] or 0) for r in records)
                for b in range(4)]
        out[f"{sign}_change"] = [t / n if n else None for t, n in zip(sums, out[f"{sign}_tokens"])]
    return out


def fig3_ratio(counts: dict) -> list:
    """Figure 3 from pooled counts: per bin, the share of A > 0 tokens whose probability rose (None: no token)."""
    return [r / n if n else None for r, n in zip(counts["pos_rose"], counts["pos_tokens"])]


def bin_gradients(cfg: Config, model: torch.nn.Module, logprob_fn: Callable, batch: dict) -> list[list[torch.Tensor]]:
    """Figure 1 (d): 4 lists of per-parameter gradients of GRPO's policy_loss (no AR, no KL) at pi = pi_old, one per
    bin with only its advantages kept. Token-mean over the whole batch as in training, so (at ratio 1 the loss is
    linear in A) they add up to the all-token gradient. One forward per micro-batch, four backwards."""
    params, mask = [p for p in model.parameters() if p.requires_grad], batch["mask"].bool()
    masks, n = bin_masks(batch["old_logprobs"], mask), int(mask.sum())
    grads = [[torch.zeros_like(p) for p in params] for _ in range(4)]
    rows = rows_with_gradient(batch["advantages"], 0.0).nonzero().squeeze(1).cpu()
    for micro in rows.split(cfg.micro_batch_size) if len(rows) else ():  # (an empty tensor splits into one part)
        sub = {k: v[micro] for k, v in batch.items()}
        logp = logprob_fn(sub)  # (b, T)
        for b in range(4):
            adv = _token_advantages(sub["advantages"], logp) * masks[b][micro]  # (b, T)
            loss, _ = policy_loss(logp, sub["old_logprobs"], adv, mask[micro], epsilon=cfg.epsilon,
                                  epsilon_high=cfg.epsilon_high, dual_clip=cfg.dual_clip, num_tokens=n)
            for g, d in zip(grads[b], torch.autograd.grad(loss, params, retain_graph=b < 3, materialize_grads=True)):
                g += d
    return grads


def measure_bins(cfg: Config, model: torch.nn.Module, logprob_fn: Callable, batch: dict, sgd_lr: float = 1e-3) -> dict:
    """Figure 1 on one scored batch (update_policy's `batch`) of the policy with `model`'s weights and `logprob_fn`.
    Per bin (None if empty): token_share (of all tokens, of those with A != 0), grad_norm (bin_gradients'; "all": of
    their sum), prob_change (mean and spread of pi_new - pi_old after one SGD step at `sgd_lr` (Figure 3's caption)
    of GRPO on all tokens, only the lowest bin, only the highest). Each step is along the bins' gradients: no more
    backwards. Change = exp(new logp) - exp(old logp), as verl/trainer/fig_plot.py. pi_old is logprob_fn's own, so
    the ratio is 1 and "before" and "after" have one precision and path (a bf16 run's old_logprobs would not). The
    weights are restored bit for bit after every probe. (Figure 3 is measured on training's own updates instead:
    update_counts; a one-batch probe of it from a fresh optimiser state is a different and far noisier quantity.)"""
    mask, B = batch["mask"].bool(), batch["mask"].shape[0]
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]

    @torch.no_grad()
    def logprobs_now() -> torch.Tensor:
        out = torch.zeros_like(batch["old_logprobs"], dtype=torch.float32)  # (B, T)
        for r in torch.arange(B).split(cfg.micro_batch_size):
            out[r] = logprob_fn({k: v[r] for k, v in batch.items()}).float()
        return out

    batch = {**batch, "old_logprobs": logprobs_now()}  # (B, T)
    masks, adv = bin_masks(batch["old_logprobs"], mask), _token_advantages(batch["advantages"], batch["mask"])
    share = lambda m: [float((k & m).sum()) / float(m.sum()) if m.any() else None for k in masks]  # noqa: E731
    norm = lambda gs: math.sqrt(sum(float(g.double().square().sum()) for g in gs))  # noqa: E731
    grads = bin_gradients(cfg, model, logprob_fn, batch)
    grads.append([sum(gs) for gs in zip(*grads)])  # all tokens
    out = {"token_share": {"all": share(mask), "nonzero_advantage": share(mask & (adv != 0))},
           "grad_norm": {"bins": [norm(g) for g in grads[:4]], "all": norm(grads[4])}, "prob_change": {}}
    stat = lambda xs, f: [None if x.numel() == 0 else float(f(x)) for x in xs]  # noqa: E731
    for name, grad in (("all", grads[4]), ("lowest_only", grads[0]), ("highest_only", grads[3])):
        with torch.no_grad():
            torch._foreach_add_(params, grad, alpha=-sgd_lr)
        change = logprobs_now().exp() - batch["old_logprobs"].exp()  # (B, T)
        d = [change[k] for k in masks]
        out["prob_change"][name] = {"mean": stat(d, torch.mean), "std": stat(d, lambda x: x.std(correction=0))}
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return out


# ====== Toy experiment: the paper's mechanism on a softmax policy (Prop. 4.2, Figures 1 and 3) ======
# A 64-token "language" whose rule is a fixed random next-token table per prompt. A small MLP reads
# (prompt, previous token, position) and outputs logits; its weights are shared by every position and
# prompt, so tokens' gradients interfere as in an LLM. A short supervised warm-up on a noisy teacher
# makes the sampled-token probabilities U-shaped. Reward: 1 when every token follows the rule, else 0 (an
# outcome reward, as K&K's), or the share of tokens that do ("dense"). The RL update is update_policy, Figure 1
# is measure_bins and Figure 3 is update_counts on every step's update, all unchanged: the toy supplies the
# policy, the task and the reward.


@dataclass(frozen=True)
class ToySettings:
    """The toy's knobs; everything not here is lopti.py's Config default (clip ranges, AdamW, grad clip)."""

    seed: int = 0
    reward: str = "outcome"  # "outcome": 1 if all tokens follow the rule, else 0; "dense": the share that do
    answer_len: int = 0  # only the last answer_len tokens count in the reward (0: all of them)
    steps: int = 40  # RL steps per learning run (part 4: does it learn faster?)
    seeds: int = 3  # learning runs per method
    alpha: float = 0.3  # AR, Eq. 4
    eta: float = 0.5  # Lopti's threshold, Algorithm 1
    vocab: int = 64
    response_len: int = 12
    prompts: int = 16
    group: int = 8  # G: samples per prompt
    hidden: int = 128
    learning_rate: float = 1e-3
    warmup_steps: int = 60  # supervised steps on the noisy teacher; few, so the policy stays uncertain in places
    teacher_accuracy: float = 0.9
    measure_after: int = 5  # GRPO steps before the Figure 1 batches (mid-run, as the paper's plots)
    measured_batches: int = 8
    threshold_frac: float = 0.5  # threshold = warm-start reward + threshold_frac * (1 - warm-start reward)
    final_window: int = 10  # final reward = mean over the last final_window steps


TOY_QUICK = dict(steps=8, seeds=2, measured_batches=2, measure_after=1)  # toy --quick: a few seconds
TOY_METHODS = {"grpo": dict(alpha=0.0, lopti=False), "ar": dict(lopti=False), "lopti": dict(alpha=0.0),
               "ar_lopti": {}, "grpo_2_epochs": dict(alpha=0.0, lopti=False, num_iterations=2)}  # (Lopti's 2 passes)
METHOD_NAMES = {"grpo": "GRPO", "ar": "AR", "lopti": "Lopti", "ar_lopti": "AR+Lopti", "grpo_2_epochs": "GRPO 2 epochs"}


class ToyLM(torch.nn.Module):
    """logits(o_t | prompt, o_{t-1}, t) = W2 tanh(W1 [e_prompt; e_prev; e_t]); one network for all contexts."""

    def __init__(self, s: ToySettings):
        super().__init__()
        d = 32
        self.prompt_emb = torch.nn.Embedding(s.prompts, d)
        self.token_emb = torch.nn.Embedding(s.vocab + 1, d)  # id `vocab` is BOS
        self.pos_emb = torch.nn.Embedding(s.response_len, d)
        self.hidden = torch.nn.Linear(3 * d, s.hidden)
        self.out = torch.nn.Linear(s.hidden, s.vocab)

    def features(self, prompts: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.prompt_emb(prompts), self.token_emb(prev), self.pos_emb(pos)], dim=-1)  # (..., 3d)
        return torch.tanh(self.hidden(x))  # (..., H)

    def forward(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, T, V) for responses `tokens` (B, T) to `prompts` (B,)."""
        B, T = tokens.shape
        prev = torch.cat([torch.full((B, 1), self.out.out_features), tokens[:, :-1]], dim=1)  # (B, T)
        pos = torch.arange(T).expand(B, T)  # (B, T)
        return self.out(self.features(prompts[:, None].expand(B, T), prev, pos))  # (B, T, V)


def toy_rewards(rule: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor, outcome: bool = True,
                answer_len: int = 0) -> torch.Tensor:
    """1 if every token of a response (of its last `answer_len`, if > 0) follows rule[prompt, previous token], else 0;
    or (not `outcome`) the share of those tokens that do."""
    B, T = tokens.shape
    prev = torch.cat([torch.full((B, 1), rule.shape[1] - 1), tokens[:, :-1]], dim=1)  # (B, T)
    good = (tokens == rule[prompts[:, None], prev]).float()[:, -answer_len:]  # (B, T) or (B, answer_len)
    return good.amin(dim=1) if outcome else good.mean(dim=1)  # (B,)


@torch.no_grad()
def toy_sample(net: ToyLM, prompts: torch.Tensor, T: int, gen: torch.Generator, teacher=None) -> torch.Tensor:
    """Autoregressive sampling at temperature 1; with teacher = (rule, accuracy), the noisy teacher instead."""
    B = prompts.shape[0]
    prev = torch.full((B,), net.out.out_features)  # (B,) BOS
    out = []
    for t in range(T):
        if teacher is None:
            probs = net.out(net.features(prompts, prev, torch.full((B,), t))).softmax(-1)  # (B, V)
            prev = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # (B,)
        else:
            rule, acc = teacher
            noise = torch.randint(0, rule.shape[1] - 1, (B,), generator=gen)  # (B,)
            prev = torch.where(torch.rand(B, generator=gen) < acc, rule[prompts, prev], noise)  # (B,)
        out.append(prev)
    return torch.stack(out, dim=1)  # (B, T)


def toy_warm_start(s: ToySettings) -> tuple[ToyLM, torch.Tensor]:
    """The rule table and a policy after a short supervised warm-up (the toy's 'pretrained LLM')."""
    gen = torch.Generator().manual_seed(s.seed)
    rule = torch.randint(0, s.vocab, (s.prompts, s.vocab + 1), generator=gen)  # (P, V+1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        net = ToyLM(s)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    prompts = torch.arange(s.prompts).repeat_interleave(s.group)  # (B,)
    for _ in range(s.warmup_steps):
        tokens = toy_sample(net, prompts, s.response_len, gen, teacher=(rule, s.teacher_accuracy))  # (B, T)
        loss = torch.nn.functional.cross_entropy(net(prompts, tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, rule


def toy_config(s: ToySettings, method: str) -> Config:
    """lopti.py's Config for the toy: 2 AdamW steps per pass (as the paper's 512 responses / 256), no
    reference model (beta = 0), temperature 1 (the toy samples from softmax(z) itself)."""
    B = s.prompts * s.group
    return Config(**{**dict(alpha=s.alpha, eta=s.eta, learning_rate=s.learning_rate, beta=0.0, temperature=1.0,
                            num_generations=s.group, prompts_per_step=s.prompts, mini_batch_size=B // 2,
                            micro_batch_size=B // 2, max_completion_length=s.response_len), **TOY_METHODS[method]})


def toy_logprobs(net: ToyLM, batch: dict) -> torch.Tensor:
    """log pi(o_t) of the batch's responses under `net` (temperature 1): (B, T)."""
    return token_logprobs(net(batch["prompts"], batch["tokens"]), batch["tokens"])


def toy_rollout(net: ToyLM, rule: torch.Tensor, s: ToySettings, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Algorithm 1, lines 3-5: G samples per prompt, rewards, group advantages, pi_old by a no-grad forward."""
    prompts = torch.arange(s.prompts).repeat_interleave(s.group)  # (B,)
    tokens = toy_sample(net, prompts, s.response_len, gen)  # (B, T)
    rewards = toy_rewards(rule, prompts, tokens, s.reward == "outcome", s.answer_len)  # (B,)
    with torch.no_grad():
        old = toy_logprobs(net, {"prompts": prompts, "tokens": tokens})  # (B, T)
    return {"prompts": prompts, "tokens": tokens, "rewards": rewards, "old_logprobs": old,
            "mask": torch.ones_like(tokens, dtype=torch.bool), "advantages": group_advantages(rewards, s.group)}


# --- 1. Prop. 4.2's softmax bound: sqrt(N/(N-1)) (1-pi_j) <= ||e_j - pi|| <= sqrt(2) (1-pi_j)


def bound_check(logits: torch.Tensor, chosen: torch.Tensor | None = None, tiny: float = 1e-12) -> dict:
    """The gradient of log softmax(z)[j] w.r.t. z, by autograd in float64, against (1 - pi_j), for rows of
    `logits` (n, N): every j, or only the sampled `chosen` (n,). 1 - pi_j is summed as sum_{k != j} pi_k
    (`1 - pi_j` loses the digits near 1); a token with 1 - pi_j < `tiny` is counted as unresolved."""
    z = logits.detach().double().requires_grad_(True)  # (n, N)
    n, N = z.shape
    cols = torch.arange(N).expand(n, N) if chosen is None else chosen[:, None]  # (n, k)
    onehot = torch.nn.functional.one_hot(cols, N).double()  # (n, k, N)
    grads = torch.autograd.grad(z.log_softmax(-1), z, onehot.permute(1, 0, 2), is_grads_batched=True)[0]  # (k, n, N)
    pi = z.detach().softmax(-1)  # (n, N)
    one_minus = (pi[:, None, :] * (1 - onehot)).sum(-1)  # (n, k)
    ok = one_minus >= tiny  # (n, k)
    ratio = grads.permute(1, 0, 2).norm(dim=-1)[ok] / one_minus[ok]  # (m,)
    lo, hi = math.sqrt(N / (N - 1)), math.sqrt(2)
    excess = torch.cat([lo - ratio, ratio - hi, torch.zeros(1, dtype=torch.float64)])  # (2m+1,)
    resolved = ratio.numel() > 0
    return {"tokens": int(ok.numel()), "unresolved": int((~ok).sum()),
            "ratio_min": float(ratio.min()) if resolved else None,
            "ratio_max": float(ratio.max()) if resolved else None, "bound_lo": lo, "bound_hi": hi,
            "violations": int((excess > 1e-9).sum()), "max_violation": float(excess.max())}


def bound_section(net: ToyLM, batch: dict, s: ToySettings) -> dict:
    """Prop. 4.2 on random softmaxes (vocab 32/64/256, logit scales 0.5-32, plus the two equality cases:
    the rest uniform, or all on one rival) and on the toy's own sampled tokens."""
    gen = torch.Generator().manual_seed(s.seed)
    out = {}
    for N in (32, 64, 256):
        rows = [scale * torch.randn(4, N, generator=gen, dtype=torch.float64) for scale in (0.5, 2.0, 8.0, 32.0)]
        uniform_rest = torch.zeros(1, N, dtype=torch.float64).index_fill(1, torch.tensor([0]), 3.0)  # (1, N)
        one_rival = torch.full((1, N), -60.0, dtype=torch.float64).index_fill(1, torch.tensor([0, 1]), 0.0)
        out[f"random N={N}"] = bound_check(torch.cat(rows + [uniform_rest, one_rival]))
    with torch.no_grad():
        logits = net(batch["prompts"], batch["tokens"]).flatten(0, 1)  # (B*T, V), temperature 1
    out["toy tokens"] = bound_check(logits, batch["tokens"].flatten())
    return out


# --- 2. Figure 1 in miniature, on GRPO batches


def toy_mean_std(rows: list) -> dict:
    """Mean and std over batches/seeds of numbers, lists or dicts of them, elementwise; None/NaN left out."""
    if isinstance(rows[0], dict):
        return {k: toy_mean_std([r[k] for r in rows]) for k in rows[0]}
    t = torch.tensor([[math.nan if v is None else v for v in r] if isinstance(r, list) else r for r in rows],
                     dtype=torch.float64)  # (n, ...)
    ok = ~t.isnan()
    mean = torch.where(ok, t, 0).sum(0) / ok.sum(0)
    std = (torch.where(ok, t - mean, 0) ** 2).sum(0).div((ok.sum(0) - 1).clamp_min(1)).sqrt()
    r = lambda v: None if math.isnan(v) else round(v, 6)  # noqa: E731 (JSON has no NaN)
    return {"mean": [r(v) for v in mean.tolist()] if mean.dim() else r(mean.item()),
            "std": [r(v) for v in std.tolist()] if std.dim() else r(std.item())}


def figure_1(net: ToyLM, rule: torch.Tensor, s: ToySettings) -> dict:
    """A GRPO run from the warm start; measure_bins (as `python lopti.py diagnose`) on `measured_batches` batches
    after `measure_after` steps; mean and std over them."""
    net, cfg = copy.deepcopy(net), toy_config(s, "grpo")
    opt, gen = make_optimizer(net, cfg), torch.Generator().manual_seed(s.seed + 1)
    measured = []
    for step in range(s.measure_after + s.measured_batches):
        batch = toy_rollout(net, rule, s, gen)
        if step >= s.measure_after:
            measured.append(measure_bins(cfg, net, functools.partial(toy_logprobs, net), batch))
        update_policy(cfg, functools.partial(toy_logprobs, net), opt, batch)
    return toy_mean_std(measured)


# --- 3 and 4. Short RL runs of every method from the same warm start: Figure 3 on their own updates; do they learn
# faster?


def learning_runs(net0: ToyLM, rule: torch.Tensor, s: ToySettings, warm_reward: float) -> dict:
    """Reward of each step's rollout batch, per method and seed, and update_counts after each step's update (its
    "fig3": summed over steps, per seed). Seed i gives every method the same first batch. Final reward = mean over
    the last `final_window` steps; the threshold is shared by all methods."""
    threshold = warm_reward + s.threshold_frac * (1 - warm_reward)
    out = {"threshold": round(threshold, 6), "methods": {}}
    for method in TOY_METHODS:
        cfg, curves, fig3 = toy_config(s, method), [], []
        for i in range(s.seeds):
            net = copy.deepcopy(net0)
            opt, gen = make_optimizer(net, cfg), torch.Generator().manual_seed(1000 * (s.seed + 1) + i)
            curve, counts = [], []
            for _ in range(s.steps):
                batch = toy_rollout(net, rule, s, gen)
                curve.append(float(batch["rewards"].mean()))
                update_policy(cfg, functools.partial(toy_logprobs, net), opt, batch)
                with torch.no_grad():
                    new = toy_logprobs(net, batch)  # (B, T)
                counts.append(update_counts(batch["old_logprobs"], new, batch["advantages"], batch["mask"]))
            curves.append(curve)
            fig3.append(pool_update_counts(counts))
        final = [sum(c[-s.final_window:]) / len(c[-s.final_window:]) for c in curves]
        hit = [next((t + 1 for t, r in enumerate(c) if r >= threshold), None) for c in curves]
        out["methods"][method] = {"curve": toy_mean_std(curves), "final": [round(f, 6) for f in final],
                                  "final_stats": toy_mean_std(final), "steps_to_threshold": hit,
                                  "fig3": {**pool_update_counts(fig3), "seeds": [fig3_ratio(c) for c in fig3]}}
    return out


def run_toy(s: ToySettings) -> dict:
    """All four parts of the toy (bound, Fig. 1, Fig. 3 and learning speed) for settings `s`; pure: the result
    depends only on `s` (with torch's thread count fixed by the caller)."""
    net, rule = toy_warm_start(s)
    batch = toy_rollout(net, rule, s, torch.Generator().manual_seed(s.seed))
    warm_reward = float(batch["rewards"].mean())
    pi = batch["old_logprobs"].exp().flatten()  # (B*T,)
    results = {"settings": {**asdict(s), "bins": list(BIN_NAMES)},
               "bound": bound_section(net, batch, s),
               "warm_start": {"reward": round(warm_reward, 6),
                              "pi_histogram_10": torch.histc(pi, bins=10, min=0, max=1).int().tolist()}}
    results["figures"] = figure_1(net, rule, s)
    results["learning"] = learning_runs(net, rule, s, warm_reward)
    return results


def toy_paired(diff: dict, n: int) -> dict:
    """A paired difference's mean +- std over n batches or seeds; 'clear' when |mean| > 2 standard errors."""
    return {"evidence": f"{diff['mean']:+.4f} +- {diff['std']:.4f} (n={n})",
            "clear": n > 1 and abs(diff["mean"]) > 2 * diff["std"] / math.sqrt(n)}


def toy_checks(r: dict) -> list[dict]:
    """The paper's qualitative claims, each marked reproduced or not by the toy's own numbers; comparisons
    between methods also carry their paired spread."""
    f, learn = r["figures"], r["learning"]["methods"]
    nan = lambda xs: [math.nan if x is None else x for x in xs]  # noqa: E731 (an empty bin compares False)
    share, gn = f["token_share"]["all"]["mean"], f["grad_norm"]["bins"]["mean"]
    dpi = {k: nan(v["std"]["mean"]) for k, v in f["prob_change"].items()}  # how far a bin's tokens move
    checks = [{"claim": c, "reproduced": bool(ok)} for c, ok in (
        ("1. the softmax bound holds on every resolved token", all(b["violations"] == 0 for b in r["bound"].values())),
        ("2. token shares are U-shaped (top bin largest, lowest above both middle bins)",
         share[3] == max(share) and share[0] > max(share[1:3])),
        ("2. the lowest bin's gradient norm is the largest of the four", gn[0] == max(gn)),
        ("2. gradient norm falls from the lowest bin to the highest", gn == sorted(gn, reverse=True)),
        ("2. updating only the lowest bin moves every bin more than updating only the highest",
         all(lo > hi for lo, hi in zip(dpi["lowest_only"], dpi["highest_only"]))),
        ("2. the highest bin moves less when it alone is updated than when only the lowest is",
         dpi["highest_only"][3] < dpi["lowest_only"][3]),
    )]
    fig3 = {m: nan(fig3_ratio(v["fig3"])) for m, v in learn.items()}  # pooled over seeds and steps
    checks.append({"claim": "3. GRPO's share of A>0 tokens that rose is lower in the highest bin than the lowest",
                   "reproduced": fig3["grpo"][3] < fig3["grpo"][0]})
    for m in ("ar", "lopti", "ar_lopti", "grpo_2_epochs"):  # paired over seeds, each seed pooled over its steps
        pairs = zip(learn[m]["fig3"]["seeds"], learn["grpo"]["fig3"]["seeds"])
        diff = toy_mean_std([[nan(a)[3] - nan(b)[3]] for a, b in pairs])
        diff = {k: v[0] for k, v in diff.items()}
        checks.append({"claim": f"3. {m} raises the highest bin's share above GRPO's", "reproduced": diff["mean"] > 0,
                       **toy_paired(diff, len(learn[m]["final"]))})
    for m, ref in (("ar", "grpo"), ("lopti", "grpo"), ("ar_lopti", "grpo"), ("lopti", "grpo_2_epochs")):
        diff = toy_mean_std([[a - b] for a, b in zip(learn[m]["final"], learn[ref]["final"])])
        diff = {k: v[0] for k, v in diff.items()}
        checks.append({"claim": f"4. {m} ends with a higher reward than {ref}", "reproduced": diff["mean"] > 0,
                       **toy_paired(diff, len(learn[m]["final"]))})
    return checks


def _atomic_write(path: Path, text: str) -> None:
    """`path` holds its old text or `text`, never a part of it (a full disk leaves the old one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write {path} ({e.strerror or e})") from e
    os.replace(tmp, path)


def _pyplot():
    """matplotlib.pyplot without a display, or None: matplotlib is optional."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save_png(plt, fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bins(axes, r: dict, who: str) -> None:
    """measure_bins' Figure 1 (a) and (d) (`r`) beside the paper's, on two matplotlib axes."""
    x, nan = torch.arange(4).float(), lambda xs: [math.nan if v is None else v for v in xs]  # noqa: E731
    paper, rel = PAPER_FIGURES, lambda g: [v / max(g["all"], 1e-12) for v in g["bins"]]  # noqa: E731
    for ax, ours, theirs, title in ((axes[0], r["token_share"]["all"], paper["token_share"], "token share"), (
            axes[1], rel(r["grad_norm"]), rel(paper["grad_norm"]), "grad norm of one bin / all")):
        ax.bar(x - 0.2, nan(ours), 0.4, label=who)
        ax.bar(x + 0.2, theirs, 0.4, label="paper")
        ax.set(title=f"Fig. 1: {title}", xticks=x, xticklabels=BIN_NAMES)
        ax.legend()


def plot_fig3(ax, table: dict) -> None:
    """Figure 3 as the paper draws it: grouped bars per pi_old bin, one colour per method or run of `table`
    ({label: {"ratio": 4 values, optionally "low"/"high": an interval}}), the paper's values as black markers."""
    width = 0.8 / len(table)
    for i, (label, t) in enumerate(table.items()):
        x = [b - 0.4 + width * (i + 0.5) for b in range(4)]
        y = [math.nan if v is None else v for v in t["ratio"]]
        err = None if "low" not in t else [  # (a percentile interval may exclude its point: no negative bar)
            [max(0, v - lo) if None not in (v, lo) else 0 for v, lo in zip(t["ratio"], t["low"])],
            [max(0, hi - v) if None not in (v, hi) else 0 for v, hi in zip(t["ratio"], t["high"])]]
        ax.bar(x, y, width, yerr=err, capsize=2, color=f"C{i}", label=label)
        if label.split(",")[0] in PAPER_FIGURES["pos_rose"]:
            ax.plot(x, PAPER_FIGURES["pos_rose"][label.split(",")[0]], "k_", ms=12, mew=2)
    ax.plot([], [], "k_", ms=12, mew=2, label="paper (K&K, Qwen2.5-7B)")
    ax.axhline(0.5, c="gray", lw=0.5)
    lowest = min([v for t in table.values() for v in t.get("low", t["ratio"]) if v is not None and v == v] or [0.5])
    ax.set(title="Fig. 3: share of A>0 tokens whose pi rose", xticks=range(4), xticklabels=BIN_NAMES,
           ylim=(min(0.3, lowest - 0.05), 1))
    ax.legend(fontsize=7, loc="lower left")


def plot_toy(r: dict, path: Path) -> None:
    """toy.png: the bound, Fig. 1's token shares and gradient norms, Fig. 3's ratios and the reward curves."""
    plt = _pyplot()
    if plt is None:
        print("matplotlib is not installed: no toy.png (results.json is complete without it)")
        return
    fig, ax = plt.subplots(1, 5, figsize=(22, 4))
    b = r["bound"]["toy tokens"]
    ax[0].bar(["min", "max"], [b["ratio_min"], b["ratio_max"]], color="C0", label="toy tokens")
    ax[0].axhline(b["bound_lo"], ls="--", c="k", label="sqrt(N/(N-1))")
    ax[0].axhline(b["bound_hi"], ls=":", c="k", label="sqrt(2)")
    ax[0].set(title="Prop. 4.2: ||grad|| / (1 - pi)", ylim=(0.9, 1.5))
    ax[0].legend()
    means = lambda t: t["mean"] if "mean" in t else {k: means(v) for k, v in t.items()}  # noqa: E731
    plot_bins(ax[1:3], means(r["figures"]), "toy")
    plot_fig3(ax[3], {METHOD_NAMES[m]: {"ratio": fig3_ratio(v["fig3"])} for m, v in r["learning"]["methods"].items()})
    for i, (m, v) in enumerate(r["learning"]["methods"].items()):
        ax[4].plot(range(1, len(v["curve"]["mean"]) + 1), v["curve"]["mean"], label=m, c=f"C{i}")
    ax[4].axhline(r["learning"]["threshold"], ls="--", c="gray")
    ax[4].set(title="reward per step (mean over seeds)", xlabel="RL step")
    ax[4].legend(fontsize=7)
    _save_png(plt, fig, path)


def toy_main(args: argparse.Namespace) -> dict:
    """`python lopti.py toy`: run the toy, print the checks, write results.json (and toy.png). Only the default
    run, with no setting given, writes to toy/ (the README's figure); any other goes to runs/toy/ unless --out
    says otherwise."""
    given = {f.name: getattr(args, f.name) for f in fields(ToySettings) if hasattr(args, f.name)}
    s = ToySettings(**{**(TOY_QUICK if args.quick else {}), **given})
    Config(seed=s.seed, steps=s.steps, alpha=s.alpha, eta=s.eta)  # the range checks train makes, in one place
    if s.seeds < 1 or s.reward not in ("outcome", "dense") or not 0 <= s.answer_len <= s.response_len:
        raise ValueError(f"seeds must be >= 1, reward 'outcome' or 'dense', answer_len in 0..{s.response_len}; got "
                         f"{s.seeds}, {s.reward!r}, {s.answer_len}")
    out = args.out or (Path("toy") if not given and not args.quick else Path("runs/toy"))
    out.mkdir(parents=True, exist_ok=True)  # a bad --out fails now, not after the run
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # faster for these tiny matrices, and the same float sums on every run
    try:
        results = run_toy(s)
    finally:
        torch.set_num_threads(threads)
    results["settings"]["quick"] = args.quick
    results["checks"] = toy_checks(results)
    for c in results["checks"]:  # every number is in results.json; the README puts them beside the paper's
        spread = f"   {c['evidence']}{'' if c['clear'] else ', within noise'}" if "evidence" in c else ""
        print(f"[{'yes' if c['reproduced'] else 'NO '}] {c['claim']}{spread}")
    _atomic_write(out / "results.json", json.dumps(results, indent=1) + "\n")
    plot_toy(results, out / "toy.png")
    print(f"wrote {out / 'results.json'}; wall time {time.perf_counter() - t0:.1f} s")
    return results


# ====== Knights and Knaves: the paper's task (Logic-RL's data and reward) ======
# Data: the K&K benchmark (github.com/AlphaPav/mem-kk-logic, hub K-and-K/knights-and-knaves) as Logic-RL ships
# it (the official code's data/kk/instruct/); reward: Logic-RL's verl/utils/reward_score/kk.py (also in AR-Lopti).


KK_MAX_REWARD = 3.0  # format +1 and answer +2: accuracy = share of completions scoring exactly this
KK_FORMAT_ERROR = -3.0  # format -1 and the answer is not read (-2)
THINK_PREFIX = "<think>"  # the assistant turn is pre-filled with it; kk_reward expects it in the text
KK_SYSTEM_PROMPT = (  # verbatim from Logic-RL's qwen-instruct prompt, odd spacing ("and<answer>") included
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the mind and "
    "then provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and<answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think><answer> answer here </answer>.  Now the user asks you to solve a logical reasoning problem. "
    "After thinking, when you finally reach a conclusion, clearly state the identity of each character "
    "within <answer> </answer> tags. i.e., <answer> (1) Zoey is a knight\n(2) ... </answer>.\n"
)
KK_NAMES = tuple((  # the benchmark's name list (all 51 occur in the official rows)
    "Emma Liam Olivia Noah Ava Ethan Sophia Mason Isabella William Mia James Charlotte Benjamin Amelia "
    "Lucas Harper Henry Evelyn Alexander Abigail Michael Emily Daniel Elizabeth Jacob Sofia Logan Avery "
    "Jackson Ella Sebastian Scarlett Jack Grace Aiden Chloe Owen Victoria Samuel Riley Matthew Aria "
    "Joseph Lily Luke Aurora David Zoey Oliver Penelope"
).split())
_KK_PREAMBLE = ("A very special island is inhabited only by knights and knaves. "
                "Knights always tell the truth, and knaves always lie. ")
_KK_QUESTION = "So who is a knight and who is a knave?"
_KK_SAYINGS = (  # the benchmark's 18 speech templates, each seen in the official rows
    "{name} said that {content}.", "{name} told you that {content}.", '{name} said, "{content}."',
    '{name} stated, "{content}".', 'According to {name}, "{content}".', "In {name}'s words: \"{content}\".",
    '{name} remarked, "{content}".', '"{content}," {name} declared.', '{name} was heard saying, "{content}".',
    "{name} expressed that {content}.", '"{content}" - {name}.', 'As {name} put it, "{content}".',
    '{name} asserted: "{content}".', '"{content}," {name} mentioned.', '{name} commented, "{content}".',
    'In a statement by {name}: "{content}".', '{name} noted, "{content}".', '"{content}," {name} claimed.',
)
KK_FEATURES = datasets.Features({  # one schema for generated and loaded puzzles
    "quiz": datasets.Value("string"),
    "names": datasets.List(datasets.Value("string")),
    "solution": datasets.List(datasets.Value("bool")),  # True = knight, in the order of `names`
    "solution_text": datasets.Value("string"),
    "solution_text_format": datasets.Value("string"),  # the reward's ground truth
    "statements": datasets.Value("string"),  # the official Python-literal tuple, 0-based person indices
    "num_people": datasets.Value("int64"),
})
_KK_OPS = {"not": (1, 1), "and": (1, None), "or": (1, None), "->": (2, 2), "<=>": (2, 2)}  # (min, max) args


@functools.lru_cache(maxsize=None)
def _kk_knight_masks(n):
    """Bit a of masks[i] is set iff person i is a knight in assignment a (itertools.product order)."""
    # product([True, False], repeat=n) makes person i False exactly when bit n-1-i of the counter is set
    return tuple(sum(1 << a for a in range(2 ** n) if not (a >> (n - 1 - i)) & 1) for i in range(n))


def _kk_truth(stmt, masks, full):
    """Truth of a statement in all 2^n assignments at once, as a bitmask (bit a = true in assignment a)."""
    if not isinstance(stmt, (tuple, list)) or not stmt:
        raise ValueError(f"statement must be a non-empty tuple, got {stmt!r}")
    op, args = stmt[0], stmt[1:]
    if op in ("telling-truth", "lying"):
        if len(args) != 1 or not isinstance(args[0], int) or not 0 <= args[0] < len(masks):
            raise ValueError(f"leaf {stmt!r} needs one person index in 0..{len(masks) - 1}")
        return masks[args[0]] if op == "telling-truth" else full ^ masks[args[0]]
    if op not in _KK_OPS:
        raise ValueError(f"unknown operator {op!r} in {stmt!r}; allowed: telling-truth, lying, {', '.join(_KK_OPS)}")
    lo, hi = _KK_OPS[op]
    if len(args) < lo or (hi is not None and len(args) > hi):
        raise ValueError(f"operator {op!r} got {len(args)} operand(s) in {stmt!r}")
    vals = [_kk_truth(a, masks, full) for a in args]
    if op == "not":
        return full ^ vals[0]
    if op in ("and", "or"):
        return functools.reduce((lambda x, y: x & y) if op == "and" else (lambda x, y: x | y), vals)
    if op == "->":
        return (full ^ vals[0]) | vals[1]
    return full ^ (vals[0] ^ vals[1])  # "<=>"


KK_MAX_PEOPLE = 12  # solving tries all 2^n assignments; the benchmark's puzzles have 2 to 8 people
_KK_MAX_DEPTH = 8  # bracket nesting of a statements string (the benchmark's is 3)


def _kk_parse_statements(statements):
    """The statements tuple from its string (ast.literal_eval: a literal only, never eval, since rows may come
    from anywhere), after a linear-time check of its nesting and size."""
    if isinstance(statements, str):
        depth = 0
        for ch in statements:  # literal_eval of text nested hundreds deep exhausts memory before it fails
            depth += (ch in "([") - (ch in ")]")
            if depth > _KK_MAX_DEPTH:
                raise ValueError(f"statements are nested deeper than {_KK_MAX_DEPTH} brackets")
        statements = ast.literal_eval(statements)
    if not isinstance(statements, (tuple, list)) or not statements:
        raise ValueError(f"statements must be a non-empty tuple of statements, got {str(statements)[:80]!r}")
    if len(statements) > KK_MAX_PEOPLE:
        raise ValueError(f"{len(statements)} statements: at most {KK_MAX_PEOPLE} people per puzzle are supported")
    return statements


def kk_solve(statements):
    """Every consistent knight/knave assignment (True = knight), by brute force over all 2^n, for the official
    statements tuple (one statement per person) or its string. Person i is consistent iff (i is a knight) <=>
    (statement i is true). Assignments come in itertools.product([True, False], repeat=n) order, as the benchmark's."""
    statements = _kk_parse_statements(statements)
    n = len(statements)
    masks, full = _kk_knight_masks(n), (1 << 2 ** n) - 1
    ok = full
    for i, stmt in enumerate(statements):
        ok &= full ^ (masks[i] ^ _kk_truth(stmt, masks, full))  # speaker truthful iff knight
    return [[not (a >> (n - 1 - i)) & 1 for i in range(n)] for a in range(2 ** n) if (ok >> a) & 1]


def _kk_sample_statement(rng, n, speaker):
    """One statement by `speaker`, drawn from the K&K benchmark's grammar (depth 2, width 2)."""
    def leaf():
        """A leaf; the benchmark never lets the speaker call himself a knave, bare or in a compound."""
        while True:
            cand = (rng.choice(("telling-truth", "lying")), rng.randrange(n))
            if cand != ("lying", speaker):
                return cand
    kind = rng.randrange(6)  # 1/6 each: leaf, not, and, or, ->, <=>
    if kind == 0:
        return leaf()
    if kind == 1:
        return ("not", leaf())
    first, second = leaf(), leaf()
    while second == first:  # two distinct operands
        second = leaf()
    return (("and", "or", "->", "<=>")[kind - 2], first, second)


def _kk_leaf_text(names, leaf, negate=False):
    """'X is (not) a knight/knave' for a leaf."""
    role = "a knight" if leaf[0] == "telling-truth" else "a knave"
    return f"{names[leaf[1]]} is {'not ' if negate else ''}{role}"


def _kk_statement_text(names, stmt):
    """The benchmark's English for one statement (depth <= 2)."""
    if stmt[0] not in _KK_OPS:
        return _kk_leaf_text(names, stmt)
    leaves = [_kk_leaf_text(names, s, negate=stmt[0] == "not") for s in stmt[1:]]
    if stmt[0] in ("not", "and", "or"):
        return f" {stmt[0]} ".join(leaves)  # ("not" has one leaf, negated)
    return f"If {leaves[0]} then {leaves[1]}" if stmt[0] == "->" else f"{leaves[0]} if and only if {leaves[1]}"


def _kk_solution_texts(names, solution):
    """(solution_text, solution_text_format) exactly as the official rows write them."""
    parts = [f"{name} is {'a knight' if knight else 'a knave'}" for name, knight in zip(names, solution)]
    text = ", ".join(parts[:-1]) + ", and " + parts[-1] + "."  # the benchmark's ", and" even for two people
    return text, "\n".join(f"({i}) {p}" for i, p in enumerate(parts, 1))


def kk_generate(n, num_people=(3, 7), seed=0):
    """`n` K&K puzzles with exactly one solution, in the official schema (KK_FEATURES). num_people: an int, or an
    inclusive (lo, hi) range drawn per puzzle, within 2..8 (the benchmark's sizes; the paper trains on 3..7).
    Everything comes from random.Random(seed); as in the benchmark, no statement tuple repeats within a call."""
    bounds = (num_people,) * 2 if isinstance(num_people, int) else num_people
    lo, hi = tuple(bounds) if isinstance(bounds, (tuple, list)) and len(bounds) == 2 else (None, None)
    if not (isinstance(lo, int) and isinstance(hi, int) and 2 <= lo <= hi <= 8):
        raise ValueError(f"num_people must be an int or an inclusive (lo, hi) range within 2..8, got {num_people!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    rng, seen, rows = random.Random(seed), set(), []
    for _ in range(n):
        k = rng.randint(lo, hi)
        for _try in range(10_000):  # two-person puzzles run out after a few hundred distinct ones
            statements = tuple(_kk_sample_statement(rng, k, i) for i in range(k))
            if statements not in seen:
                solutions = kk_solve(statements)
                if len(solutions) == 1:
                    break
        else:
            raise ValueError(f"n={n}: only {len(rows)} distinct {k}-person puzzles found; ask for fewer or more people")
        seen.add(statements)
        names = rng.sample(KK_NAMES, k)
        said = " ".join(rng.choice(_KK_SAYINGS).format(name=names[i], content=_kk_statement_text(names, s))
                        for i, s in enumerate(statements))
        quiz = (f"{_KK_PREAMBLE}You meet {k} inhabitants: {', '.join(names[:-1])}, and {names[-1]}. "
                f"{said} {_KK_QUESTION}")
        text, text_format = _kk_solution_texts(names, solutions[0])
        rows.append({"quiz": quiz, "names": names, "solution": solutions[0], "solution_text": text,
                     "solution_text_format": text_format, "statements": repr(statements), "num_people": k})
    return datasets.Dataset.from_list(rows, features=KK_FEATURES)


def _kk_as_tuple(x):
    """Nested lists (JSON has no tuples) as nested tuples, so repr() gives the official string."""
    return tuple(_kk_as_tuple(y) for y in x) if isinstance(x, list) else x


def _word_char(text: str, i: int) -> bool:
    return 0 <= i < len(text) and (text[i].isalnum() or text[i] == "_")  # what \b takes for a word character


def kk_parse_solution(solution_text_format):
    """{name: "knight" | "knave"} from a ground truth like "(1) Amelia is a knight\\n(2) ...", by Logic-RL's parse:
    the first word of letters on each line is the name, the next knight/knave its role."""
    if not isinstance(solution_text_format, str):
        raise ValueError(f"solution_text_format must be a string, got {type(solution_text_format).__name__}")
    roles = {}
    for line in solution_text_format.split("\n"):
        # = re.search(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", line, re.I), Logic-RL's pattern, in linear time
        # (that regex is quadratic in the line's length): the first whole word of letters, then a role after it
        name = next((m for m in re.finditer(r"[A-Za-z]+", line) if not _word_char(line, m.start() - 1)
                     and not _word_char(line, m.end())), None)
        role = name and re.search(r"\b(knight|knave)\b", line[name.end():], re.IGNORECASE)
        if role:
            roles[name.group()] = role.group(1).lower()
    if not roles:
        raise ValueError(f"solution_text_format has no 'NAME is a knight/knave' line: {solution_text_format!r}")
    return roles


def _kk_normalise(row):
    """One loaded row in KK_FEATURES, checked: its statements must have exactly its solution."""
    truth = (row.get("reward_model") or {}).get("ground_truth") or {}  # Logic-RL keeps the answer here
    text_format = row.get("solution_text_format") or truth.get("solution_text_format")
    statements = row.get("statements") or truth.get("statements")
    if not isinstance(row.get("quiz"), str) or not row["quiz"].strip():
        raise ValueError("quiz is missing or empty")
    if not isinstance(statements, str):  # a JSON list of lists; the official form is the tuple's repr
        statements = repr(_kk_as_tuple(statements))
    roles = kk_parse_solution(text_format)
    names, solution = list(roles), [role == "knight" for role in roles.values()]
    for key, value in (("names", names), ("solution", solution)):
        if row.get(key) is not None and list(row[key]) != value:
            raise ValueError(f"{key} {list(row[key])} disagrees with solution_text_format ({value})")
    parsed = _kk_parse_statements(statements)
    if len(parsed) != len(names):
        raise ValueError(f"{len(parsed)} statements for {len(names)} people")
    if kk_solve(parsed) != [solution]:
        raise ValueError(f"statements {statements} do not have the unique solution {solution}")
    text = row.get("solution_text") or _kk_solution_texts(names, solution)[0]
    return {"quiz": row["quiz"], "names": names, "solution": solution, "solution_text": text,
            "solution_text_format": text_format, "statements": statements, "num_people": len(names)}


@functools.lru_cache(maxsize=None)
def hub_reachable(repo_id: str, repo_type: str) -> bool:
    """False when the Hugging Face hub cannot be reached at all (no network, or HF_HUB_OFFLINE=1)."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return False
    try:
        huggingface_hub.HfApi().repo_info(repo_id, repo_type=repo_type, timeout=10)
    except HfHubHTTPError:  # the hub answered (a missing, gated or private repo)
        return True
    except Exception:  # no network, DNS, timeout: the transport's errors differ between hub versions
        return False
    return True


_KK_HUB_NAME = re.compile(r"[\w-]+/[\w.-]+(:[\w.-]+(/[\w.-]+)?)?")
_KK_FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip")


def kk_load(source):
    """K&K puzzles from a local file or the Hugging Face hub, normalised to KK_FEATURES and validated.
    source: a `.parquet`, `.jsonl` or `.json` file in the K&K benchmark's format (quiz, statements,
    solution_text_format, ...) or Logic-RL's (reward_model.ground_truth holds the last two); or a hub dataset
    "OWNER/NAME[:[CONFIG/]SPLIT]" (split "train" by default), e.g. "K-and-K/knights-and-knaves:test/3ppl"."""
    source = str(source)
    if not os.path.exists(source) and _KK_HUB_NAME.fullmatch(source) \
            and not source.split(":")[0].lower().endswith(_KK_FILE_SUFFIXES):
        name, _, sel = source.partition(":")
        config, _, split = sel.rpartition("/")
        if not hub_reachable(name, "dataset"):
            raise ConnectionError(f"kk_load: could not load {source!r}: the Hugging Face hub is not reachable (no"
                                  " network, or HF_HUB_OFFLINE=1); pass a local .parquet/.jsonl file or kk_generate(n)")
        try:
            ds = datasets.load_dataset(name, config or None, split=split or "train")
        except OSError as e:  # a missing repo, config or split
            raise ConnectionError(f"kk_load: could not load {source!r} from the Hugging Face hub "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from e
    else:
        path = Path(source).expanduser()
        builder = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"kk_load: unknown file type {path.suffix!r} for {source!r}; accepted: .parquet, "
                             ".jsonl, .json, or a hub dataset name")
        if not path.is_file():
            raise FileNotFoundError(f"kk_load: no such file: {source!r}")
        with open(path, "rb") as f:
            if not f.read(1 << 16).strip():
                raise ValueError(f"kk_load: {source!r} is empty")
        try:
            import pyarrow.parquet  # (a dependency of datasets) 0-row parquet: datasets' error names nothing
            empty = builder == "parquet" and pyarrow.parquet.read_metadata(path).num_rows == 0
            ds = [] if empty else datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:  # StopIteration, DatasetGenerationError, ArrowInvalid, ... name nothing useful
            cause = e.__cause__ or e
            raise ValueError(f"kk_load: {source!r} is not a readable {path.suffix} file of puzzles "
                             f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})") from e
    if len(ds) == 0:
        raise ValueError(f"kk_load: {source!r} has no rows")
    truth = ds.features.get("reward_model", {})  # Logic-RL: {ground_truth: {...}, style}
    have = set(ds.column_names) | set(truth.get("ground_truth", ()) if isinstance(truth, dict) else ())
    missing = [c for c in ("quiz", "solution_text_format", "statements") if c not in have]
    if missing:
        raise ValueError(f"kk_load: {source!r} lacks column(s) {', '.join(missing)}; accepted formats: the "
                         f"K&K benchmark's (quiz, statements, solution_text_format, ...) or Logic-RL's "
                         f"(quiz + reward_model.ground_truth.{{solution_text_format, statements}})")
    rows = []
    for i, row in enumerate(ds):
        try:
            rows.append(_kk_normalise(row))
        except (ValueError, SyntaxError) as e:  # literal_eval raises either on a malformed string
            raise ValueError(f"kk_load: {source!r} row {i}: {e}") from e
    return datasets.Dataset.from_list(rows, features=KK_FEATURES)


def kk_prompt(tokenizer, quiz):
    """The prompt text for one quiz: apply_chat_template([Logic-RL's system prompt, quiz + "\\n"]) + THINK_PREFIX.
    The "\\n" is Logic-RL's ("{quiz}\\n<|im_end|>"): a Qwen2.5 template reproduces its prompts byte for byte.
    Without a chat template (base models), Logic-RL's plain "User: ... Assistant: <think>" layout, with a warning."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": KK_SYSTEM_PROMPT}, {"role": "user", "content": quiz + "\n"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + THINK_PREFIX
    warnings.warn("kk_prompt: the tokenizer has no chat template, so a plain 'User: ... Assistant:' template "
                  "is used; an instruct model (e.g. Qwen2.5-*-Instruct) is recommended", UserWarning)
    return f"{KK_SYSTEM_PROMPT}\nUser: {quiz}\nAssistant: {THINK_PREFIX}"


_KK_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
KK_ANSWER_END = "</answer>"


def _kk_scan(completion: str) -> tuple[str, list[int], bool]:
    """Logic-RL's view of a completion: the text after its first "Assistant:" (if any), each tag's first position,
    and whether every tag of <think></think><answer></answer> occurs exactly once and in that order."""
    text = completion.split("Assistant:", 1)[-1]
    positions = [text.find(tag) for tag in _KK_TAGS]
    return text, positions, all(text.count(tag) == 1 for tag in _KK_TAGS) and positions == sorted(positions)


def _kk_role_words(answer: str) -> int:
    lowered = answer.lower()
    return lowered.count("knight") + lowered.count("knave")


def _kk_named_role(name: str, answer: str) -> str | None:
    """The role `answer` gives `name` (Logic-RL's pattern, first match), or None."""
    m = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
    return None if m is None else m.group(1).lower()


def kk_reward(completion, solution_text_format):
    """Logic-RL's K&K reward of one completion: 3 (correct), -0.5 (wrong), -1 (unreadable answer), -3.
    `completion` is the assistant text with the pre-filled THINK_PREFIX in front. Format +1 iff each tag
    of <think></think><answer></answer> occurs exactly once and in that order, else -1 and the answer is
    not read (answer -2). Answer (inside <answer>...</answer>): the number of "knight"/"knave" substrings
    must equal the number of people and every name must match r"\\bNAME\\b\\s+is\\s+a\\s+\\b(knight|knave)\\b"
    (case-insensitive, first match), else -2; then +2 if all roles are right, -1.5 if any is wrong. Logic-RL
    scores the text after the first "Assistant:" (its ChatML prompts have none), as _kk_scan does. Never raises
    on model text; a non-string completion scores -3."""
    truth = kk_parse_solution(solution_text_format)
    if not isinstance(completion, str):
        return KK_FORMAT_ERROR
    text, positions, well_formed = _kk_scan(completion)
    if not well_formed:
        return KK_FORMAT_ERROR
    answer = text[positions[2] + len("<answer>"):positions[3]]  # the only <answer> block
    if _kk_role_words(answer) != len(truth):  # an empty answer (Logic-RL checks it first) fails this as well
        return -1.0
    predicted = {name: _kk_named_role(name, answer) for name in truth}
    if None in predicted.values():
        return -1.0
    return KK_MAX_REWARD if predicted == truth else -0.5


def kk_format_credit(completion, solution_text_format) -> float:
    """Partial credit in [0, 1] toward an answer Logic-RL's scorer can read, for the *training* reward only
    (Config.format_reward; not in the paper or the official code, whose 3B model formats without help).
    Half for the tags: 1/8 for each of </think>, <answer>, </answer> once, 1/8 for all four once and in order.
    Half for the share of people named "NAME is a knight|knave" after the first <answer> (up to </answer>),
    nothing if it holds more role words than people: empty tags earn 0.5 at most, so naming everyone pays."""
    names = list(kk_parse_solution(solution_text_format))
    if not isinstance(completion, str):
        return 0.0
    text, _, well_formed = _kk_scan(completion)
    credit = sum(text.count(tag) == 1 for tag in _KK_TAGS[1:]) / 8 + well_formed / 8
    start = text.find("<answer>")
    answer = "" if start < 0 else text[start + len("<answer>"):].split("</answer>", 1)[0]
    if _kk_role_words(answer) <= len(names):
        credit += 0.5 * sum(_kk_named_role(name, answer) is not None for name in names) / len(names)
    return credit


def load_task_data(cfg: Config):
    """Training rows and evaluation rows (evaluation puzzles never appear in training)."""
    lo, hi = _people_range(cfg.num_people)
    train = (kk_generate(cfg.num_train, (lo, hi), seed=cfg.seed) if cfg.train_data == "generate"
             else kk_load(cfg.train_data))
    if cfg.eval_data == "generate":
        evals = datasets.concatenate_datasets([kk_generate(cfg.eval_size, n, seed=cfg.seed + 1_000_003 + n)
                                      for n in range(lo, hi + 1)])
    else:
        evals = kk_load(cfg.eval_data)
    seen = set(train["quiz"])
    evals = evals.filter(lambda row: row["quiz"] not in seen)
    if len(train) == 0:
        raise ValueError(f"the training set {cfg.train_data!r} has no rows")
    if len(evals) == 0:
        raise ValueError("the evaluation set is empty once training puzzles are removed: use other --eval_data")
    return train, evals


def kk_rewards(completions: list[str], solutions: list[str], format_reward: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one reward path of training, evaluation and TRL: for completions as generated after the pre-filled
    THINK_PREFIX, Logic-RL's reward (B,), which judges every run, and the training reward (B,), which adds
    `format_reward` * kk_format_credit (Config.format_reward; 0, the paper's setting, adds nothing)."""
    texts = [THINK_PREFIX + c for c in completions]
    rewards = torch.tensor([kk_reward(t, s) for t, s in zip(texts, solutions)], dtype=torch.float32)  # (B,)
    if not format_reward:
        return rewards, rewards
    credit = torch.tensor([kk_format_credit(t, s) for t, s in zip(texts, solutions)], dtype=torch.float32)  # (B,)
    return rewards, rewards + format_reward * credit


# ====== LLM run: a Hugging Face causal LM on K&K, rollout -> reward -> advantage -> pi_old -> update ======


# --- model I/O and rollout (Algorithm 1, lines 3-5: sample G responses, score them, pi_old)


def pick_device() -> torch.device:
    """cuda -> mps -> cpu."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")


def has_bf16(device: torch.device) -> bool:
    """A GPU with native bf16 (a T4 emulates it: fp32 there). LOPTI_CPU_BF16=1 takes the bf16 path on CPU, whose
    autocast has bf16, so that the tests reach the GPU's code path."""
    if device.type == "cpu":
        return os.environ.get("LOPTI_CPU_BF16") == "1"
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def autocast(device: torch.device, enabled: bool = True):
    """bf16 autocast where the GPU has bf16, fp32 elsewhere. The trained parameters (and AdamW's state) stay
    fp32: at lr 1e-6 an update is below bf16's resolution, so bf16 weights would barely move."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and has_bf16(device))


def _check_model_name(name: str, hint: str = "") -> Path | None:
    """The local folder `name` names, None for a hub id; an error, before anything is loaded, for a path
    that is not a model folder or that holds a malformed file (a JSON file that does not parse, a torn safetensors)."""
    path = Path(name).expanduser()
    if not (path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1):
        return None
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model folder at {name!r} (a folder written by save_pretrained, with a "
                                f"config.json); pass such a folder or a hub id such as Qwen/Qwen2.5-0.5B-Instruct{hint}")
    from safetensors import safe_open
    for file in sorted(path.iterdir()):
        try:
            if file.suffix == ".json":
                json.loads(file.read_text())
            elif file.suffix == ".safetensors":  # its header must cover the file exactly: a torn copy fails here
                with safe_open(str(file), "pt"):
                    pass
        except Exception as e:  # JSONDecodeError, UnicodeDecodeError, SafetensorError, ...
            raise ValueError(f"{file} is malformed ({' '.join(str(e).split())[:150]}); restore it, or pass another "
                             "model folder") from None
    return path


WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(name: str) -> dict | None:
    """What identifies a model wherever its folder is: its config.json without paths and, per weights file, its name,
    size and the SHA-256 of its first MiB (a safetensors header: every tensor's name, dtype and shape) and of 64 KiB
    at 64 places through it. None for a hub id that is not in the local cache."""
    folder = _check_model_name(name)
    if folder is None:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(name, "config.json")
        if not isinstance(found, str):
            return None
        folder = Path(found).parent
    config = json.loads((folder / "config.json").read_text())
    weights = {}
    for path in sorted(p for p in folder.iterdir() if p.suffix in WEIGHTS_SUFFIXES):
        size, digest = path.stat().st_size, hashlib.sha256()
        with open(path, "rb") as f:
            for i in range(65):
                f.seek(i * size // 65)
                digest.update(f.read(2**16 if i else 2**20))
        weights[path.name] = [size, digest.hexdigest()]
    return {"config": {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")},
            "weights": weights}


def _from_pretrained(cls, name: str, **kwargs):
    path = _check_model_name(name)
    if path is not None:
        return cls.from_pretrained(str(path), **kwargs)
    online = hub_reachable(name, "model")
    try:  # offline, only a cached copy can load: at once, instead of half a minute of retries
        return cls.from_pretrained(name, local_files_only=not online, **kwargs)
    except OSError as e:
        why = "the hub did not serve it (check the id)" if online else "the Hugging Face hub is not reachable " \
              "and it is not in the local cache"
        raise OSError(f"could not load {name!r}: there is no local folder of that name and {why}; offline, pass a "
                      "local folder written by save_pretrained") from e


def load_model(name: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A causal LM with PyTorch SDPA attention and dropout off, from a local folder or the hub."""
    from transformers import AutoModelForCausalLM
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, attn_implementation="sdpa")
    for module in model.modules():  # dropout would make the first ratio != 1
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model.to(device)


def load_tokenizer(name: str):
    """The model's tokenizer, left-padding (for generate), with a pad token (EOS if it has none)."""
    from transformers import AutoTokenizer
    tokenizer = _from_pretrained(AutoTokenizer, name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # masks are built from positions, so pad == EOS is safe
    return tokenizer


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the generation config's EOS ids (Qwen has two) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def completion_mask(completions: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of the response tokens, built from positions: up to and including the first EOS.
    Returns (mask (B, C) bool, truncated (B,) bool: no EOS at all). Building it from token values instead
    (`tokens != pad`) drops the generated EOS when pad == EOS, and the model never learns to stop.
    Example, EOS = 2 = pad: [[5, 7, 2, 2, 2], [5, 2, 9, 2, 2], [5, 7, 8, 9, 6]]
        -> mask [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], truncated [F, F, T]"""
    is_eos = torch.isin(completions, torch.tensor(eos_ids, device=completions.device))  # (B, C)
    truncated = ~is_eos.any(dim=1)  # (B,)
    # the number of EOS strictly before each position: 0 means "not yet stopped"
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # (B, C)
    return eos_before == 0, truncated


def _distinct_rows(x: torch.Tensor) -> int:
    return len(torch.unique(x, dim=0))


def _checkpointing(model) -> bool:
    name = "is_activation_checkpointing"  # transformers 5; 4.x calls it is_gradient_checkpointing
    return bool(getattr(model, name if hasattr(type(model), name) else "is_gradient_checkpointing", False))


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decoder_and_head(model):
    """A causal LM's decoder (HF's base_model: its last hidden state is after the final norm) and output layer, so
    that model(x).logits == head(decoder(x).last_hidden_state); models that rescale logits after it are refused."""
    text = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):  # Gemma 2/3, Cohere, Granite
        if getattr(text, name, None) not in (None, 1):
            raise ValueError(f"{type(model).__name__} rescales its logits ({name}); lopti's chunked log-probs need "
                             "logits that are the output layer's (as Qwen2's and Llama's are)")
    return model.base_model, model.get_output_embeddings()


def prefix_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The KV cache of left-padded prefixes (B, L), computed once per distinct row (the G rows of a group share
    their prompt) and indexed back to all B rows, differentiably; and their last position's final hidden state
    (B, 1, H)."""
    L = input_ids.shape[1]
    rows, inverse = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)  # (U, 2L)
    out = decoder_and_head(model)[0](input_ids=rows[:, :L], attention_mask=rows[:, L:], use_cache=True,
                                     position_ids=(rows[:, L:].long().cumsum(-1) - 1).clamp_min(0))
    cache = out.cache if "cache" in out else out.past_key_values  # transformers 5 renamed it
    cache.batch_select_indices(inverse)
    return cache, out.last_hidden_state[inverse, -1:]


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion: int,
                      temperature: float) -> torch.Tensor:
    """log pi(o_t) at temperature T for the last `num_completion` tokens of left-padded rows: (B, C).
    Position ids come from the attention mask, as generate() computed them, so a left-padded row scores
    exactly as it would alone (models with absolute positions are wrong without them). The decoder runs once and
    token_logprobs applies the output layer to the C hidden states that predict the completion, in chunks, so the
    (B, C, V) logits never exist whole (in the update either: each chunk is recomputed in backward). Rows that share
    a prompt (a GRPO group) run it once: its KV cache is computed for each distinct prompt and indexed for every row,
    which skips G - 1 of every G prompt forwards (and their backward); the log-probs agree with one forward per row
    to float rounding (tested)."""
    C = num_completion
    decoder, head = decoder_and_head(model)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L)
    targets = input_ids[:, -C:]  # (B, C)
    # the prompt's cache is not shared when training with checkpointing (HF drops the cache) or for C = 1
    if C == 1 or _distinct_rows(input_ids[:, :-C]) == len(input_ids) or (_checkpointing(model) and model.training):
        hidden = decoder(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                         position_ids=position_ids[:, :-1], use_cache=False).last_hidden_state[:, -C:]  # (B, C, H)
    else:
        cache, first = prefix_cache(model, input_ids[:, :-C], attention_mask[:, :-C])  # first: (B, 1, H) predicts o_1
        rest = decoder(input_ids=targets[:, :-1], attention_mask=attention_mask[:, :-1],
                       position_ids=position_ids[:, -C:-1], **{_cache_kwarg(decoder): cache}).last_hidden_state
        hidden = torch.cat([first, rest], 1)  # (B, C, H): position t predicts o_{t+1}
    return token_logprobs(hidden, targets, temperature, head=head)  # (B, C)


def cut_at(tokenizer, completions: torch.Tensor, mask: torch.Tensor, stop: str) -> tuple[torch.Tensor, torch.Tensor]:
    """End each row's completion `mask` (B, C) at the token that completes the text `stop`, as generate's
    stop_strings does; the tokens after it are padding. Returns (mask (B, C), stopped (B,) bool)."""
    mask, stopped = mask.clone(), torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    for i, row in enumerate(completions.tolist()):
        pieces = tokenizer.batch_decode([[t] for t in row[: int(mask[i].sum())]])
        at = "".join(pieces).find(stop)
        if at >= 0:
            ends = torch.tensor([len(p) for p in pieces]).cumsum(0)  # text length after each token
            mask[i, int((ends < at + len(stop)).sum()) + 1:] = False
            stopped[i] = True
    return mask, stopped


@torch.no_grad()
def rollout(model, tokenizer, prompts: list[str], cfg: Config, device: torch.device, greedy: bool = False):
    """Sample one completion per prompt (repeat prompts for groups) from pi_old at `cfg.temperature`.
    Sampling is plain softmax(z / T): no top-k, top-p or repetition penalty from the model's generation
    config, because pi_old must be the distribution the tokens were drawn from. Returns a dict with the
    left-padded prompt + completion `input_ids` and `attention_mask` (B, P + C), the completion `mask`
    (B, C), `truncated` (B,) and the decoded completion `texts`."""
    from transformers import GenerationConfig
    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    eos_ids = eos_token_ids(model, tokenizer)
    # Every knob that reshapes the distribution is "off" (Qwen's generation config has top_p 0.8, top_k 20,
    # repetition_penalty 1.05); transformers 4.50-4.57 replace a field passed at its library default by the model's
    # own value, so the model's config is swapped for this one during generate.
    sampling = {} if greedy else dict(temperature=cfg.temperature, top_k=0, top_p=1.0)
    gen_cfg = GenerationConfig(do_sample=not greedy, repetition_penalty=1.0, max_new_tokens=cfg.max_completion_length,
                               eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, **sampling,
                               stop_strings=[KK_ANSWER_END] if cfg.stop_at_answer else None)
    model_gen_cfg, model.generation_config = model.generation_config, gen_cfg
    chunk = cfg.generation_batch_size or len(prompts)
    parts = []
    try:
        for i in range(0, len(prompts), chunk):  # chunks bound the KV cache's memory
            ids, att = enc["input_ids"][i : i + chunk], enc["attention_mask"][i : i + chunk]  # (b, P)
            with autocast(device):
                shared = {}
                if _distinct_rows(ids) < len(ids):  # a group's prompt is run once, not G times
                    shared[_cache_kwarg(model)] = prefix_cache(model, ids[:, :-1], att[:, :-1])[0]
                out = model.generate(input_ids=ids, attention_mask=att, generation_config=gen_cfg,
                                     tokenizer=tokenizer, **shared)  # (b, P + C_i); no token_type_ids (4.x adds them)
            parts.append(out[:, enc["input_ids"].shape[1]:])  # (b, C_i)
    finally:
        model.generation_config = model_gen_cfg
    C = max(p.shape[1] for p in parts)
    completions = torch.cat([torch.nn.functional.pad(p, (0, C - p.shape[1]), value=tokenizer.pad_token_id)
                             for p in parts])  # (B, C); a chunk that stopped early is padded after its EOS
    out = torch.cat([enc["input_ids"], completions], dim=1)  # (B, P + C)
    mask, truncated = completion_mask(completions, eos_ids)  # (B, C), (B,)
    if cfg.stop_at_answer:
        mask, stopped = cut_at(tokenizer, completions, mask, KK_ANSWER_END)
        truncated &= ~stopped
    texts = tokenizer.batch_decode(torch.where(mask, completions, tokenizer.pad_token_id), skip_special_tokens=True)
    attention_mask = torch.cat([enc["attention_mask"], torch.ones_like(completions)], dim=1)  # (B, P + C)
    return {"input_ids": out, "attention_mask": attention_mask, "mask": mask, "truncated": truncated, "texts": texts}


def completion_logprobs(model, micro: dict, temperature: float) -> torch.Tensor:
    """sequence_logprobs of a micro-batch's completions (b, C), run only up to its longest completion (`mask`): the
    columns after it are padding in every row and get 0. Exact (attention is causal), and one long completion in the
    batch no longer makes every micro-batch pay for it."""
    C, cols = micro["mask"].shape[1], micro["mask"].any(0).nonzero()
    c = int(cols[-1]) + 1 if len(cols) else 1
    end = micro["input_ids"].shape[1] - C + c
    lp = sequence_logprobs(model, micro["input_ids"][:, :end], micro["attention_mask"][:, :end], c, temperature)
    return torch.nn.functional.pad(lp, (0, C - c))  # (b, C)


@torch.no_grad()
def batched_logprobs(model, batch: dict, cfg: Config, device: torch.device, rows: torch.Tensor | None = None,
                     fp32: bool = False) -> torch.Tensor:
    """No-grad log-probs of the completions, micro-batched: pi_old right after rollout, or the reference.
    Only the `rows` ((B,) bool) are computed if given; the others are left at 0, as are the columns after each
    micro-batch's longest completion. `fp32`: no bf16 autocast. Returns (B, C) float32."""
    model.eval()
    B, C = batch["mask"].shape
    out = torch.zeros(B, C, device=batch["mask"].device)  # (B, C)
    index = torch.arange(B) if rows is None else rows.nonzero().squeeze(1).cpu()
    for micro in index.split(cfg.micro_batch_size) if len(index) else ():  # an empty tensor splits into one empty part
        with autocast(device, not fp32):
            micro_batch = {k: batch[k][micro] for k in ("input_ids", "attention_mask", "mask")}
            out[micro] = completion_logprobs(model, micro_batch, cfg.temperature)
    return out


# --- evaluation (greedy accuracy per number of people, as in the paper's K&K table)


def evaluate(model, tokenizer, rows, cfg: Config, device: torch.device, gather: Callable = list) -> dict[str, float]:
    """Greedy decoding on K&K rows; accuracy (share of reward == 3) and mean reward per number of people. Under
    `accelerate launch` each process decodes its share of the rows and `gather` joins the lists (train_trl)."""
    rewards, sizes = [], []
    for i in range(0, len(rows), cfg.eval_batch_size):
        chunk = rows[i : i + cfg.eval_batch_size]
        batch = rollout(model, tokenizer, [kk_prompt(tokenizer, q) for q in chunk["quiz"]], cfg, device, greedy=True)
        rewards += kk_rewards(batch["texts"], chunk["solution_text_format"])[0].tolist()
        sizes += [len(names) for names in chunk["names"]]
    rewards, sizes = gather(rewards), gather(sizes)
    out = {"eval/accuracy": rewards.count(KK_MAX_REWARD) / max(len(rewards), 1)}
    for n in sorted(set(sizes)):
        r = [x for x, k in zip(rewards, sizes) if k == n]
        out.update({f"eval/accuracy_{n}ppl": r.count(KK_MAX_REWARD) / len(r), f"eval/reward_{n}ppl": sum(r) / len(r)})
    return out


def evaluate_model(cfg: Config) -> dict[str, float]:
    """`python lopti.py eval`: the puzzles are read first, so a bad --eval_data fails before the model loads."""
    _check_model_name(cfg.model)
    rows = load_task_data(cfg)[1] if cfg.eval_data == "generate" else kk_load(cfg.eval_data)
    device = pick_device()
    model, tokenizer = load_model(cfg.model, device), load_tokenizer(cfg.model)
    return _on_oom("evaluation", "--eval_batch_size", evaluate, model, tokenizer, rows, cfg, device)


# --- the training loop, checkpoints and resume


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory in GiB: on CUDA the allocator's reserved peak (what runs out) since the previous call, which resets
    it (in train_step: this step and the previous one's evaluation); elsewhere the process's lifetime peak resident size."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    import resource  # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def _on_oom(phase: str, lower: str, fn: Callable, *args):
    """fn(*args); running out of GPU or CPU memory (a MemoryError, torch's "can't allocate memory") becomes one line
    naming the phase and the setting to lower, before anything is saved: the last checkpoint stays as it was. The
    failed call's tensors are freed first; its traceback is kept (without their frames' variables) for --debug."""
    try:
        return fn(*args)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "can't allocate memory" not in str(e):
            raise
        oom = e  # raised below, outside `except`, whose __context__ would keep the failed call's frames alive
    traceback.clear_frames(oom.__traceback__)
    torch.cuda.empty_cache()  # (a no-op where CUDA was never used)
    raise MemoryError(f"out of {'GPU' if isinstance(oom, torch.OutOfMemoryError) else 'CPU'} memory in the {phase}; "
                      f"lower {lower}, then continue with --resume (the last checkpoint is intact), or start a new "
                      "--output_dir with a lower --max_completion_length") from oom


def train_step(cfg: Config, model, ref_model, tokenizer, optimizer, rows: dict, device: torch.device,
               measure: bool = False) -> dict:
    """One RL step (Algorithm 1) on a batch of K&K rows; returns its metrics, and under "samples" the first
    prompt's G completions with their Logic-RL rewards (train() writes them to samples.jsonl). With `measure`,
    measure_bins' Figure 1 at the step's weights under "diagnose"; without an optimizer, no update."""
    G = cfg.num_generations
    t0 = time.perf_counter()
    prompts = [kk_prompt(tokenizer, quiz) for quiz in rows["quiz"] for _ in range(G)]
    batch = _on_oom("rollout", "--generation_batch_size", rollout, model, tokenizer, prompts, cfg, device)
    t1 = time.perf_counter()  # (rollout's decoded texts waited for a GPU)
    solutions = [sol for sol in rows["solution_text_format"] for _ in range(G)]
    rewards, trained = kk_rewards(batch["texts"], solutions, cfg.format_reward)  # (B,) Logic-RL's, (B,) training
    lengths = batch["mask"].sum(1).float()  # (B,) generated tokens, truncated completions included
    if cfg.mask_truncated:
        batch["mask"] = batch["mask"] & ~batch["truncated"].unsqueeze(1)
    batch["advantages"] = group_advantages(trained, G).to(device)  # (B,)
    needed = rows_with_gradient(batch["advantages"], cfg.beta)  # (B,) the rows read
    batch["old_logprobs"] = _on_oom("pi_old pass", "--micro_batch_size", batched_logprobs, model, batch, cfg, device,
                                    needed)  # (B, C), fixed for this step
    if ref_model is not None:
        batch["ref_logprobs"] = _on_oom("reference pass", "--micro_batch_size", batched_logprobs, ref_model, batch,
                                        cfg, device, needed)
    # Figure 3 of this step's update (update_counts) compares pi before and after it by the pass over pi_old's rows
    # and micro-batches, so that an unmoved token compares equal. In fp32 where training runs in bf16, whose rounding
    # (0.4 %) exceeds what an update at lr 1e-6 moves a token: then "before" is one more pass.
    fig3, fp32 = optimizer is not None and cfg.measure_update, has_bf16(device)

    def fig3_pass() -> torch.Tensor:  # (B, C)
        return _on_oom("update measurement", "--micro_batch_size (or --measure_update false)", batched_logprobs,
                       model, batch, cfg, device, needed, fp32)

    t_before = time.perf_counter()
    before = fig3_pass() if fig3 and fp32 else batch["old_logprobs"]  # (B, C)
    t_before = time.perf_counter() - t_before
    if device.type == "cuda":  # CUDA runs asynchronously: wait for the passes, or their time lands in the update's
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()

    def logprob_fn(micro: dict) -> torch.Tensor:
        with autocast(device):
            return completion_logprobs(model, micro, cfg.temperature)

    model.train()  # for gradient checkpointing; dropout is off (load_model)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "truncated"}
    # measure_bins' forwards in fp32 even where training runs in bf16: a probe's step is far below bf16's resolution
    fp32_logprobs = functools.partial(completion_logprobs, model, temperature=cfg.temperature)
    diag = {"diagnose": _on_oom("diagnose measurement", "--micro_batch_size (or --diagnose_every 0)", measure_bins,
                                cfg, model, fp32_logprobs, tensors)} if measure else {}
    t3 = time.perf_counter()
    stats = _on_oom("update", "--micro_batch_size (or set --gradient_checkpointing true)", update_policy, cfg,
                    logprob_fn, optimizer, tensors) if optimizer else {}
    if fig3:  # (a step without advantages logs zeros)
        t4 = time.perf_counter()
        stats.update(update_counts(before, fig3_pass(), batch["advantages"], batch["mask"], batch["old_logprobs"]))
        stats["time/measure"] = time.perf_counter() - t4 + t_before  # (tolist() waited for a GPU)
    grouped = trained.view(-1, G)
    return {
        "reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "accuracy": (rewards == KK_MAX_REWARD).float().mean().item(),
        "format_error": (rewards == KK_FORMAT_ERROR).float().mean().item(),
        "format_credit": ((trained - rewards) / cfg.format_reward).mean().item() if cfg.format_reward else None,
        "zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean().item(),
        "completion_length": lengths.mean().item(), "truncated": batch["truncated"].float().mean().item(),
        "learning_rate": cfg.learning_rate, **stats, **diag,
        "time/rollout": t1 - t0, "time/logprobs": t2 - t1 - t_before, **({"time/diagnose": t3 - t2} if measure else {}),
        "gen_tokens_per_s": lengths.sum().item() / max(t1 - t0, 1e-9), "peak_memory_gb": peak_memory_gb(device),
        "samples": [{"reward": r, "completion": THINK_PREFIX + t}
                    for r, t in zip(rewards[:G].tolist(), batch["texts"])],
    }


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The shuffled row order of one data epoch; a pure function of (seed, epoch), so resuming replays it."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_rows, generator=g).tolist()


def step_rows(num_rows: int, cfg: Config, step: int) -> list[int]:
    """Row indices of the prompts of RL step `step` (0-based): consecutive slices of the epoch orders."""
    first, last = step * cfg.prompts_per_step, (step + 1) * cfg.prompts_per_step  # positions in the data stream
    orders = {e: epoch_order(num_rows, cfg.seed, e) for e in range(first // num_rows, (last - 1) // num_rows + 1)}
    return [orders[i // num_rows][i % num_rows] for i in range(first, last)]


# Checkpoints: <output_dir>/checkpoint/ holds the latest one. A new one is written to checkpoint.tmp/ and
# renamed over the old one only when complete, so a crash mid-save never leaves a broken latest checkpoint.


def save_checkpoint(cfg: Config, model, tokenizer, optimizer, step: int, base_model: dict | None = None) -> Path:
    """`base_model`: model_fingerprint(cfg.model), by which --resume accepts the base model at a new place."""
    out = Path(cfg.output_dir)
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    if old.exists() and not final.exists():  # a crash between the two renames below: restore first
        old.rename(final)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng, "config": asdict(cfg),
                    "base_model": base_model}, tmp / "trainer_state.pt")
    except Exception as e:  # torch's and safetensors' write errors do not carry the errno: a full disk has no space
        full = getattr(e, "errno", None) == errno.ENOSPC or shutil.disk_usage(out).free < 2**20
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise OSError(f"the disk is full: step {step} was not saved (the last checkpoint is intact); free "
                          "space, then continue with --resume") from e
        raise
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)  # the commit point
    shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str) -> Path | None:
    """The latest complete checkpoint (a crash between the two renames leaves it in checkpoint.old/)."""
    for name in ("checkpoint", "checkpoint.old"):
        path = Path(output_dir) / name
        if (path / "trainer_state.pt").exists():
            return path
    return None


def _flatten(record: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}."""
    return {k: v for key, value in record.items() for k, v in (_flatten(value, f"{prefix}{key}/").items() if
            isinstance(value, dict) else [(f"{prefix}{key}", value)])}


def _strict(value):
    """`value` with every NaN or inf, also inside lists and dicts, as None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return {k: _strict(v) for k, v in value.items()} if isinstance(value, dict) else value


def append_jsonl(path: Path, record: dict) -> None:
    """One strict-JSON line, nested dicts flattened (a NaN or inf value is written as null), flushed. A line torn by
    a full disk stops the run; read_jsonl skips it and --resume drops it."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(_strict(_flatten(record)), allow_nan=False) + "\n")
            f.flush()
    except OSError as e:
        raise OSError(f"cannot write {path} ({e.strerror or e}); free space, then continue with --resume (the last "
                      "checkpoint is intact)") from e


def read_jsonl(path: Path) -> list[dict]:
    """The records of a metrics.jsonl/samples.jsonl file; a line torn by a crash mid-write is skipped."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return [r for r in records if isinstance(r, dict)]


def _saved_config(out: Path, flag: str = "--resume") -> dict:
    """The settings the run in `out` was trained with (its config.json), for --resume and diagnose --checkpoint."""
    path = out / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: {path} not found; is {out} the run's folder?")
    try:
        return asdict(Config(**json.loads(path.read_text())))
    except (ValueError, TypeError) as e:  # not JSON or not text, a bad value, a field of another version or a model's
        raise ValueError(f"{flag}: {path} is not a config.json of a run of this lopti.py ({e})") from None


def _check_output_folder(out: Path) -> None:
    """An --output_dir is a folder (or none yet) that holds no model (a hub model's copy, a run's checkpoint/): lopti
    would mix its files with the model's, and a run's config.json would replace the model's."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--output_dir {out} is a file; choose a folder")
    found = [p.name for p in sorted(out.glob("*")) if p.suffix in WEIGHTS_SUFFIXES]
    with contextlib.suppress(OSError, ValueError, TypeError):
        found += ["config.json with a model_type"] * ("model_type" in json.loads((out / "config.json").read_text()))
    if found:
        raise FileExistsError(f"--output_dir {out} holds a model ({found[0]}); choose a folder of its own")


def _check_new_run_folder(out: Path, hint: str = "") -> None:
    """A new run's --output_dir: no model and no other run's files (nor a config.json lopti would replace)."""
    _check_output_folder(out)
    found = [f for f in ("metrics.jsonl", "samples.jsonl", "checkpoint", "checkpoint.old", "config.json")
             if (out / f).exists()]
    if found:
        raise FileExistsError(f"{out}/ holds another run ({found[0]}); {hint}choose another --output_dir")


# What --resume may change: schedule, evaluation, the measurement (it restores the weights), memory (the same steps to
# float rounding; other random draws for generation_batch_size), the folder's place and the base model's (the same
# files: model_fingerprint); and the learning rate, to continue a run that diverged (metrics.jsonl logs it per step).
RESUME_MAY_CHANGE = ("steps", "eval_every", "save_every", "eval_data", "eval_size", "eval_batch_size", "diagnose_every",
                     "micro_batch_size", "generation_batch_size", "gradient_checkpointing", "output_dir", "model",
                     "learning_rate", "measure_update")


def _resume_check(cfg: Config, out: Path, saved: dict, step: int, ckpt: Path | None, write: bool = True,
                  may_change: tuple = RESUME_MAY_CHANGE) -> None:
    """--resume (both engines): refuses `cfg` if it differs from the run's `saved` settings outside `may_change`
    or if the checkpoint `ckpt` is at a `step` past cfg.steps; then drops the lines logged after `step`."""
    changed = [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in saved.items()
               if k not in may_change and v != getattr(cfg, k)]
    if changed:
        raise ValueError(f"--resume: {out}/ was trained with other settings ({', '.join(changed)}); a resumed "
                         f"run may change only {', '.join(may_change)}: start a new --output_dir")
    if step > cfg.steps:
        raise ValueError(f"--resume: {ckpt} is at step {step}, past --steps {cfg.steps}")
    for path in (out / "metrics.jsonl", out / "samples.jsonl") if write else ():  # (and a line torn mid-write)
        if path.exists():
            keep = [r for r in read_jsonl(path) if isinstance(r.get("step"), int) and r["step"] <= step]
            _atomic_write(path, "".join(json.dumps(r) + "\n" for r in keep))


def _resume_point(cfg: Config, out: Path, saved: dict) -> tuple[Path | None, dict]:
    """--resume: loads the latest checkpoint's trainer state (step 0 without one), then _resume_check."""
    ckpt, state = latest_checkpoint(cfg.output_dir), {"step": 0}
    if ckpt is None and ((out / "checkpoint").is_dir() or any(out.glob("checkpoint-*"))):
        raise ValueError(f"--resume: {out}/ is a run of --engine trl (no trainer_state.pt): resume it with "
                         "--engine trl")
    if ckpt:
        try:  # tensors and plain data only: a checkpoint folder from elsewhere cannot run code
            state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
            if not isinstance(state, dict) or not isinstance(state.get("step"), int):
                raise ValueError("not a trainer state of lopti")
        except Exception as e:  # pickle.UnpicklingError (code in it), or a torn or foreign file
            raise ValueError(f"--resume: {ckpt / 'trainer_state.pt'} cannot be loaded safely "
                             f"({' '.join(str(e).split())[:200]})") from e
        _check_model_name(str(ckpt))  # its files parse (a torn copy is named now, before anything is loaded)
        moved = cfg.model != saved["model"]
        if moved or (cfg.beta > 0 and state.get("base_model")):  # the base model is read again: the same files?
            now = model_fingerprint(cfg.model)
            if (now or moved) and now != state.get("base_model"):
                raise ValueError(f"--resume: --model {cfg.model} is not the model {out}/ was trained from "
                                 f"({saved['model']}, whose files its checkpoint records); pass that model's folder")
    _resume_check(cfg, out, saved, state["step"], ckpt)
    return ckpt, state


def _run_objects(cfg: Config, ckpt: Path | None, state: dict):
    """Device, training and evaluation rows, tokenizer, policy, frozen reference (beta > 0), optimiser and the base
    model's fingerprint."""
    device, source = pick_device(), str(ckpt) if ckpt else cfg.model
    torch.manual_seed(cfg.seed)
    train_rows, eval_rows = load_task_data(cfg)
    tokenizer = load_tokenizer(source)  # before the model: a folder without a tokenizer fails at once
    model = load_model(source, device)
    ref_dtype = torch.bfloat16 if has_bf16(device) else torch.float32  # frozen: bf16 halves its memory
    ref_model = load_model(cfg.model, device, ref_dtype).eval().requires_grad_(False) if cfg.beta > 0 else None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = make_optimizer(model, cfg)
    if ckpt:
        try:
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"]["cpu"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"--resume: {ckpt / 'trainer_state.pt'} does not fit {ckpt}'s model ({e})") from e
        for group in optimizer.param_groups:  # --resume may lower it
            group["lr"] = cfg.learning_rate
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    base_model = state.get("base_model") or model_fingerprint(cfg.model)  # (a hub model is in the cache by now)
    return device, train_rows, eval_rows, tokenizer, model, ref_model, optimizer, base_model


class Stopped(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM: the CLI exits with 128 + signum (130, 143), as a shell reports it."""
    def __init__(self, signum: int, what: str):
        super().__init__(f"{signal.Signals(signum).name}: {what}")
        self.signum = signum


@contextlib.contextmanager
def _run_guard(out: Path, stop: dict, lock: bool = True):
    """While a run writes `out`: a lock on the folder (flock; the OS drops it when the process ends, even on kill -9)
    refuses a second run there; Ctrl-C or SIGTERM (how Colab, SLURM, Kubernetes stop a job) sets stop["signum"]: the
    run finishes its step, saves and raises Stopped. A second signal raises Stopped at once (the checkpoint stays);
    the same signal again within 5 s counts as one (SLURM and torch's launcher each send the workers SIGTERM)."""
    def on_signal(signum, frame):
        if stop and (signum != stop["signum"] or time.monotonic() - stop["at"] > 5):
            raise Stopped(signum, "sent twice, aborted without saving")
        if not stop:
            stop.update(signum=signum, at=time.monotonic())
            print(f"\n{signal.Signals(signum).name}: finishing this step, then saving (again: abort without saving)")

    fd, previous = None, {}
    try:
        try:
            if lock:
                import fcntl  # POSIX
                fd = os.open(out, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BlockingIOError(f"{out}/ is in use by another run; wait for it to end") from None
        except (ImportError, OSError) as e:  # Windows, or a file system without locks: the run goes on, unlocked
            warnings.warn(f"{out}/ cannot be locked ({e}); a second train there would not be refused")
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if fd is not None:
            os.close(fd)


@torch.no_grad()
def _finite(model, tokenizer, quiz: str, metrics: dict, device: torch.device) -> bool:
    """After an update: are the loss, the weights and the next-token logits of a prompt all finite? (Finite weights
    can still give infinite logits: at a huge learning rate the next rollout failed in sampling.)"""
    model.eval()
    ids = tokenizer(kk_prompt(tokenizer, quiz), return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    with autocast(device):
        logits = model(input_ids=ids, logits_to_keep=1).logits  # (1, 1, V)
    finite = torch.stack([p.isfinite().all() for p in model.parameters()] + [logits.isfinite().all()]).all()
    return bool(finite) and all(math.isfinite(v) for k, v in metrics.items() if k.endswith("/loss"))


def _log_evaluation(cfg: Config, step: int, model, tokenizer, eval_rows, device: torch.device) -> None:
    """Evaluates the weights of `step` and adds the result to the step's line of metrics.jsonl."""
    result = _on_oom("evaluation", "--eval_batch_size", evaluate, model, tokenizer, eval_rows, cfg, device)
    path = Path(cfg.output_dir) / "metrics.jsonl"
    lines = [{**r, **result} if r.get("step") == step else r for r in read_jsonl(path)]
    _atomic_write(path, "".join(json.dumps(r) + "\n" for r in lines))


def _train_loop(cfg: Config, start: int, stop: dict, device, train_rows, eval_rows, tokenizer, model, ref_model,
                optimizer, base_model: dict | None) -> None:
    """Steps start + 1 .. cfg.steps. A step is logged, saved, then evaluated: a stop, an error or a crash during the
    evaluation loses nothing. A stop skips the evaluation, to save within a short grace period; --resume then
    evaluates the checkpoint's step first, so the run ends with the rows of one never stopped."""
    out = Path(cfg.output_dir)
    due = lambda s: bool(cfg.eval_every and s % cfg.eval_every == 0) or s == cfg.steps  # noqa: E731
    if start and due(start) and not stop and not any(  # a run stopped (or killed) before this evaluation
            "eval/accuracy" in r for r in read_jsonl(out / "metrics.jsonl") if r.get("step") == start):
        _log_evaluation(cfg, start, model, tokenizer, eval_rows, device)
    if stop:  # a signal while the run was loading: no step to finish
        raise Stopped(stop["signum"], f"stopped before step {start + 1}")
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", dynamic_ncols=True)
    for step in bar:
        rows = train_rows[step_rows(len(train_rows), cfg, step)]
        diag = cfg.diagnose_every > 0 and (step + 1) % cfg.diagnose_every == 0
        metrics = {"step": step + 1, **train_step(cfg, model, ref_model, tokenizer, optimizer, rows, device, diag)}
        if not _finite(model, tokenizer, rows["quiz"][0], metrics, device):
            raise ValueError(f"step {step + 1} diverged: the loss or the weights are no longer finite; it was not "
                             f"saved: lower the learning rate ({cfg.learning_rate}) and continue from the last "
                             "checkpoint with --resume --learning_rate LOWER")
        samples = {"step": step + 1, "quiz": rows["quiz"][0], "samples": metrics.pop("samples")}
        append_jsonl(out / "metrics.jsonl", metrics)  # first: a folder with a metrics line is a run
        append_jsonl(out / "samples.jsonl", samples)
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", acc=f"{metrics['accuracy']:.2f}")
        saves = (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps
        if saves or stop:
            save_checkpoint(cfg, model, tokenizer, optimizer, step + 1, base_model)
        if due(step + 1) and not stop:
            _log_evaluation(cfg, step + 1, model, tokenizer, eval_rows, device)
            if stop and not saves:  # a signal during the evaluation
                save_checkpoint(cfg, model, tokenizer, optimizer, step + 1, base_model)
        if stop:
            raise Stopped(stop["signum"], f"stopped after step {step + 1} and saved it")


def _open_run_folder(cfg: Config, resume: bool, loads_model: bool, processes: int = 1) -> dict | None:
    """train's and train_trl's checks before anything is loaded; returns the run's saved settings on --resume."""
    out, B = Path(cfg.output_dir), cfg.prompts_per_step * cfg.num_generations
    if B % cfg.mini_batch_size or cfg.mini_batch_size % (cfg.micro_batch_size * processes):
        raise ValueError(f"prompts_per_step * num_generations = {B} must be a multiple of mini_batch_size = "
                         f"{cfg.mini_batch_size}, itself one of micro_batch_size = {cfg.micro_batch_size} x "
                         f"{processes} process(es)")
    saved = _saved_config(out) if resume else _check_new_run_folder(out, "pass --resume to continue it, or ")
    if loads_model:  # fail now if cfg.model names no model folder
        _check_model_name(cfg.model, "; if the run's base model moved, add --model ITS_NEW_PLACE" if resume else "")
    out.mkdir(parents=True, exist_ok=True)  # an unwritable --output_dir fails here, before anything is loaded
    return saved


def train(cfg: Config, resume: bool = False) -> Path:
    """GRPO (+AR, +Lopti) on K&K. Writes config.json, metrics.jsonl, samples.jsonl and checkpoint/ in cfg.output_dir."""
    out, stop = Path(cfg.output_dir), {}
    saved = _open_run_folder(cfg, resume, loads_model=not resume or cfg.beta > 0)
    with _run_guard(out, stop):
        if not resume:  # again under the lock: another train may have begun here since the check above
            _check_new_run_folder(out, "pass --resume to continue it, or ")
        ckpt, state = _resume_point(cfg, out, saved) if resume else (None, {"step": 0})
        objects = _run_objects(cfg, ckpt, state)
        _atomic_write(out / "config.json", json.dumps(asdict(cfg), indent=2))
        _train_loop(cfg, state["step"], stop, *objects)
    return out / "checkpoint"


# --- plots


def _method(cfg: dict) -> str:
    """A run's method from its config.json: GRPO, AR, Lopti or AR+Lopti, and the optimiser if not AdamW."""
    name = {(False, False): "GRPO", (True, False): "AR", (False, True): "Lopti", (True, True): "AR+Lopti"}[
        (cfg.get("alpha", 0) > 0, bool(cfg.get("lopti")))]
    return name + (f", SGD lr {cfg['learning_rate']:g}" if cfg.get("optimizer") == "sgd" else "")


def _check_png_out(out: Path) -> None:
    if out.exists() and (out.is_dir() or out.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n"):
        raise FileExistsError(f"--out {out} exists and is not a PNG; choose another --out")


def plot_runs(runs: list[Path], out: Path) -> Path:
    """`python lopti.py plot`: reward, accuracy, format-error share and Lopti's low-token share per step, one line
    per run (5-step running mean over the raw values), labelled by method and seed."""
    plt = _pyplot()
    if plt is None:
        raise ImportError("plot needs matplotlib: pip install matplotlib")
    _check_png_out(out)
    panels = (("reward", "Logic-RL reward"), ("accuracy", "accuracy (reward 3)"),
              ("format_error", "format-error share (reward -3)"), ("low/token_share", "Lopti: low-token share"))
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for i, run in enumerate(runs):
        if not (run / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"plot: {run}/metrics.jsonl not found; pass run folders written by train")
        lines = read_jsonl(run / "metrics.jsonl")
        cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
        method = _method(cfg) if cfg else run.name
        for ax, (key, title) in zip(axes, panels):
            points = [(m["step"], m[key]) for m in lines if m.get(key) is not None]
            if points:
                x, y = zip(*points)
                mean = [sum(y[max(0, j - 4): j + 1]) / len(y[max(0, j - 4): j + 1]) for j in range(len(y))]
                ax.plot(x, y, c=f"C{i}", alpha=0.25, lw=0.8)
                ax.plot(x, mean, c=f"C{i}", label=f"{method}, seed {cfg.get('seed', '?')}")
            ax.set(title=title, xlabel="RL step")
    axes[0].legend(fontsize=8)
    _save_png(plt, fig, out)
    return out


def figure_3(runs: list[Path], out: Path, per_run: bool = False, resamples: int = 2000) -> dict:
    """`python lopti.py fig3`: Figure 3 from runs' update/ counts (measure_update), pooled per method (per run with
    `per_run`): per bin, the rose counts summed over all steps over the A > 0 counts summed, with a 95 % interval
    from a bootstrap of runs, then of steps within each (a step's tokens are not independent, nor a run's steps).
    Runs pool only if their settings differ in nothing but seed and what --resume may change (not model or lr).
    Prints a table beside the paper's numbers, writes the PNG `out` and returns the table."""
    _check_png_out(out)
    groups: dict[str, list] = {}
    same = {"seed", *RESUME_MAY_CHANGE} - {"model", "learning_rate"}  # (settings that may differ in one group)
    for run in runs:
        if not (run / "metrics.jsonl").is_file() or not (run / "config.json").is_file():
            raise FileNotFoundError(f"fig3: {run} holds no metrics.jsonl and config.json; pass run folders of train")
        cfg = {**asdict(Config()), **json.loads((run / "config.json").read_text())}  # (fields added since: defaults)
        label = _method(cfg) + (f", {run.name}" if per_run else "")
        if per_run and label in groups:
            raise ValueError(f"fig3 --per_run: two runs are named {run.name}; pass folders with distinct names")
        steps = [r for r in read_jsonl(run / "metrics.jsonl") if "update/pos_tokens" in r]
        if not steps:
            raise ValueError(f"fig3: {run} logged no update/ counts (runs of --engine trl or --measure_update false "
                             "do not); train with the native engine")
        first = groups[label][0][0] if label in groups else cfg  # every run of a group is compared with its first
        diff = sorted(k for k in cfg.keys() | first.keys() if k not in same and cfg.get(k) != first.get(k))
        if diff:
            raise ValueError(f"fig3: the {label} runs differ in {', '.join(diff)}; plot them apart or add --per_run")
        groups.setdefault(label, []).append((cfg, steps))
    table, gen, order = {}, torch.Generator().manual_seed(0), ("GRPO", "AR", "Lopti", "AR+Lopti")
    for label, members in sorted(groups.items(), key=lambda g: (order.index(g[0].split(",")[0]), g[0])):
        steps = [r for _, run_steps in members for r in run_steps]
        boot = []  # per run: (R, 4) rose and A > 0 sums of its steps drawn with replacement
        for _, run_steps in members:
            rose, n = (torch.tensor([r[f"update/{k}"] for r in run_steps], dtype=torch.float64) for k in (
                "pos_rose", "pos_tokens"))  # (S, 4)
            pick = torch.randint(len(run_steps), (resamples * len(members), len(run_steps)), generator=gen)  # (Rk, S)
            boot.append(torch.stack([rose[pick].sum(1), n[pick].sum(1)]))  # (2, Rk, 4)
        runs_drawn = torch.randint(len(members), (resamples, len(members)), generator=gen)  # (R, k)
        slot = torch.arange(resamples * len(members)).view(resamples, -1)  # (R, k): each draw its own steps
        rose, n = torch.stack(boot)[runs_drawn, :, slot].sum(1).unbind(1)  # (R, 4) each
        low, high = ((rose / n).nanquantile(q, dim=0).tolist() for q in (0.025, 0.975))  # (0/0: no token drawn)
        counts, measured = pool_update_counts(steps), sum(any(r["update/pos_tokens"]) for r in steps)
        table[label] = {"ratio": fig3_ratio(counts), "low": low, "high": high, "runs": len(members),
                        "steps": len(steps), "measured_steps": measured, **counts}
    print(f"Figure 3: share of A>0 tokens whose probability rose after the step's update, per pi_old bin {BIN_NAMES};"
          " 95 % bootstrap interval; n = A>0 tokens")
    fmt = lambda v, lo, hi, k: f"{v:.3f} [{lo:.3f}, {hi:.3f}] n={k}" if v is not None else "-"  # noqa: E731
    for label, t in table.items():
        fell = [f"{f / k:.3f}" if k else "-" for f, k in zip(t["neg_fell"], t["neg_tokens"])]
        print(f"{label}, {t['runs']} run(s), {t['measured_steps']} steps with A>0 tokens: "
              f"{' | '.join(fmt(*c) for c in zip(t['ratio'], t['low'], t['high'], t['pos_tokens']))}; "
              f"A<0 tokens that fell: {' | '.join(fell)}")
    for label, ratio in PAPER_FIGURES["pos_rose"].items():
        print(f"paper (K&K, Qwen2.5-7B-Instruct-1M), {label}: {' | '.join(f'{v:.3f}' for v in ratio)}")
    plt = _pyplot()
    if plt is None:
        print("matplotlib is not installed: no PNG")
        return table
    fig, ax = plt.subplots(figsize=(8, 4))
    plot_fig3(ax, table)
    _save_png(plt, fig, out)
    print(f"wrote {out}")
    return table


# --- diagnose: the paper's Figure 1 on a real model's rollouts


def diagnose(cfg: Config) -> Path:
    """`python lopti.py diagnose`: one rollout batch of cfg.model (step 1's prompts for cfg.seed), scored as
    train_step scores it (reward with format credit, group advantages, pi_old), then measure_bins. Writes
    diagnose_<model folder or hub name>_seed<S>.json (so a checkpoint's and the base model's do not overwrite each
    other) and a PNG beside the paper's numbers under cfg.output_dir; they replace only an earlier such output."""
    out = Path(cfg.output_dir) / f"diagnose_{Path(cfg.model).name}_seed{cfg.seed}.json"
    _check_output_folder(out.parent)
    mine = False
    with contextlib.suppress(OSError, ValueError, TypeError):
        mine = {"bins", "paper"} <= set(json.loads(out.read_text()))
    for path in (out, out.with_suffix(".png")):
        if path.exists() and not mine:
            raise FileExistsError(f"{path} exists and is not an output of diagnose; move it or choose another "
                                  "--output_dir")
    _check_model_name(cfg.model)
    tokenizer = load_tokenizer(cfg.model)  # (a bad --model fails here, before anything is written)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{cfg.model} has no chat template: diagnose measures an instruct model on K&K's chat prompt")
    out.parent.mkdir(parents=True, exist_ok=True)  # an unwritable --output_dir fails here, before the model loads
    device, t0 = pick_device(), time.perf_counter()
    torch.manual_seed(cfg.seed)
    train_rows = load_task_data(cfg)[0]
    model = load_model(cfg.model, device)
    m = train_step(cfg, model, None, tokenizer, None, train_rows[step_rows(len(train_rows), cfg, 0)], device, True)
    r = {"bins": list(BIN_NAMES), **m["diagnose"], "paper": {k: PAPER_FIGURES[k] for k in ("token_share",
                                                                                            "grad_norm")}}
    _atomic_write(out, json.dumps(_strict(r), indent=1, allow_nan=False) + "\n")
    print(f"reward {m['reward']:.2f}, {time.perf_counter() - t0:.0f} s (measurement {m['time/diagnose']:.0f} s)")
    plt = _pyplot()
    if plt is not None:
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        plot_bins(ax, r, Path(cfg.model).name)
        _save_png(plt, fig, out.with_suffix(".png"))
    return out


# ====== TRL: AR and Lopti inside trl.GRPOTrainer (optional: pip install trl; tested with trl 1.16.0) ======


@functools.lru_cache(maxsize=None)
def _lopti_grpo_trainer_class():
    from trl import GRPOTrainer
    class LoptiGRPOTrainer(GRPOTrainer):
        """trl.GRPOTrainer with AR (Eq. 4) and Lopti (Algorithm 1) by lopti's reweight_advantages, lopti_masks and
        policy_loss. Lopti replays each generation batch through TRL's num_iterations, which the trainer doubles (on
        a copy of `args`): args.num_iterations keeps Config.num_iterations' meaning (PPO epochs per pass), and
        max_steps (optimiser steps) must count Lopti's two passes. Of TRL's loss options only epsilon, epsilon_high
        and beta apply (text prompts, token-level ratios). Unlike update_policy, TRL steps the optimiser on a
        mini-batch without a finite gradient (e.g. an empty Lopti stage) and its advantage divides by std + 1e-4.
        `stop_at` (a text, e.g. '</answer>') ends each completion, and its loss mask, where the text is complete."""

        def __init__(self, model, reward_funcs, args, *, alpha=Config.alpha, lopti=Config.lopti, eta=Config.eta,
                     lopti_order=Config.lopti_order, dual_clip=Config.dual_clip, stop_at: str | None = None, **kwargs):
            knobs = dict(alpha=alpha, lopti=lopti, eta=eta, lopti_order=lopti_order, dual_clip=dual_clip)
            Config(**knobs)  # checks them
            if args.loss_type != "dapo":  # the loss below is the step's token-mean (TRL's "dapo"); no other is made
                raise ValueError(f"LoptiGRPOTrainer needs loss_type='dapo', got {args.loss_type!r}")
            unsupported = {k: getattr(args, k, v) for k, v in (  # TRL options _compute_loss below does not apply
                ("importance_sampling_level", "token"), ("delta", None), ("top_entropy_quantile", 1.0),
                ("off_policy_mask_threshold", None), ("vllm_importance_sampling_correction", False))
                if getattr(args, k, v) != v and (k != "vllm_importance_sampling_correction" or args.use_vllm)}
            if unsupported:
                raise ValueError(f"LoptiGRPOTrainer does not apply these GRPOConfig settings: {unsupported}")
            if lopti and args.steps_per_generation % args.gradient_accumulation_steps:  # a step within one stage
                raise ValueError("with Lopti, steps_per_generation must be a multiple of gradient_accumulation_steps")
            if lopti:
                args = copy.copy(args)
                args.num_iterations *= 2
            vars(self).update(knobs, stop_at=stop_at)
            super().__init__(model, reward_funcs, args=args, **kwargs)

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # rollout's stop_at_answer and time/rollout
            t0, model = time.perf_counter(), self.model
            if self.stop_at and not self.use_vllm:  # TRL 1.16 calls generate() without the tokenizer stop_strings needs
                model.generate = functools.partial(type(model).generate, model, tokenizer=self._tokenizer)
            try:
                ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            finally:
                vars(model).pop("generate", None)
            if self.stop_at:  # the text is cut at the token that completes it, as rollout's cut_at does
                keep = [int(cut_at(self._tokenizer, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.bool),
                                   self.stop_at)[0].sum()) for r in ids]
                ids, logprobs = [r[:n] for r, n in zip(ids, keep)], logprobs and [r[:n] for r, n in zip(logprobs, keep)]
            self._rollout_s = time.perf_counter() - t0
            self._metrics["train"]["time/rollout"].append(self._rollout_s)
            return ids, logprobs

        def _logps(self, model, batch: dict, **kwargs) -> torch.Tensor:  # (B, T) at T: TRL's LM head divides by it
            return self._get_per_token_logps_and_entropies(
                model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].shape[1],
                **kwargs)[0]

        def _generate_and_score_completions(self, inputs):
            t0, out = time.perf_counter(), super()._generate_and_score_completions(inputs)
            mask, adv = out["completion_mask"].bool(), out["advantages"]  # (B, T), (B,)
            if "old_per_token_logps" not in out and (self.alpha > 0 or self.lopti):  # TRL skips it for one pass
                with torch.no_grad():
                    out["old_per_token_logps"] = self._logps(self.model, out,
                                                             batch_size=self.args.per_device_train_batch_size)
            old = out.get("old_per_token_logps", torch.zeros(mask.shape, device=mask.device))  # (B, T); else alpha = 0
            out["advantages"] = reweight_advantages(adv, old, self.alpha)  # (B, T), Eq. 4, before the split
            out["lopti_low"] = lopti_masks(old, mask, self.eta)[0] if self.lopti else mask  # (B, T), carried by TRL
            # update_policy's metrics: over the tokens of rows with a gradient, on all processes
            active = mask & rows_with_gradient(adv, self.beta)[:, None]  # (B, T)
            weight = reweight_advantages(torch.ones_like(adv), old, self.alpha)  # (B, T), Eq. 4's factor
            sums = torch.stack([active.sum(), (weight * active).sum(), (out["lopti_low"] & active).sum()]).float()
            n, w, low = self.accelerator.gather(sums[None]).sum(0).tolist()
            shares = {"low": low, "high": n - low} if self.lopti else {"all": n}
            for key, value in {"ar_weight": w, **{f"{k}/token_share": v for k, v in shares.items()}}.items():
                self._metrics["train" if self.model.training else "eval"][key].append(value / n if n else math.nan)
            self._metrics["train"]["time/logprobs"].append(time.perf_counter() - t0 - self._rollout_s)  # and rewards
            return out

        def _compute_loss(self, model, inputs):
            mask, low, train = inputs["completion_mask"].bool(), inputs["lopti_low"], self.model.training  # (b, T)
            stage, name = mask, "all"
            if self.lopti and train:  # this micro-step's replay of the generation batch; first half: first stage
                second = self._step // self.args.steps_per_generation % self.num_iterations >= self.num_iterations // 2
                stage, name = (low, "low") if second == (self.lopti_order == "high_first") else (mask & ~low, "high")
            # DENOM, TRL's "dapo" normaliser: the generation batch's response tokens on all processes, per process
            # (DDP averages) and per optimiser step = the step's mini-batch's tokens, in both Lopti stages, as in
            # update_policy (if a pass takes k > 1 steps: the mean mini-batch's count, and TRL shuffles the rows).
            ga = self.current_gradient_accumulation_steps if train else 1
            denom = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            denom = denom * ga / self.args.steps_per_generation if train else denom
            logp = self._logps(model, inputs)  # (b, T)
            loss, _ = policy_loss(
                logp, inputs.get("old_per_token_logps", logp.detach()), inputs["advantages"] * stage, mask,
                epsilon=self.epsilon_low, epsilon_high=self.epsilon_high, dual_clip=self.dual_clip,
                ref_logprobs=inputs.get("ref_per_token_logps"), beta=self.beta, kl_mask=stage, num_tokens=denom)
            # update_policy's {stage}/loss, the optimiser step's loss: TRL averages the logged micro-step values
            self._metrics["train" if train else "eval"][f"{name}/loss"].append(
                self.accelerator.gather(loss.detach()[None]).mean().item() * ga)
            return loss

    return LoptiGRPOTrainer


def __getattr__(name: str):
    """`lopti.LoptiGRPOTrainer` imports TRL on first use; `import lopti` never does."""
    if name == "LoptiGRPOTrainer":
        return _lopti_grpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _trl_args(cfg: Config, vllm: str | None = None, save_total_limit: int = 1):
    """train_trl's GRPOConfig and optimiser steps per RL step; TRL keeps the last `save_total_limit` checkpoints (0:
    all). `vllm` ('colocate', 'server': untested, no GPU here) samples as below; pi_old is the trainer's log-probs of
    the sampled tokens, as the official code's (verl recomputes old_log_prob), so TRL's vLLM IS correction is off."""
    from trl import GRPOConfig
    B = cfg.prompts_per_step * cfg.num_generations
    per_step = (2 if cfg.lopti else 1) * cfg.num_iterations * B // cfg.mini_batch_size  # optimiser steps per RL step
    stop = ({"stop": [KK_ANSWER_END], "include_stop_str_in_output": True} if vllm else
            {"stop_strings": [KK_ANSWER_END]})  # HF generate: LoptiGRPOTrainer passes it the tokenizer
    args = GRPOConfig(
        output_dir=cfg.output_dir, seed=cfg.seed, max_steps=cfg.steps * per_step, generation_batch_size=B,
        per_device_train_batch_size=cfg.micro_batch_size, num_generations=cfg.num_generations,
        temperature=cfg.temperature, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,  # sample from pi_old
        max_completion_length=cfg.max_completion_length, mask_truncated_completions=cfg.mask_truncated,
        num_iterations=cfg.num_iterations, loss_type="dapo", beta=cfg.beta, epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high, learning_rate=cfg.learning_rate, lr_scheduler_type="constant",
        max_grad_norm=cfg.max_grad_norm, disable_dropout=True, gradient_checkpointing=cfg.gradient_checkpointing,
        bf16=has_bf16(pick_device()), logging_steps=1, report_to="none", ddp_find_unused_parameters=False,
        save_strategy="steps" if cfg.save_every else "no", save_steps=max(cfg.save_every, 1) * per_step,
        save_total_limit=save_total_limit or None, use_vllm=vllm is not None, vllm_mode=vllm or "colocate",
        vllm_importance_sampling_correction=False, generation_kwargs=stop if cfg.stop_at_answer else None)
    args.gradient_accumulation_steps = cfg.mini_batch_size // (cfg.micro_batch_size * args.world_size)
    return args, per_step


TRL_NAMES = {"reward": None, "reward_std": None, "kk_reward": "reward", "frac_reward_zero_std": "zero_std_groups",
             "completions/mean_length": "completion_length", "completions/clipped_ratio": "truncated"}  # native's


def train_trl(cfg: Config, resume: bool = False, vllm: str | None = None, save_total_limit: int = 1) -> Path:
    """`python lopti.py train --engine trl`: `train`'s K&K run through LoptiGRPOTrainer, in one process or under
    `accelerate launch`, with its evaluation (sharded: each process decodes its share of the puzzles) and --resume
    (TRL's own restore of weights, optimiser, scheduler and RNG from the latest checkpoint-N/). Writes config.json,
    metrics.jsonl (a line per RL step, the native trainer's names) and checkpoint/ in cfg.output_dir."""
    from accelerate.utils import gather_object
    from transformers import TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint
    from trl.models import unwrap_model_for_generation
    out, (args, per_step) = Path(cfg.output_dir), _trl_args(cfg, vllm, save_total_limit)
    print(f"--engine trl: process {args.process_index} of {args.world_size} processes")
    if cfg.stop_at_answer and cfg.mask_truncated:  # TRL would take a completion cut at </answer> for a truncated one
        raise ValueError("--engine trl: stop_at_answer and mask_truncated together are not supported")
    saved, main, stop, pending = _open_run_folder(cfg, resume, True, args.world_size), args.process_index == 0, {}, {}
    stages = ("low", "high") if cfg.lopti_order == "low_first" else ("high", "low")
    with _run_guard(out, stop, lock=main):  # (one lock per folder)
        ckpt = get_last_checkpoint(str(out)) if resume else None  # TRL's newest checkpoint-N/
        if resume and ckpt is None and latest_checkpoint(str(out)):
            raise ValueError(f"--resume: {out}/ is a run of the native engine: resume it without --engine trl")
        if resume:
            _resume_check(cfg, out, saved, int(ckpt.rsplit("-", 1)[1]) // per_step if ckpt else 0, ckpt, main, tuple(
                k for k in RESUME_MAY_CHANGE if k not in ("model", "learning_rate")))  # (TRL restores its own lr)
        elif main:  # again under the lock: another train may have begun here since the check above
            _check_new_run_folder(out, "pass --resume to continue it, or ")
        tokenizer, (rows, eval_rows) = load_tokenizer(cfg.model), load_task_data(cfg)
        prompts = [kk_prompt(tokenizer, quiz) for quiz in rows["quiz"]]  # templated text: TRL applies no template
        if tokenizer(prompts[:1])["input_ids"] != tokenizer(prompts[:1], add_special_tokens=False)["input_ids"]:
            raise ValueError(f"{cfg.model}'s tokenizer adds special tokens to the templated prompt (as TRL calls it)")
        data = datasets.Dataset.from_dict({"prompt": prompts, "solution_text_format": rows["solution_text_format"]})

        def kk(completions, solution_text_format, log_metric, **_):  # the training reward, as train_step's
            r, trained = kk_rewards(completions, solution_text_format, cfg.format_reward)  # Logic-RL's for metrics
            r = trainer.accelerator.gather(r.to(trainer.accelerator.device)).cpu()  # all processes' rows
            metrics = (("kk_reward", r), ("accuracy", r == KK_MAX_REWARD), ("format_error", r == KK_FORMAT_ERROR))
            for key, value in metrics:
                log_metric(key, value.float().mean().item())
            return trained.tolist()

        def evaluate_all() -> dict[str, float]:  # the model gathered as TRL's generation gathers it (ZeRO-3)
            acc = trainer.accelerator
            with unwrap_model_for_generation(trainer.model_wrapped, acc, args.ds3_gather_for_generation) as model:
                shard = eval_rows.select(range(acc.process_index, len(eval_rows), acc.num_processes))
                result = evaluate(model, tokenizer, shard, cfg, acc.device, gather_object)
            trainer.model.train()  # (rollout's model.eval(): TRL logs a step's metrics by the model's mode)
            return result

        class PerRLStep(TrainerCallback):
            """One metrics.jsonl line per RL step: TRL's logged values, averaged over the step's optimiser steps."""

            def on_step_begin(self, _args, state, control, **kwargs):
                if state.global_step % per_step == 0:
                    self.t0 = time.perf_counter()

            def on_step_end(self, _args, state, control, **kwargs):  # a stop (_run_guard) anywhere: all save, end
                step, rest = divmod(state.global_step, per_step)
                if rest:
                    return
                pending["time/step"] = [time.perf_counter() - self.t0]
                if trainer.accelerator.gather(torch.tensor([len(stop)], device=trainer.accelerator.device)).any():
                    control.should_save = control.should_training_stop = True
                elif cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:  # (the last: at the end)
                    evaluated = _on_oom("evaluation", "--eval_batch_size", evaluate_all)
                    pending.update((k, [v]) for k, v in evaluated.items())

            def on_log(self, _args, state, control, logs=None, **kwargs):
                if "train_runtime" in logs:  # the Trainer's end-of-training summary
                    return
                if cfg.lopti and "grad_norm" in logs:  # the optimiser step's stage: the first half is the first
                    logs[f"{stages[(state.global_step - 1) % per_step >= per_step // 2]}/grad_norm"] = logs["grad_norm"]
                for k, v in logs.items():
                    if TRL_NAMES.get(k, k) and isinstance(v, (int, float)):
                        pending.setdefault(TRL_NAMES.get(k, k), []).append(v)
                step, rest = divmod(state.global_step, per_step)
                if rest:
                    return
                means = {k: sum(v) / len(v) for k, v in pending.items()}
                pending.clear()
                means["time/update"] = means.pop("time/step") - means["time/rollout"] - means["time/logprobs"]
                if main:
                    append_jsonl(out / "metrics.jsonl", {"step": step, **means,
                                                         "peak_memory_gb": peak_memory_gb(trainer.accelerator.device)})

        model = load_model(cfg.model, torch.device("cpu"))  # the Trainer moves it to its device
        trainer = _lopti_grpo_trainer_class()(  # lopti's AdamW: it decays all weights, the Trainer's not biases, norms
            model, kk, args, alpha=cfg.alpha, lopti=cfg.lopti, eta=cfg.eta, lopti_order=cfg.lopti_order,
            dual_clip=cfg.dual_clip, stop_at=KK_ANSWER_END if cfg.stop_at_answer else None, train_dataset=data,
            processing_class=tokenizer, optimizers=(make_optimizer(model, cfg), None), callbacks=[PerRLStep()])
        if main:
            _atomic_write(out / "config.json", json.dumps(asdict(cfg), indent=2))
        trainer.train(resume_from_checkpoint=ckpt)
        trainer.save_model(str(out / "checkpoint"))
        if not stop:  # the last evaluation, after the saves; also when --resume finds a run stopped in its last step
            final, lines = _on_oom("evaluation", "--eval_batch_size", evaluate_all), read_jsonl(out / "metrics.jsonl")
            if main:
                lines[-1].update(final)
                _atomic_write(out / "metrics.jsonl", "".join(json.dumps(_strict(r)) + "\n" for r in lines))
        trainer.accelerator.wait_for_everyone()  # no process exits (and no launcher stops the rest) before the saves
    if stop:
        raise Stopped(stop["signum"], f"stopped after RL step {trainer.state.global_step // per_step} and saved it")
    return out / "checkpoint"


# ====== CLI: python lopti.py {toy,train,eval,diagnose,plot,fig3} [--preset NAME] [--field value ...] ======


PRESETS: dict[str, dict] = {
    # a laptop CPU, under 45 minutes on 2 cores: SmolLM2-135M-Instruct on 2-person puzzles, 128-token completions
    # that stop at </answer>, no reference model, a 20x learning rate, and the format-credit term: this model never
    # formats an answer by chance, so Logic-RL's reward alone gives it nothing to learn from (see the README: on
    # seed 0 it learns a complete answer in 25 steps with GRPO and AR+Lopti; on seeds 1-4 it does not)
    "cpu": dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", num_people="2", num_train=256, steps=25,
                prompts_per_step=4, num_generations=8, max_completion_length=128, mini_batch_size=32,
                micro_batch_size=8, beta=0.0, learning_rate=2e-5, format_reward=1.0, stop_at_answer=True,
                eval_size=16, eval_every=10, eval_batch_size=16, save_every=10, output_dir="runs/cpu"),
    # a free Colab T4 (15 GB, fp32: no bf16), < 3 h: Qwen2.5-0.5B-Instruct, 4 x 8 completions of <= 512 tokens, no
    # reference model (+2 GB). tests/bench_memory.py: peak 9.9 GB (CPU, fp32), at most 88 s a step on a T4 (estimated)
    "colab": dict(model="Qwen/Qwen2.5-0.5B-Instruct", num_people="3-5", steps=100, prompts_per_step=4,
                  num_generations=8, max_completion_length=512, mini_batch_size=16, micro_batch_size=4, beta=0.0,
                  gradient_checkpointing=True, eval_every=25, save_every=25, output_dir="runs/colab"),
    # one 80 GB GPU (A100/H100), under a day: Qwen2.5-3B-Instruct (the paper's model) at half the paper's batch and
    # length, 150 steps. tests/bench_memory.py estimates 59 GB and at most 23 h on an A100 (13 h on an H100)
    "gpu": dict(prompts_per_step=32, max_completion_length=2048, mini_batch_size=128, micro_batch_size=8,
                generation_batch_size=128, steps=150, eval_every=25, save_every=25, gradient_checkpointing=True,
                output_dir="runs/gpu"),
}


def _parse_bool(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")


EVAL_FIELDS = ("model", "eval_data", "eval_size", "eval_batch_size", "num_people", "max_completion_length",
               "stop_at_answer", "num_train", "seed")  # what `eval` reads (num_train, seed: puzzles kept out)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (exit 2) and without abbreviated options (--num_generation is an error)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _field_docs() -> dict[str, str]:
    """The docstring under each Config field, for --help (the dataclass above is the one place to edit)."""
    body = ast.parse(inspect.getsource(Config)).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def _config_arguments(parser: argparse.ArgumentParser, names) -> None:
    """--preset and one --field (or --field-name) per Config field in `names`; unset fields are absent."""
    parser.add_argument("--preset", choices=sorted(PRESETS), help="settings for a machine size (see PRESETS)")
    types, docs = {"float": float, "int": int, "str": str, "bool": _parse_bool}, _field_docs()
    for f in fields(Config):
        if f.name in names:
            parser.add_argument(*sorted({f"--{f.name}", f"--{f.name.replace('_', '-')}"}), dest=f.name,
                                type=types[f.type], metavar=f.type.upper(),
                                help=f"{docs[f.name]} (default {f.default!r})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lopti.py", description="GRPO with Advantage Reweighting and Lopti (Yang et al., ICLR 2026)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{toy,train,eval,diagnose,plot,fig3}")
    toy = sub.add_parser("toy", help="the paper's mechanism on a toy softmax policy (CPU, < 1 minute)")
    # the toy's defaults are ToySettings', its range checks Config's (in toy_main)
    for name, kind in (("seed", int), ("steps", int), ("seeds", int), ("alpha", float), ("eta", float),
                       ("reward", str), ("answer_len", int)):
        toy.add_argument(f"--{name}", type=kind, default=argparse.SUPPRESS, help=f"default {getattr(ToySettings, name)}"
                         f"{f'; --quick {TOY_QUICK[name]}' if name in TOY_QUICK else ''}")
    toy.add_argument("--out", type=Path, help="folder for results.json and toy.png (default: toy/ when no setting "
                     "is given, runs/toy/ otherwise)")
    toy.add_argument("--quick", action="store_true", help="a few seconds: fewer steps, seeds and batches")
    train = sub.add_parser("train", help="GRPO (+AR, +Lopti) on Knights and Knaves", argument_default=argparse.SUPPRESS)
    _config_arguments(train, [f.name for f in fields(Config)])
    train.add_argument("--resume", action="store_true", help="continue the run in --output_dir from its latest "
                       "checkpoint (or from the start if it has none), with its saved config; explicit --field "
                       f"values may change only {', '.join(RESUME_MAY_CHANGE)}")
    train.add_argument("--engine", choices=("native", "trl"), default="native", help="native: lopti's own loop "
                       "(one device); trl: LoptiGRPOTrainer, also under `accelerate launch` (pip install trl)")
    train.add_argument("--vllm", choices=("colocate", "server"), help="--engine trl: generate with vLLM in this mode "
                       "(TRL's use_vllm, vllm_mode; untested on a GPU)")
    train.add_argument("--save_total_limit", type=int, metavar="N", help="--engine trl: TRL checkpoints kept (default "
                       "1; 0 keeps all)")
    eval_cmd = sub.add_parser("eval", help="greedy K&K accuracy of a model", argument_default=argparse.SUPPRESS)
    _config_arguments(eval_cmd, EVAL_FIELDS)
    diag = sub.add_parser("diagnose", help="the paper's Figure 1 on one rollout batch of a model",
                          argument_default=argparse.SUPPRESS)
    _config_arguments(diag, [f.name for f in fields(Config)])
    diag.add_argument("--checkpoint", type=Path, help="a run's checkpoint folder (RUN_DIR/checkpoint): its weights and "
                      "the run's config (explicit --field values override it); the output goes to RUN_DIR")
    plot = sub.add_parser("plot", help="reward, accuracy, format errors and Lopti's low share of runs, in one PNG")
    plot.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="folders holding metrics.jsonl")
    plot.add_argument("--out", type=Path, default=Path("curves.png"), help="the PNG to write (default curves.png)")
    fig3 = sub.add_parser("fig3", help="Figure 3 of runs' own updates, pooled per method with bootstrap intervals")
    fig3.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders of train")
    fig3.add_argument("--out", type=Path, default=Path("fig3.png"), help="the PNG to write (default fig3.png)")
    fig3.add_argument("--per_run", action="store_true", help="one bar per run instead of per method")
    for p in (toy, train, eval_cmd, diag, plot, fig3):
        p.add_argument("--debug", action="store_true", help="on an error, show the traceback instead of one line")
    return parser


def resolve_config(args: dict) -> Config:
    """Defaults < preset < explicit --field values. On --resume the run's config.json replaces the defaults and the
    preset (train refuses an explicit value outside RESUME_MAY_CHANGE that differs from it); so it does on
    diagnose --checkpoint, whose weights are the model and whose run folder the output's."""
    preset = PRESETS[args["preset"]] if "preset" in args else {}
    explicit = {f.name: args[f.name] for f in fields(Config) if f.name in args}
    ckpt = args.get("checkpoint")
    if ckpt is not None:
        if not (ckpt / "trainer_state.pt").is_file():
            raise FileNotFoundError(f"--checkpoint {ckpt} is not a checkpoint of a lopti run (no trainer_state.pt)")
        return Config(**{**_saved_config(ckpt.parent, "--checkpoint"), "output_dir": str(ckpt.parent), **explicit,
                         "model": str(ckpt)})
    if not args.get("resume"):
        return Config(**{**preset, **explicit})
    out = {**preset, **explicit}.get("output_dir", Config.output_dir)  # the folder read, wherever the run began
    return Config(**{**_saved_config(Path(out)), **explicit, "output_dir": out})


def _join_negative_values(argv: list[str]) -> list[str]:
    """['--learning_rate', '-1e-6'] -> ['--learning_rate=-1e-6']: argparse reads '-1e-6' as an option."""
    out = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-(\d|\.\d|inf|nan)", arg, re.I):
            out[-1] += "=" + arg
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line. A user error is one line on stderr and exit code 2 (--debug shows the traceback);
    Ctrl-C or SIGTERM during training saves, then exits 130 or 143."""
    args = build_parser().parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    cfg = None
    datasets.disable_progress_bars()  # (the puzzles' map/filter bars; transformers' and the run's own stay)
    try:
        if args.command == "toy":
            toy_main(args)
        elif args.command == "plot":
            print(f"wrote {plot_runs(args.runs, args.out)}")
        elif args.command == "fig3":
            figure_3(args.runs, args.out, args.per_run)
        else:
            values = vars(args)
            cfg = resolve_config(values)
            if values.get("preset") in ("colab", "gpu") and pick_device().type != "cuda":
                warnings.warn(f"--preset {values['preset']} is sized for a CUDA GPU and none was found: this will be "
                              "very slow; use --preset cpu on this machine")
            if args.command == "train" and values.get("engine") == "trl":
                if cfg.diagnose_every:
                    raise ValueError("--engine trl has no --diagnose_every; use --engine native")
                trl_flags = [values.get(k, d) for k, d in (("resume", False), ("vllm", None), ("save_total_limit", 1))]
                print(f"done: {train_trl(cfg, *trl_flags)}")
            elif args.command == "train":
                if {"vllm", "save_total_limit"} & values.keys():
                    raise ValueError("--vllm and --save_total_limit need --engine trl")
                print(f"done: {train(cfg, resume=values.get('resume', False))}")
            elif args.command == "diagnose":
                print(f"wrote {diagnose(cfg)}")
            else:
                print(json.dumps(evaluate_model(cfg), indent=2))
    except KeyboardInterrupt as e:
        run = cfg is not None and args.command == "train"
        hint = "; continue with --resume" if run and (Path(cfg.output_dir) / "config.json").exists() else ""
        print(f"lopti.py {args.command}: {str(e) or 'interrupted'}{hint}", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    except Exception as e:
        if getattr(args, "debug", False):
            raise
        user = isinstance(e, (ValueError, OSError, ImportError, MemoryError))  # bad value/file, no hub/package, OOM
        print(f"lopti.py {args.command}: error: {' '.join(str(e).split())}"
              f"{'' if user else f' ({type(e).__name__}; rerun with --debug for the traceback)'}", file=sys.stderr)
        return 2 if user else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
