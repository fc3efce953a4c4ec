"""lopti.py: GRPO with Advantage Reweighting and Lopti, in one file.

Reference implementation of "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs" (Yang
et al., ICLR 2026, arXiv 2505.12929); official code: github.com/zhyang2226/AR-Lopti (verl 0.1).

    python lopti.py toy                 # Figure 3's mechanism on a toy softmax policy, CPU, seconds
    python lopti.py train --preset cpu  # GRPO + AR + Lopti on Knights and Knaves, a Hugging Face LM
    python lopti.py eval | diagnose | plot | compare  # accuracy; Figures 1, 3; curves; two runs

The paper in the code, all above "A first read can stop here":
    GRPO's group advantage and loss        group_advantages, policy_loss
    Eq. 4, Advantage Reweighting           reweight_advantages
    Algorithm 1, Lopti                     lopti_masks, lopti_stages, update_policy
    Figure 6, high-probability first       lopti_stages (lopti_order="high_first")
    Prop. 4.2, gradient norm ~ 1 - pi      logit_gradient_bounds (the toy checks it)
    Figure 3, A > 0 tokens that rose       update_counts (train; diagnose and the toy pair methods)
    log pi(o_t) of a language model        lm_logprobs
    Algorithm 1's loop                     rollout_and_score, train_step, train

Where this file differs from the paper's text, following the official code:
    - the loss is a token-mean over the mini-batch (the paper averages each response first), and
      both Lopti stages divide by all of its response tokens, so that they add up to GRPO's loss;
    - a dual clip (10) for A < 0; a k3 KL to the reference over each stage's tokens, with clamps;
    - the group's std is unbiased.
Where it differs from both, on purpose:
    - the token-mean divides by the mini-batch's tokens (the code averages per micro-batch), so
      micro-batching does not change the gradient; rows with A = 0 are skipped, an exact saving;
    - the ratio's log is clamped to +-20, as upstream verl does (the official fork does not);
    - every Lopti pass has the learning rate (verl 0.1's schedule gives a run's first pass 0);
    - a mini-batch without gradient takes no optimiser step;
    - no top-k, top-p or repetition penalty in sampling, so that pi_old is what was sampled from;
    - Figure 3 counts from fp64-summed log-probs (the code's prob_stat: bf16 probabilities);
    - an optional supervised warm-up (warm_up) for models below ~1.5B; the paper has none.
Not implemented: the code's neg_adv_weight (its K&K scripts pass 1.0) and quantile split
(seperate_prob = 0, unused by its scripts).

Below the banner, the harness; its sections (grep -n '^# ---' lopti.py) are mapped in README.md.
"""
from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import copy
import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

# ====== Config: one dataclass, the paper's K&K settings ======


@dataclass
class Config:
    """Every field is a flag (--field value); PRESETS change a few. Defaults: the paper's K&K run
    (Qwen2.5-3B, scripts/train_kklogic_*.sh). Names shared with TRL's GRPOConfig are TRL's.
    check_config (below the first read) checks the ranges."""

    # --- method
    alpha: float = 0.3
    """Advantage Reweighting strength, Eq. 4; 0 is GRPO (official: reweight_k; its K&K scripts: 0.3
    with Lopti, 0.2 alone; the paper's math runs: 0.1)."""
    lopti: bool = True
    """Lopti: two update passes per step, low-probability tokens first (Algorithm 1)."""
    eta: float = 0.5
    """Lopti's threshold: tokens with pi_old < eta go in the low pass (official: seperate_prob)."""
    lopti_order: str = "low_first"
    """'low_first' is the paper's method; 'high_first' its ablation (worse than GRPO)."""
    # --- PPO / GRPO update
    epsilon: float = 0.2
    """Lower clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float = 0.24
    """Upper clip (the official K&K scripts clip asymmetrically)."""
    dual_clip: float = 10.0
    """Dual-clip constant for A < 0 (the official code's clip_ratio_c; not in the paper)."""
    beta: float = 0.001
    """Weight of the k3 KL penalty to the reference model; 0 loads no reference model."""
    learning_rate: float = 1e-6
    """The optimiser's, constant (as in the official scripts)."""
    optimizer: str = "adamw"
    """'adamw' (betas 0.9/0.999) or 'sgd', without momentum or decay (the paper's analysis: SGD)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (SGD has none)."""
    max_grad_norm: float = 1.0
    """Clip of the gradients' global norm before each optimiser step."""
    mini_batch_size: int = 256
    """Responses per optimiser step (paper: 512 per RL step, 2 optimiser steps per pass)."""
    micro_batch_size: int = 4
    """Responses per forward/backward; gradients accumulate over a mini-batch."""
    num_iterations: int = 1
    """PPO epochs over the rollout in each update pass (paper: 1)."""
    # --- rollout
    model: str = "Qwen/Qwen2.5-3B-Instruct"
    """Hub id or local folder of a causal LM with a chat template."""
    prompts_per_step: int = 64
    """Prompts per RL step, each sampled num_generations times."""
    num_generations: int = 8
    """Group size G: samples per prompt."""
    temperature: float = 0.7
    """Sampling temperature T. Every log-prob (current, old, reference) is of logits / T, as the
    official actor's; else the first ratio is not 1 and Lopti's split moves."""
    max_completion_length: int = 4096
    """Tokens a completion may have; a longer one is cut and scored as it stands."""
    generation_batch_size: int = 0
    """Sequences per generate() call (0: all at once); smaller bounds the KV cache's memory."""
    stop_at_answer: bool = False
    """End completions at their first '</answer>' (the paper's end at EOS)."""
    gradient_checkpointing: bool = False
    """Recompute the update's activations in its backward pass: less memory, more time."""
    # --- task, warm-up and schedule
    warmup_steps: int = 0
    """Supervised steps on the solver's case analysis before RL (kk_case_analysis; the paper: 0)."""
    warmup_learning_rate: float = 2e-5
    """The warm-up's constant learning rate (AdamW, whatever `optimizer` says)."""
    train_data: str = "generate"
    """'generate' (fresh puzzles; the official run: Logic-RL's files), a file or a hub dataset."""
    num_people: str = "3-7"
    """Puzzle sizes to generate: 'lo-hi' or one number, within 2..8."""
    num_train: int = 4480
    """Generated training puzzles (paper: 70 steps of 64 prompts per data epoch); this default
    takes all there are where fewer exist (2 people: 399)."""
    steps: int = 350
    """RL steps (paper: 5 data epochs)."""
    eval_data: str = "generate"
    """'generate' (from a seed disjoint from training's) or a file / hub dataset."""
    eval_size: int = 20
    """Generated evaluation puzzles per number of people (official: 100 per size)."""
    eval_every: int = 50
    """Evaluate every this many steps; always at step 0 (after the warm-up) and at the end."""
    eval_batch_size: int = 32
    """Prompts per greedy generate() call in evaluation (memory only)."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end, and on Ctrl-C or SIGTERM)."""
    measure_update: bool = True
    """Log Figure 3 of each step's own update (one more no-grad forward; two in fp32 under bf16)."""
    output_dir: str = "runs/lopti"
    """The run's folder: config.json, metrics.jsonl, samples.jsonl, checkpoint-STEP/."""
    seed: int = 0
    """Seeds data order, sampling and generated puzzles."""
    report_to: str = "none"
    """'none', or 'tensorboard': metrics.jsonl's records and the config go to output_dir/tensorboard
    too."""
    reward: str = "kk"
    """'kk', Logic-RL's (kk_rewards), or FILE.py:FUNCTION, MODULE:FUNCTION, or a Python function:
    f(completions, solutions) -> B floats; 3.0 (KK_MAX_REWARD) counts as correct."""

    def __post_init__(self):
        check_config(self)  # the ranges, in the harness: a wrong value is one line


# ====== Core maths: group advantage, log-probs, AR (Eq. 4), Lopti's split, Prop. 4.2, loss ======
# Pure tensor functions that never mutate their inputs: each can be copied out with its test.


def broadcast_to_tokens(advantages: Tensor, like: Tensor) -> Tensor:
    """(B,) advantages repeated over each response's tokens, in fp32, as `like` (B, T)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    return advantages.float().expand(like.shape)  # (B, T)


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO's outcome advantage, one per response (official: compute_grpo_outcome_advantage):

        A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)    std unbiased

    `rewards` (B,): each prompt's G responses in consecutive rows. Equal rewards give A = 0, not
    0/eps noise; a group of one gets mean 0, std 1.
    Example: G = 8, rewards [1, 0, 0, 0, 0, 0, 0, 0] -> A = [2.47, -0.35, ..., -0.35]."""
    assert rewards.dim() == 1 and rewards.numel() % group_size == 0, "(B,), B a multiple of G"
    grouped = rewards.float().view(-1, group_size)  # (P, G)
    if group_size == 1:
        return (grouped / (1.0 + eps)).view(-1)
    mean = grouped.mean(1, keepdim=True)  # (P, 1)
    std = grouped.std(1, keepdim=True)  # (P, 1)
    advantages = (grouped - mean) / (std + eps)  # (P, G)
    all_equal = (grouped == grouped[:, :1]).all(1, keepdim=True)  # (P, 1)
    advantages = torch.where(all_equal, 0.0, advantages)  # (P, G)
    return advantages.view(-1)  # (B,)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(o_t) = log softmax(z_t / T)[o_t] in fp32, for logits (B, T, V) and tokens (B, T). The
    softmax's sum is in fp64: near pi = 1 it is 1 + a tiny rest, which fp32 rounds in steps of 6e-8,
    so an update's change to such a token would read as none. It holds a few fp32 copies of the
    logits: an LM's go through hidden_logprobs (below), in chunks."""
    z = logits.float() / temperature  # (B, T, V)
    top = z.detach().amax(-1, keepdim=True)  # (B, T, 1): a shift, whose gradient would cancel
    log_sum = (z - top).exp().sum(-1, dtype=torch.float64).log()  # (B, T): log(1 + rest), in fp64
    chosen = (z.gather(-1, tokens.unsqueeze(-1)) - top).squeeze(-1)  # (B, T)
    return (chosen - log_sum).float()  # (B, T)


def reweight_advantages(advantages: Tensor, old_logprobs: Tensor, alpha: float) -> Tensor:
    """Advantage Reweighting, Eq. 4, for (B,) or (B, T) advantages and (B, T) log pi_old at the
    sampling temperature:

        A_{i,t} <- (alpha * pi_old(o_{i,t}) + 1 - alpha) * A_{i,t}

    A constant weight, for positive and negative advantages alike; alpha = 0 is GRPO."""
    pi_old = old_logprobs.detach().float().exp()  # (B, T)
    weight = alpha * pi_old + 1 - alpha  # (B, T)
    return weight * broadcast_to_tokens(advantages, old_logprobs)  # (B, T)


def lopti_masks(old_logprobs: Tensor, mask: Tensor, eta: float) -> tuple[Tensor, Tensor]:
    """Lopti's split of the response tokens (Algorithm 1): low = pi_old < eta, high = the rest, two
    (B, T) masks.
    Example, eta = 0.5: exp(old_logprobs) [[0.9, 0.2, 0.6, 1.0]], mask [[1, 1, 1, 0]]
        -> low [[F, T, F, F]], high [[T, F, T, F]]"""
    pi_old = old_logprobs.detach().float().exp()  # (B, T)
    response = mask.bool()  # (B, T)
    low = response & (pi_old < eta)  # (B, T)
    high = response & ~low  # (B, T)
    return low, high


def logit_gradient_bounds(probs: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Prop. 4.2 at the logits: a sampled token's gradient d log pi_j / dz = e_j - pi has a norm
    pinned by its probability,

        sqrt(N / (N - 1)) * (1 - pi_j)  <=  ||e_j - pi||  <=  sqrt(2) * (1 - pi_j)     N: vocabulary

    with equality on the left when the rest is spread evenly, on the right when one rival holds it.
    Through layers whose Jacobians' singular values lie in [c_l, d_l] the bounds scale by their
    products: rare tokens push hardest. Of probs (..., N) and tokens (...): (lower, norm, upper)."""
    vocab = probs.shape[-1]
    one_hot = torch.nn.functional.one_hot(tokens, vocab).to(probs.dtype)  # (..., N)
    norm = (one_hot - probs).norm(dim=-1)  # (...)
    rest = (probs * (1 - one_hot)).sum(-1)  # (...): 1 - pi_j, precise near pi_j = 1
    lower = math.sqrt(vocab / (vocab - 1)) * rest  # (...)
    upper = math.sqrt(2) * rest  # (...)
    return lower, norm, upper


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                mask: Tensor, *, epsilon: float = 0.2, epsilon_high: float = 0.24,
                dual_clip: float = 10.0, ref_logprobs: Tensor | None = None, beta: float = 0.0,
                num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's clipped surrogate with a k3 KL penalty, token-mean (official: core_algos.py), over the
    tokens of `mask`; and no-grad sums: clipped tokens, the KL, and the tokens behind them:

        ratio = exp(logp - old_logp)
        pg    = max(-A * ratio, -A * clip(ratio, 1 - epsilon, 1 + epsilon_high))
        pg    = min(pg, -A * dual_clip)                  where A < 0
        kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1
        loss  = sum_{mask} (pg + beta * kl) / num_tokens

    (B, T) inputs (`advantages` may be (B,)). num_tokens: the mini-batch's response tokens, for
    each of its micro-batches (exact accumulation) and both Lopti stages, whose `mask` is the
    stage's tokens (not renormalised: the stages add up to GRPO)."""
    assert beta == 0 or ref_logprobs is not None, "beta > 0 needs ref_logprobs"
    adv = broadcast_to_tokens(advantages, logprobs)  # (B, T)
    mask = mask.bool()  # (B, T)
    if num_tokens is None:
        num_tokens = mask.sum()
    denom = torch.as_tensor(num_tokens).clamp(min=1)
    # The ratio: 0 on padding before exp (no NaN gradient), clamped as exp overflows
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.float(), 0.0)  # (B, T)
    ratio = log_ratio.clamp(-20, 20).exp()  # (B, T)
    # The clipped surrogate, then the dual clip
    pg_loss1 = -adv * ratio  # (B, T)
    pg_loss2 = -adv * ratio.clamp(1 - epsilon, 1 + epsilon_high)  # (B, T)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # (B, T)
    pg_loss3 = -adv * dual_clip  # (B, T)
    pg_loss = torch.where(adv < 0, torch.minimum(pg_loss, pg_loss3), pg_loss)  # (B, T)
    loss = torch.where(mask, pg_loss, 0.0).sum() / denom
    # The k3 KL penalty, with the official code's clamps
    kl = torch.zeros_like(pg_loss)  # (B, T)
    if ref_logprobs is not None:
        ref_log_ratio = torch.where(mask, ref_logprobs.float() - logprobs.float(), 0.0)  # (B, T)
        ref_log_ratio = ref_log_ratio.clamp(-5, 5)
        kl = (ref_log_ratio.exp() - ref_log_ratio - 1).clamp(-10, 10)  # (B, T)
        kl = torch.where(mask, kl, 0.0)
        loss = loss + beta * kl.sum() / denom
    with torch.no_grad():  # sums (0-dim tensors: no GPU sync), to add up over micro-batches
        clipped_high = (ratio > 1 + epsilon_high) & (adv > 0) & mask  # (B, T)
        clipped_low = (ratio < 1 - epsilon) & (adv < 0) & mask  # (B, T)
        stats = {"clip_high": clipped_high.sum(), "clip_low": clipped_low.sum(), "kl_ref": kl.sum(),
                 "tokens": mask.sum()}
    return loss, stats


# ====== The update: Algorithm 1 (one GRPO pass, or Lopti's two passes) ======


def rows_with_gradient(advantages: Tensor, beta: float) -> Tensor:
    """(B,) bool: the rows with a gradient, those with A != 0, or all when beta > 0 (the KL term).
    An optimisation, not in the paper: the other rows get no pi_old, forward or backward pass, and
    their tokens still count in the token-mean's denominator."""
    nonzero = (advantages != 0).view(len(advantages), -1).any(1)  # (B,)
    return nonzero | (beta > 0)


def lopti_stages(cfg: Config, mask: Tensor, old_logprobs: Tensor) -> list[tuple[str, Tensor]]:
    """The update's passes and their tokens (B, T): GRPO's one, over every response token; Lopti's
    two, low-probability tokens first (Algorithm 1), or high first (the ablation)."""
    if not cfg.lopti:
        return [("all", mask)]
    low, high = lopti_masks(old_logprobs, mask, cfg.eta)
    stages = [("low", low), ("high", high)]
    if cfg.lopti_order == "high_first":
        stages.reverse()
    return stages


def update_policy(cfg: Config, logprob_fn: Callable[[dict], Tensor], optimizer, batch: dict):
    """One RL step's update: AR (Eq. 4), then GRPO's pass or Lopti's two (Algorithm 1).

    cfg: Config's method and update fields (alpha, lopti, eta, lopti_order, epsilon, epsilon_high,
    dual_clip, beta, num_iterations, mini_batch_size, micro_batch_size, max_grad_norm).
    batch: B responses of T tokens, each tensor indexed by row:
        mask          (B, T) bool   the response tokens (padding after each response is False)
        advantages    (B,)          GRPO's group advantages (group_advantages), before AR
        old_logprobs  (B, T)        log pi_old(o_t) at the sampling temperature, no gradient
        ref_logprobs  (B, T)        the reference's, needed when cfg.beta > 0
        and whatever logprob_fn(micro_batch) reads to return the current (b, T) log-probs with
        gradients (the LM run: input_ids and attention_mask, (B, prompt + T))."""
    mask = batch["mask"].bool()  # (B, T)
    # Eq. 4 first: Lopti splits the reweighted advantages
    old_logprobs = batch["old_logprobs"]  # (B, T)
    advantages = reweight_advantages(batch["advantages"], old_logprobs, cfg.alpha)  # (B, T)
    metrics = {}
    # Algorithm 1. Stage 1: the low-probability tokens (pi_old < eta) get a complete update pass.
    # Stage 2: the rest get one, from stage 1's weights and optimiser state, with the same pi_old
    # and split.
    for name, stage_mask in lopti_stages(cfg, mask, old_logprobs):
        stage_advantages = advantages * stage_mask  # (B, T): 0 outside this stage
        pass_metrics = update_pass(cfg, name, logprob_fn, optimizer=optimizer, batch=batch,
                                   advantages=stage_advantages, stage_mask=stage_mask)
        metrics.update(pass_metrics)
    optimizer.zero_grad(set_to_none=True)  # free the gradients before the next rollout
    return metrics


def update_pass(cfg: Config, name: str, logprob_fn: Callable, *, optimizer, batch: dict,
                advantages: Tensor, stage_mask: Tensor) -> dict:
    """A complete pass over the rollout, num_iterations times: an optimiser step per mini-batch, its
    micro-batches' gradients accumulated, on the tokens of `stage_mask` (B, T)."""
    t0 = time.perf_counter()
    mask = batch["mask"].bool()  # (B, T)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with_gradient = rows_with_gradient(batch["advantages"], cfg.beta)  # (B,)
    tokens_with_gradient = mask & with_gradient[:, None]  # (B, T)
    stage_rows = (with_gradient & stage_mask.any(1)).cpu()  # (B,): rows with a gradient here
    totals = collections.Counter()
    losses, grad_norms = [], []
    for _ in range(cfg.num_iterations):
        for start in range(0, len(mask), cfg.mini_batch_size):
            mini_batch = torch.arange(start, min(start + cfg.mini_batch_size, len(mask)))
            rows = mini_batch[stage_rows[mini_batch]]
            if len(rows) == 0:
                continue  # no gradient, no step
            # The token-mean's denominator: every response token of the mini-batch, in both stages
            num_tokens = mask[mini_batch].sum()
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for micro in rows.split(cfg.micro_batch_size):
                micro_batch = {k: v[micro] for k, v in batch.items()}
                logprobs = logprob_fn(micro_batch)  # (b, T)
                loss, stats = policy_loss(
                    logprobs, micro_batch["old_logprobs"], advantages[micro], stage_mask[micro],
                    epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, dual_clip=cfg.dual_clip,
                    ref_logprobs=micro_batch.get("ref_logprobs"), beta=cfg.beta,
                    num_tokens=num_tokens)
                loss.backward()
                loss_sum += loss.detach()
                totals.update(stats)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            optimizer.step()
            grad_norms.append(grad_norm)
            losses.append(loss_sum)  # (a tensor: read once, after the pass)
    return {f"{name}/loss": divide(sum(losses), len(losses)),
            f"{name}/grad_norm": divide(sum(grad_norms), len(grad_norms)),
            f"{name}/clip_high": divide(totals["clip_high"], totals["tokens"]),
            f"{name}/clip_low": divide(totals["clip_low"], totals["tokens"]),
            f"{name}/kl_ref": divide(totals["kl_ref"], totals["tokens"]),
            f"{name}/token_share": divide((stage_mask & tokens_with_gradient).sum(),
                                          tokens_with_gradient.sum()),
            f"time/update_{name}": time.perf_counter() - t0}


def divide(total, count) -> float:
    return float(total) / max(float(count), 1.0)


# ====== Figure 3, per pi_old bin ======
# Bins [0,.25], (.25,.5], (.5,.75], (.75,1]: the share of A > 0 tokens whose probability a step's
# own update raised (Figure 1 (a), (d), measure_bins, is below the banner).

BIN_NAMES = ("[0,.25]", "(.25,.5]", "(.5,.75]", "(.75,1]")


def bin_masks(old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(4, B, T) bool: the response tokens of each pi_old bin."""
    edges = torch.tensor([0.25, 0.5, 0.75], device=mask.device)
    bins = torch.bucketize(old_logprobs.float().exp(), edges)  # (B, T): 0..3
    return torch.stack([(bins == b) & mask.bool() for b in range(4)])


def count_per_bin(tokens: Tensor) -> list[int]:
    """(4, B, T) bool -> the count in each bin."""
    return tokens.sum((1, 2)).tolist()


def update_counts(before: Tensor, after: Tensor, advantages: Tensor, mask: Tensor,
                  old_logprobs: Tensor | None = None) -> dict[str, list[int]]:
    """Figure 3 per bin of `old_logprobs` (default `before`): the A > 0 tokens (A before AR) and how
    many rose or fell from `before` to `after` (one pass's log-probs, so an unmoved token compares
    equal), the A < 0 tokens and how many fell or rose; the rest tied."""
    if old_logprobs is None:
        old_logprobs = before
    bins = bin_masks(old_logprobs, mask)  # (4, B, T)
    adv = broadcast_to_tokens(advantages, before)  # (B, T)
    pos = bins & (adv > 0)  # (4, B, T)
    neg = bins & (adv < 0)  # (4, B, T)
    rose = after > before  # (B, T)
    fell = after < before  # (B, T)
    return {"update/pos_tokens": count_per_bin(pos),
            "update/pos_rose": count_per_bin(pos & rose),
            "update/pos_fell": count_per_bin(pos & fell),
            "update/neg_tokens": count_per_bin(neg),
            "update/neg_fell": count_per_bin(neg & fell),
            "update/neg_rose": count_per_bin(neg & rose)}


# ====== The LLM run: rollout, reward, group advantage, pi_old, update, Figure 3, on K&K ======


def lm_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                temperature: float) -> Tensor:
    """log pi(o_t) at temperature T of the last C = num_completion tokens of left-padded rows
    (B, L): (B, C). The plain computation; the run uses completion_logprobs (below the banner),
    which gives the same in chunks, running a group's shared prompt once."""
    C = num_completion
    # Positions count from each row's first token, as generate() counted them
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=C + 1)
    logits = out.logits[:, :-1]  # (B, C, V): the logits at position t predict token t + 1
    targets = input_ids[:, -C:]  # (B, C)
    return token_logprobs(logits, targets, temperature)  # (B, C)


def completion_mask(completions: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """The response tokens, by position: up to and including the first EOS; and (B,) truncated (no
    EOS). By value (tokens != pad) the EOS is lost when pad == EOS: the model never learns to stop.
    Example, EOS = 2 = pad: [[5, 7, 2, 2, 2], [5, 2, 9, 2, 2], [5, 7, 8, 9, 6]]
        -> mask [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], truncated [F, F, T]"""
    eos = torch.tensor(eos_ids, device=completions.device)
    is_eos = torch.isin(completions, eos).long()  # (B, C)
    eos_before = is_eos.cumsum(1) - is_eos  # (B, C): EOS tokens strictly before each position
    return eos_before == 0, is_eos.sum(1) == 0


@torch.no_grad()
def rollout(model, tokenizer, prompts: list[str], cfg: Config, device, greedy: bool = False):
    """A completion per prompt from pi_old = softmax(z / T), with no top-k, top-p or repetition
    penalty: pi_old must be what the tokens were drawn from. Returns `input_ids`, `attention_mask`
    (B, P + C), the completion `mask` (B, C), `truncated` (B,) and `texts`."""
    from transformers import GenerationConfig
    model.eval()
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    encoded = encoded.to(device)
    eos_ids = eos_token_ids(model, tokenizer)
    sampling = {} if greedy else dict(temperature=cfg.temperature, top_k=0, top_p=1.0)
    stop = "</answer>" if cfg.stop_at_answer else None
    gen_cfg = GenerationConfig(do_sample=not greedy, repetition_penalty=1.0, eos_token_id=eos_ids,
                               pad_token_id=tokenizer.pad_token_id, stop_strings=stop,
                               max_new_tokens=cfg.max_completion_length, **sampling)
    completions = generate_completions(model, tokenizer, encoded, gen_cfg,
                                       batch_size=cfg.generation_batch_size)  # (B, C)
    mask, truncated = completion_mask(completions, eos_ids)  # (B, C), (B,)
    if cfg.stop_at_answer:
        mask, stopped = cut_at(tokenizer, completions, mask, "</answer>")
        truncated = truncated & ~stopped
    pad = tokenizer.pad_token_id
    texts = tokenizer.batch_decode(torch.where(mask, completions, pad), skip_special_tokens=True)
    input_ids = torch.cat([encoded["input_ids"], completions], 1)  # (B, P + C)
    attention_mask = torch.cat([encoded["attention_mask"], torch.ones_like(completions)], 1)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "mask": mask,
            "truncated": truncated, "texts": texts}


def rollout_and_score(cfg: Config, model, ref_model, tokenizer, rows, device) -> tuple[dict, dict]:
    """Algorithm 1, lines 3-5, on K&K rows: G completions per prompt from pi_old, their rewards and
    group advantages, and pi_old's (and the reference's) log-probs, fixed for the step. Returns the
    batch (update_policy's) and the step's rollout metrics, with the first prompt's G completions
    ("samples")."""
    G = cfg.num_generations
    t0 = time.perf_counter()
    prompts = [kk_prompt(tokenizer, quiz) for quiz in rows["quiz"] for _ in range(G)]
    batch = rollout(model, tokenizer, prompts, cfg=cfg, device=device)
    texts = batch.pop("texts")
    truncated = batch.pop("truncated")  # (B,)
    t1 = time.perf_counter()
    # Outcome rewards, GRPO's group advantage
    solutions = [solution for solution in rows["solution_text_format"] for _ in range(G)]
    rewards = score(cfg, texts, solutions)  # (B,): Logic-RL's reward, or cfg.reward's
    batch["advantages"] = group_advantages(rewards, G).to(device)  # (B,)
    # pi_old (and the reference's) by a no-grad pass
    with_gradient = rows_with_gradient(batch["advantages"], cfg.beta)  # (B,)
    batch["old_logprobs"] = batched_logprobs(model, batch, cfg, device=device, rows=with_gradient)
    if ref_model is not None:
        batch["ref_logprobs"] = batched_logprobs(ref_model, batch, cfg, device=device,
                                                 rows=with_gradient)
    t2 = time.perf_counter()
    groups = rewards.view(-1, G)  # (P, G)
    zero_spread = (groups == groups[:, :1]).all(1)  # (P,): no advantage, no learning
    first_group = zip(rewards[:G].tolist(), texts)
    samples = [{"reward": r, "completion": THINK_PREFIX + text} for r, text in first_group]
    metrics = {"reward": rewards.mean().item(),
               "accuracy": (rewards == KK_MAX_REWARD).float().mean().item(),
               "format_error": (rewards == KK_FORMAT_ERROR).float().mean().item(),
               "zero_std_groups": zero_spread.float().mean().item(),
               "completion_length": batch["mask"].sum(1).float().mean().item(),
               "truncated": truncated.float().mean().item(),
               "time/rollout": t1 - t0, "time/logprobs": t2 - t1, "samples": samples}
    return batch, metrics


def train_step(cfg: Config, model, ref_model, tokenizer, optimizer, rows, device,
               probe: Callable | None = None) -> dict:
    """One RL step (Algorithm 1) on K&K rows: its metrics, with Figure 3 of its update
    (cfg.measure_update) and the first prompt's G completions ("samples"). diagnose's `probe`
    measures the batch before the update, leaving the weights as they were."""
    batch, metrics = rollout_and_score(cfg, model, ref_model, tokenizer=tokenizer, rows=rows,
                                       device=device)
    measure = UpdateMeasure(cfg, model, batch, device)  # Figure 3's log-probs before the update
    logprob_fn = functools.partial(policy_logprobs, model, cfg.temperature, device)  # (b, T)
    model.train()  # for gradient checkpointing; dropout is off (load_model)
    if probe is not None:
        metrics.update(probe(batch, measure, logprob_fn))
    metrics.update(update_policy(cfg, logprob_fn, optimizer, batch))
    if cfg.measure_update:
        metrics.update(measure.counts())  # update_counts of before and after
    return metrics


def train(cfg: Config, resume: bool = False) -> Path:
    """GRPO (+AR, +Lopti) on K&K into cfg.output_dir: config.json, metrics.jsonl (a line per step
    and per evaluation), samples.jsonl, checkpoint-STEP/. Returns the last checkpoint. Run (below
    the banner) holds the plumbing: folder, data, model, warm-up, resume, checkpoints and logs."""
    # Ctrl-C or SIGTERM: the step ends and is saved (in the warm-up: redone); exit 130 or 143
    with StopOnSignal() as stop, Run(cfg, resume, stop) as run:
        run.evaluate_if_due(run.start)  # step 0, after the warm-up (or a resumed run's last)
        for step in range(run.start + 1, cfg.steps + 1):
            rows = run.train_rows[step_rows(len(run.train_rows), cfg, step - 1)]
            metrics = train_step(cfg, run.model, run.ref_model, tokenizer=run.tokenizer,
                                 optimizer=run.optimizer, rows=rows, device=run.device)
            run.end_step(step, rows, metrics)  # logs, checkpoint, evaluation; after a signal: exit
    return checkpoints(run.out)[-1]


# ====== A first read can stop here ======
# The harness (the module docstring lists it).

# --- Config's ranges


def check_config(cfg: Config) -> None:
    for f in fields(cfg):
        if isinstance(getattr(cfg, f.name), float):
            _require(cfg, f.name, math.isfinite(getattr(cfg, f.name)), "a finite number")
    for name in ("epsilon", "epsilon_high", "beta", "weight_decay", "generation_batch_size",
                 "eval_every", "save_every", "seed", "warmup_steps"):
        _require(cfg, name, getattr(cfg, name) >= 0, ">= 0")
    for name in ("learning_rate", "warmup_learning_rate", "temperature", "max_grad_norm",
                 "micro_batch_size", "num_iterations", "num_train", "max_completion_length",
                 "steps", "eval_size", "eval_batch_size", "prompts_per_step", "num_generations"):
        _require(cfg, name, getattr(cfg, name) > 0, "> 0")
    _require(cfg, "seed", cfg.seed < 2**32, "below 2**32")
    _require(cfg, "alpha", 0 <= cfg.alpha <= 1, "in [0, 1]")
    _require(cfg, "eta", 0 < cfg.eta <= 1, "in (0, 1]")
    _require(cfg, "dual_clip", cfg.dual_clip > 1, "> 1")
    lo, hi = people_range(cfg.num_people)
    _require(cfg, "num_people", 2 <= lo <= hi <= 8, "within 2..8")
    _require(cfg, "lopti_order", cfg.lopti_order in ("low_first", "high_first"),
             "low_first or high_first")
    _require(cfg, "optimizer", cfg.optimizer in ("adamw", "sgd"), "adamw or sgd")
    _require(cfg, "report_to", cfg.report_to in ("none", "tensorboard"), "none or tensorboard")
    reward_ok = callable(cfg.reward) or cfg.reward == "kk" or ":" in cfg.reward
    _require(cfg, "reward", reward_ok, "kk, FILE.py:FUNCTION, MODULE:FUNCTION or a function")
    if cfg.report_to == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # missing, too old, a protobuf clash
            raise ValueError("--report_to tensorboard needs a working tensorboard: pip install "
                             f"tensorboard ({_first_line(e)})") from None
    rollout_size = cfg.prompts_per_step * cfg.num_generations
    mini = cfg.mini_batch_size
    divides = mini > 0 and rollout_size % mini == 0 and mini % cfg.micro_batch_size == 0
    allowed = f"a divisor of prompts_per_step * num_generations ({rollout_size}), x micro size"
    _require(cfg, "mini_batch_size", divides, allowed)


def _require(settings, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {getattr(settings, name)!r}")


def people_range(spec: str) -> tuple[int, int]:  # '3-7' -> (3, 7); '5' -> (5, 5)
    lo, _, hi = spec.partition("-")
    if not (lo.isdigit() and (hi.isdigit() or not hi)):
        raise ValueError(f"num_people must be 'lo-hi' or a number, e.g. '3-7', got {spec!r}")
    return int(lo), int(hi or lo)


# --- An LM's log-probs


def _head_logprobs(hidden: Tensor, head: torch.nn.Linear, tokens: Tensor, temperature: float):
    return token_logprobs(head(hidden), tokens, temperature)  # (n,), of hidden states (n, H)


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids counted from each row's first token, as generate() counts them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def hidden_logprobs(hidden: Tensor, head: torch.nn.Linear, tokens: Tensor, temperature: float = 1.0,
                    chunk_elems: int = 2**24) -> Tensor:
    """token_logprobs of head(hidden), hidden (B, T, H), in chunks of ~chunk_elems logits: the
    (B, T, V) logits never exist whole; under autograd the backward pass recomputes them."""
    rows = max(1, chunk_elems // head.out_features)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
    flat_tokens = tokens.reshape(-1)  # (B*T,)
    chunks = []
    for i in range(0, len(flat_tokens), rows):
        args = (flat_hidden[i:i + rows], head, flat_tokens[i:i + rows], temperature)
        if torch.is_grad_enabled():
            chunks.append(checkpoint(_head_logprobs, *args, use_reentrant=False))
        else:
            chunks.append(_head_logprobs(*args))
    if not chunks:
        return torch.zeros(tokens.shape, device=hidden.device)
    return torch.cat(chunks).view(tokens.shape)  # (B, T)


def prefix_cache(model, input_ids: Tensor, attention_mask: Tensor):
    """A group's shared prompt run once, forward and backward: the KV cache of each distinct prompt
    indexed back to every row (differentiably), and the last hidden state (B, 1, H)."""
    L = input_ids.shape[1]
    both = torch.cat([input_ids, attention_mask], 1)  # (B, 2L)
    distinct, inverse = torch.unique(both, dim=0, return_inverse=True)  # (U, 2L), (B,)
    ids, attention = distinct[:, :L], distinct[:, L:]  # (U, L) each
    position_ids = positions(attention)  # (U, L)
    out = model.base_model(input_ids=ids, attention_mask=attention, position_ids=position_ids,
                           use_cache=True)
    out.cache.batch_select_indices(inverse)
    return out.cache, out.last_hidden_state[inverse, -1:]


def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                      temperature: float) -> Tensor:
    """lm_logprobs (B, C), in chunks (hidden_logprobs); a group's shared prompt runs once
    (prefix_cache), except under checkpointing."""
    C = num_completion
    position_ids = positions(attention_mask)  # (B, L)
    targets = input_ids[:, -C:]  # (B, C)
    shared = len(torch.unique(input_ids[:, :-C], dim=0)) < len(input_ids) and C > 1
    checkpointing = model.is_activation_checkpointing and model.training  # (HF drops a cache then)
    if shared and not checkpointing:
        # The whole prompt once: its last hidden state predicts o_1; then o_1..o_{C-1}, cached
        cache, prompt_end = prefix_cache(model, input_ids[:, :-C], attention_mask[:, :-C])
        rest = model.base_model(input_ids=targets[:, :-1], attention_mask=attention_mask[:, :-1],
                                position_ids=position_ids[:, -C:-1], cache=cache).last_hidden_state
        hidden = torch.cat([prompt_end, rest], 1)  # (B, C, H): position t predicts o_{t+1}
    else:
        out = model.base_model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                               position_ids=position_ids[:, :-1], use_cache=False)
        hidden = out.last_hidden_state[:, -C:]  # (B, C, H)
    return hidden_logprobs(hidden, model.get_output_embeddings(), targets, temperature)  # (B, C)


def policy_logprobs(model, temperature: float, device, micro_batch: dict) -> Tensor:
    """The update's completion_logprobs (b, C), under autocast."""
    with autocast(device):
        return completion_logprobs(model, micro_batch, temperature)


def completion_logprobs(model, micro: dict, temperature: float) -> Tensor:
    """sequence_logprobs (b, C) of a micro-batch, run only up to its longest completion (exact, as
    attention is causal); later columns are 0."""
    C = micro["mask"].shape[1]
    columns = micro["mask"].any(0).nonzero()
    used = int(columns[-1]) + 1 if len(columns) else 1
    end = micro["input_ids"].shape[1] - C + used
    input_ids = micro["input_ids"][:, :end]
    attention_mask = micro["attention_mask"][:, :end]
    logprobs = sequence_logprobs(model, input_ids, attention_mask, used, temperature)  # (b, used)
    return torch.nn.functional.pad(logprobs, (0, C - used))  # (b, C)


@torch.no_grad()
def batched_logprobs(model, batch: dict, cfg: Config, device, rows: Tensor | None = None,
                     fp32: bool = False) -> Tensor:
    """No-grad log-probs (B, C): pi_old's, the reference's or Figure 3's; of `rows` if given."""
    model.eval()
    out = torch.zeros(batch["mask"].shape, device=batch["mask"].device)  # (B, C)
    index = torch.arange(len(out)) if rows is None else rows.nonzero().squeeze(1).cpu()
    for micro in split_rows(index, cfg.micro_batch_size):
        micro_batch = {k: batch[k][micro] for k in ("input_ids", "attention_mask", "mask")}
        with autocast(device, enabled=not fp32):
            out[micro] = completion_logprobs(model, micro_batch, cfg.temperature)
    return out


def split_rows(rows: Tensor, size: int) -> list[Tensor]:
    """Row indices in chunks of `size`; none for no rows (torch.split would give one, empty)."""
    return list(rows.split(size)) if len(rows) else []


class UpdateMeasure:
    """Figure 3 of one update from log-probs before and after it, each of one pass (an unmoved token
    compares equal): pi_old's, or under bf16 an fp32 pass (bf16 rounds by 0.4 %, more than lr 1e-6
    moves); after, an fp32 pass."""

    def __init__(self, cfg: Config, model, batch: dict, device):
        self.cfg, self.model, self.batch, self.device = cfg, model, batch, device
        t0 = time.perf_counter()
        self.before = batch["old_logprobs"]
        if cfg.measure_update and has_bf16(device):
            self.before = self.logprobs()
        self.seconds = time.perf_counter() - t0

    def logprobs(self) -> Tensor:  # (B, C), now
        rows = rows_with_gradient(self.batch["advantages"], self.cfg.beta)  # (B,)
        out = batched_logprobs(self.model, self.batch, self.cfg, self.device, rows=rows, fp32=True)
        wait_for_device(self.device)  # (CUDA is asynchronous: else its time lands elsewhere)
        return out

    def counts(self) -> dict:  # update_counts from before to now
        t0 = time.perf_counter()
        counts = update_counts(self.before, self.logprobs(), advantages=self.batch["advantages"],
                               mask=self.batch["mask"], old_logprobs=self.batch["old_logprobs"])
        return {**counts, "time/measure": self.seconds + time.perf_counter() - t0}


# --- The rollout's speed


def generate_completions(model, tokenizer, encoded: dict, gen_cfg, batch_size: int) -> Tensor:
    """model.generate() in batches of `batch_size` rows (0: one batch), a group's shared prompt run
    once (prefix_cache): the completions (B, C), right-padded."""
    # generate() fills fields left at their defaults from the model's generation config (Qwen's:
    # top_p 0.8, top_k 20, repetition_penalty 1.05), so ours replaces it while generating
    saved_gen_cfg = model.generation_config
    model.generation_config = gen_cfg
    device = encoded["input_ids"].device
    chunk = batch_size or len(encoded["input_ids"])
    parts = []
    try:
        for i in range(0, len(encoded["input_ids"]), chunk):
            ids = encoded["input_ids"][i:i + chunk]  # (b, P)
            attention = encoded["attention_mask"][i:i + chunk]  # (b, P)
            shared = len(torch.unique(ids, dim=0)) < len(ids)
            with autocast(device):  # the prompt but its last token: generate() runs at least one
                cache = prefix_cache(model, ids[:, :-1], attention[:, :-1])[0] if shared else None
                out = model.generate(input_ids=ids, attention_mask=attention, cache=cache,
                                     generation_config=gen_cfg, tokenizer=tokenizer)
            parts.append(out[:, ids.shape[1]:])  # (b, C_i)
    finally:
        model.generation_config = saved_gen_cfg
    length = max(part.shape[1] for part in parts)
    pad = tokenizer.pad_token_id
    padded = [torch.nn.functional.pad(p, (0, length - p.shape[1]), value=pad) for p in parts]
    return torch.cat(padded)  # (B, C)


def cut_at(tokenizer, completions: Tensor, mask: Tensor, stop: str) -> tuple[Tensor, Tensor]:
    """Each row's `mask` ended at the token that completes the text `stop`; and (B,) stopped."""
    mask = mask.clone()
    stopped = torch.zeros(len(mask), dtype=torch.bool, device=mask.device)
    for i, row in enumerate(completions.tolist()):
        pieces = tokenizer.batch_decode([[token] for token in row[:int(mask[i].sum())]])
        at = "".join(pieces).find(stop)
        if at >= 0:
            ends = torch.tensor([len(piece) for piece in pieces]).cumsum(0)  # text length per token
            last = int((ends < at + len(stop)).sum())
            mask[i, last + 1:] = False
            stopped[i] = True
    return mask, stopped


# --- Figure 1 (a), (d)


def global_norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def measure_bins(micro_batch_size: int, model, logprob_fn: Callable, batch: dict) -> dict:
    """Figure 1 (a) and (d) on one batch: per bin, its share of the tokens of rows with A != 0, and
    the norm of GRPO's gradient at ratio 1 with only its advantages kept (linear in A: the bins'
    gradients add up to the all-token one, "all")."""
    params = [p for p in model.parameters() if p.requires_grad]
    mask = batch["mask"].bool()  # (B, T)
    bins = bin_masks(batch["old_logprobs"], mask)  # (4, B, T)
    num_tokens = mask.sum()
    bin_grads = [[torch.zeros_like(p) for p in params] for _ in bins]  # [bin][parameter]
    with_gradient = rows_with_gradient(batch["advantages"], 0.0)  # (B,): the rest may lack pi_old
    for micro in split_rows(with_gradient.nonzero().squeeze(1).cpu(), micro_batch_size):
        micro_batch = {k: v[micro] for k, v in batch.items()}
        logprobs = logprob_fn(micro_batch)  # (b, T)
        advantages = broadcast_to_tokens(micro_batch["advantages"], logprobs)  # (b, T)
        for b, bin_mask in enumerate(bins):
            bin_advantages = advantages * bin_mask[micro]  # (b, T)
            loss, _ = policy_loss(logprobs, logprobs.detach(), bin_advantages, mask[micro],
                                  num_tokens=num_tokens)
            last_bin = b == len(bins) - 1  # the graph of this forward is kept for the next bins
            grads = torch.autograd.grad(loss, params, retain_graph=not last_bin,
                                        materialize_grads=True)
            for total, grad in zip(bin_grads[b], grads):
                total += grad
    tokens_with_gradient = mask & with_gradient[:, None]  # (B, T)
    shares = []
    for bin_mask in bins:
        tokens = (bin_mask & tokens_with_gradient).sum()
        share = tokens / tokens_with_gradient.sum()
        shares.append(float(share) if tokens_with_gradient.any() else None)
    all_grads = [sum(bin_grad[k] for bin_grad in bin_grads) for k in range(len(params))]
    grad_norms = {"bins": [global_norm(g) for g in bin_grads], "all": global_norm(all_grads)}
    return {"token_share": shares, "grad_norm": grad_norms}


# --- Figure 3 paired

UPDATE_KEYS = ("pos_tokens", "pos_rose", "pos_fell", "neg_tokens", "neg_fell", "neg_rose")
METHODS = {
    "grpo": dict(alpha=0.0, lopti=False),
    "ar": dict(lopti=False),
    "lopti": dict(alpha=0.0, lopti=True),
    "ar_lopti": dict(lopti=True),
    "grpo_2_epochs": dict(alpha=0.0, lopti=False),  # Lopti's number of passes: compute-matched
    "lopti_high_first": dict(alpha=0.0, lopti=True, lopti_order="high_first"),  # the ablation
}


def method_config(cfg: Config, method: str) -> Config:
    """`cfg` switched to one of METHODS."""
    changes = {"lopti_order": "low_first", **METHODS[method]}
    if method in ("ar", "ar_lopti"):
        changes["alpha"] = cfg.alpha if cfg.alpha > 0 else Config.alpha
    if method == "grpo_2_epochs":
        changes["num_iterations"] = 2 * cfg.num_iterations
    return dataclasses.replace(cfg, **changes)


def method_name(cfg: dict) -> str:
    """grpo, ar, lopti or ar_lopti (+ _high_first, the ablation; + _N_epochs), from a config."""
    names = {(False, False): "grpo", (True, False): "ar", (False, True): "lopti",
             (True, True): "ar_lopti"}
    name = names[cfg["alpha"] > 0, cfg["lopti"]]
    if cfg["lopti"] and cfg["lopti_order"] == "high_first":
        name += "_high_first"
    if cfg["num_iterations"] > 1:
        name += f"_{cfg['num_iterations']}_epochs"
    return name


def pool_counts(records: list[dict]) -> dict[str, list[int]]:  # summed per bin
    pooled = {}
    for key in UPDATE_KEYS:
        rows = [record.get(f"update/{key}", [0] * 4) for record in records]
        pooled[f"update/{key}"] = [sum(row[b] for row in rows) for b in range(4)]
    return pooled


def per_bin(counts: list, totals: list) -> list:
    return [c / t if t else None for c, t in zip(counts, totals)]


def figure3_shares(counts: dict) -> dict[str, list]:
    """Per bin: the share of A > 0 tokens that rose (Figure 3), of those that moved, that tied."""
    tokens = counts["update/pos_tokens"]
    rose = counts["update/pos_rose"]
    moved = [r + f for r, f in zip(rose, counts["update/pos_fell"])]
    tied = [n - m for n, m in zip(tokens, moved)]
    return {"rose": per_bin(rose, tokens), "rose_of_moved": per_bin(rose, moved),
            "ties": per_bin(tied, tokens)}


def copy_to_cpu(state):
    """A deep copy, its tensors on the CPU: the GPU holds one model and optimiser state."""
    if torch.is_tensor(state):
        return state.to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: copy_to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [copy_to_cpu(v) for v in state]
    return copy.deepcopy(state)


def paired_counts(cfg: Config, model, optimizer, logprob_fn: Callable, batch: dict,
                  measure: Callable[[], Tensor], before: Tensor, methods) -> dict[str, dict]:
    """Figure 3 paired: each method's whole update from the same weights, optimiser state and batch,
    undone bit for bit: a difference between methods is theirs, not their batches'."""
    weights = copy_to_cpu(model.state_dict())
    optimizer_state = copy_to_cpu(optimizer.state_dict())
    counts = {}
    for method in methods:
        update_policy(method_config(cfg, method), logprob_fn, optimizer, batch)
        after = measure()
        counts[method] = update_counts(before, after, batch["advantages"], batch["mask"],
                                       batch["old_logprobs"])
        model.train()  # (measure() left it in eval mode)
        model.load_state_dict(weights)
        optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # (it keeps the tensors given)
    return counts


def sign_patterns(units: int, resamples: int) -> Tensor:
    """(S, units) signs, a pattern per row: all 2^units up to 12 units (an exact test); past 12, the
    observed one (all +1, so that p is never 0) and `resamples` random ones."""
    if units <= 12:
        return torch.tensor(list(itertools.product((1.0, -1.0), repeat=units)), dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(0, 2, (resamples, units), generator=generator).double() * 2 - 1
    observed = torch.ones(1, units, dtype=torch.float64)
    return torch.cat([observed, random])


def sign_flip_p(differences: Tensor, resamples: int = 4000) -> Tensor:
    """Two-sided sign-flip test of a zero sum, per column of paired differences (U, K): the share of
    sign patterns whose sum is at least as far from 0 as the observed one. (K,)"""
    signs = sign_patterns(len(differences), resamples)  # (S, U)
    as_extreme = ((signs @ differences).abs() >= differences.sum(0).abs() - 1e-9).double()
    return as_extreme.mean(0)  # (K,)


def paired_deltas(units: list[dict], reference: str = "grpo",
                  resamples: int = 4000) -> dict[str, dict]:
    """Per method and bin, over units (steps, or seeds' sums) of paired_counts: its share of A > 0
    tokens that rose minus the reference's (delta), and a two-sided sign-flip test of delta = 0.
    'resolved' is p < 0.05, which 5 units never reach (p >= 2/32)."""
    def counts(method: str, key: str) -> Tensor:  # (U, 4)
        return torch.tensor([u[method][f"update/{key}"] for u in units], dtype=torch.float64)

    n = counts(reference, "pos_tokens")
    reference_rose = counts(reference, "pos_rose")
    out = {}
    for method in [m for m in units[0] if m != reference]:
        d = counts(method, "pos_rose") - reference_rose  # (U, 4)
        p = sign_flip_p(d, resamples)  # (4,)
        delta = [float(v / k) if k else None for v, k in zip(d.sum(0), n.sum(0))]
        resolved = [x is not None and q < 0.05 for x, q in zip(delta, p.tolist())]
        out[method] = {"delta": delta, "p": p.tolist(), "resolved": resolved}
    return out


# --- The toy: Figure 3's mechanism on a linear softmax policy (design: toy/README.md)
# logits_t = weight @ x_t + bias_t over 1,024 tokens. The weight, the only one trained, is shared by
# every context, as an LLM's output layer is; as ||x_t|| = 1, a token's gradient on it has norm
# ||e_j - pi||: Prop. 4.2 with one layer.


@dataclass(frozen=True)
class ToySettings:
    seed: int = 0  # run i of `seeds` has its own random task and samples: seed + i
    seeds: int = 8  # trajectories per method (p < 0.05 needs 6+: paired_deltas)
    steps: int = 10  # RL steps per trajectory
    optimizer: str = "adamw"  # or "sgd"
    learning_rate: float = 1e-2
    alpha: float = 0.3
    eta: float = 0.5
    vocab: int = 1024
    dim: int = 32
    prompts: int = 8
    group: int = 8
    length: int = 8  # tokens per response
    decisions: int = 2  # the first tokens, which decide the reward
    target_gap: float = 0.5  # a target's bias is the bigram token's minus this

    def __post_init__(self):  # a bad --setting is one line (main)
        for name in ("seeds", "steps", "dim", "prompts"):
            _require(self, name, getattr(self, name) >= 1, ">= 1")
        _require(self, "vocab", self.vocab >= max(2, self.prompts), ">= 2 and >= prompts (ids)")
        _require(self, "group", self.group >= 2, ">= 2")
        _require(self, "decisions", 1 <= self.decisions <= self.length, "in 1..length")
        _require(self, "target_gap", self.target_gap >= 0, ">= 0")


TOY_QUICK = dict(seeds=2, steps=5)
TOY_OWN_RUNS = tuple(METHODS)  # each trains its own trajectories, on the same seeds
TOY_PAIRED = ("ar", "lopti", "ar_lopti", "grpo_2_epochs", "lopti_high_first")  # along GRPO's
# Rewards paired by seed: vs GRPO, vs grpo_2_epochs (compute-matched); the ablation vs Lopti
TOY_REWARD_PAIRS = (*[(m, "grpo") for m in TOY_PAIRED],
                    *[(m, "grpo_2_epochs") for m in TOY_PAIRED if m != "grpo_2_epochs"],
                    ("lopti_high_first", "lopti"))


class ToyPolicy(torch.nn.Module):
    """Only `weight` is trained; a rollout's contexts and biases are fixed (sample): a pass is a
    matmul."""

    def __init__(self, settings: ToySettings, seed: int):
        super().__init__()
        vocab, dim = settings.vocab, settings.dim
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.recurrence = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0] * 0.5
        self.features = torch.randn(vocab, dim, generator=g)  # of tokens (and prompts)
        self.bigram = torch.randint(vocab, (vocab,), generator=g)  # each token's likely next
        self.strength = 4 + 7 * torch.rand(vocab, generator=g)  # and the bias it gets
        self.target = torch.randint(vocab, (settings.prompts, settings.decisions), generator=g)
        self.settings = settings

    def forward(self, x: Tensor, bias_at: Tensor, bias: Tensor) -> Tensor:
        """Logits (B, T, V) from contexts x (B, T, d), plus the biases `bias` at ids `bias_at`."""
        return (x @ self.weight.T).scatter_add(-1, bias_at, bias)

    @torch.no_grad()
    def sample(self, prompts: Tensor, gen: torch.Generator) -> dict[str, Tensor]:
        """Responses (B, T) to `prompts` (B,), with their contexts and biases: each token's bigram
        successor gets its strength; a decision's target (the answer) that less target_gap."""
        s = self.settings
        x = torch.zeros(len(prompts), s.dim)  # (B, d)
        prev = prompts  # (B,)
        out = collections.defaultdict(list)
        for t in range(s.length):
            x = torch.tanh(self.features[prev] + x @ self.recurrence.T)
            x = x / x.norm(dim=-1, keepdim=True)  # (B, d)
            target = self.target[prompts, min(t, s.decisions - 1)]  # (B,)
            bias_at = torch.stack([self.bigram[prev], target], 1)  # (B, 2)
            target_bias = (self.strength[prev] - s.target_gap).clamp(min=0)  # (B,)
            if t >= s.decisions:
                target_bias = torch.zeros_like(target_bias)
            bias = torch.stack([self.strength[prev], target_bias], 1)  # (B, 2)
            uniform = torch.rand(len(prompts), s.vocab, generator=gen)  # (B, V)
            gumbel = -(-uniform.log()).log()  # argmax(logits + gumbel) samples softmax(logits)
            logits = self(x, bias_at, bias)  # (B, V)
            prev = (logits + gumbel).argmax(-1)  # (B,)
            for key, value in (("tokens", prev), ("x", x), ("bias_at", bias_at), ("bias", bias)):
                out[key].append(value)
        return {key: torch.stack(values, 1) for key, values in out.items()}


def toy_logprobs(net: ToyPolicy, batch: dict) -> Tensor:
    logits = net(batch["x"], batch["bias_at"], batch["bias"])  # (B, T, V)
    return token_logprobs(logits, batch["tokens"])  # (B, T)


def toy_rollout(net: ToyPolicy, gen: torch.Generator) -> dict[str, Tensor]:
    """Algorithm 1, lines 3-5: G samples per prompt, outcome rewards, group advantages, pi_old."""
    prompts = torch.arange(net.settings.prompts).repeat_interleave(net.settings.group)  # (B,)
    batch = net.sample(prompts, gen)
    decided = batch["tokens"][:, :net.settings.decisions]  # (B, decisions)
    rewards = (decided == net.target[prompts]).all(1).float()  # (B,)
    batch["mask"] = torch.ones_like(batch["tokens"], dtype=torch.bool)
    batch["rewards"] = rewards
    batch["advantages"] = group_advantages(rewards, net.settings.group)
    with torch.no_grad():
        batch["old_logprobs"] = toy_logprobs(net, batch)
    return batch


def toy_config(s: ToySettings) -> Config:
    """2 optimiser steps a pass, as the paper's; no weight decay (the paper's analysis has none;
    Lopti would decay twice)."""
    rollout_size = s.prompts * s.group
    half = rollout_size // 2 if rollout_size % 2 == 0 else rollout_size
    return Config(alpha=s.alpha, eta=s.eta, learning_rate=s.learning_rate, optimizer=s.optimizer,
                  weight_decay=0.0, beta=0.0, temperature=1.0, num_generations=s.group,
                  prompts_per_step=s.prompts, mini_batch_size=half, micro_batch_size=half)


def toy_trajectory(s: ToySettings, method: str, seed: int, paired: tuple = ()) -> dict:
    """`method` trained on seed `seed`'s task: per step the reward, Figure 3 counts, and
    paired_counts of `paired` (plus `method`'s own)."""
    net = ToyPolicy(s, seed)
    sampler = torch.Generator().manual_seed(seed)
    base = toy_config(s)
    cfg = method_config(base, method)
    optimizer = make_optimizer(net, cfg)
    logprob_fn = functools.partial(toy_logprobs, net)
    out = {"reward": [], "counts": [], "paired": []}
    for _ in range(s.steps):
        batch = toy_rollout(net, sampler)

        def measure() -> Tensor:
            with torch.no_grad():
                return toy_logprobs(net, batch)

        before = batch["old_logprobs"]
        probes = paired_counts(base, net, optimizer, logprob_fn, batch, measure, before, paired)
        update_policy(cfg, logprob_fn, optimizer, batch)
        counts = update_counts(before, measure(), batch["advantages"], batch["mask"])
        out["reward"].append(float(batch["rewards"].mean()))
        out["counts"].append(counts)
        out["paired"].append({method: counts, **probes})
    return out


def run_toy(s: ToySettings, workers: int = 1) -> dict:
    """Every part of the toy, a pure function of `s` (torch's threads fixed to one, also in each of
    the `workers` processes that share out the trajectories)."""
    methods = [method for method in TOY_OWN_RUNS for _ in range(s.seeds)]
    settings = [s] * len(methods)
    seeds = [s.seed + i for _ in TOY_OWN_RUNS for i in range(s.seeds)]
    paired = [TOY_PAIRED if method == "grpo" else () for method in methods]
    if workers > 1:
        pool = concurrent.futures.ProcessPoolExecutor(workers, initializer=torch.set_num_threads,
                                                      initargs=(1,))
        with pool:
            trajectories = list(pool.map(toy_trajectory, settings, methods, seeds, paired))
    else:
        trajectories = list(map(toy_trajectory, settings, methods, seeds, paired))
    runs = {m: trajectories[k * s.seeds:(k + 1) * s.seeds] for k, m in enumerate(TOY_OWN_RUNS)}
    # Figure 3 of each method's own runs, their steps pooled
    figure3 = {"rose": {}, "rose_of_moved": {}, "ties": {}}
    for method, trajectories in runs.items():
        shares = figure3_shares(pool_counts([c for run in trajectories for c in run["counts"]]))
        for key in figure3:
            figure3[key][method] = shares[key]
    # Rewards: each seed's per step; paired by seed on the second half of the steps
    reward = {m: [run["reward"] for run in trajectories] for m, trajectories in runs.items()}
    late = {m: late_reward(rewards) for m, rewards in reward.items()}  # (seeds,) each
    reward_paired = {}
    for method, reference in TOY_REWARD_PAIRS:
        differences = (late[method] - late[reference]).unsqueeze(1)  # (seeds, 1)
        p = float(sign_flip_p(differences)[0])
        reward_paired[f"{method} - {reference}"] = {"delta": float(differences.mean()), "p": p,
                                                    "resolved": p < 0.05}
    # Figure 3 paired along GRPO's trajectories; a unit is a seed, its steps pooled
    units = []
    for run in runs["grpo"]:
        methods = run["paired"][0]
        units.append({m: pool_counts([step[m] for step in run["paired"]]) for m in methods})
    figure3["paired"] = paired_deltas(units)
    # Figure 1 and Prop. 4.2 on a first batch
    net = ToyPolicy(s, s.seed)
    batch = toy_rollout(net, torch.Generator().manual_seed(s.seed))
    figure1 = measure_bins(len(batch["mask"]), net, functools.partial(toy_logprobs, net), batch)
    with torch.no_grad():
        probs = net(batch["x"], batch["bias_at"], batch["bias"]).double().softmax(-1)  # (B, T, V)
    lower, norm, upper = logit_gradient_bounds(probs, batch["tokens"])  # (B, T) each
    within = (lower <= norm) & (norm <= upper)  # (B, T)
    chosen = torch.nn.functional.one_hot(batch["tokens"], s.vocab).double()  # (B, T, V)
    rest = (probs * (1 - chosen)).sum(-1)  # (B, T): 1 - pi_j
    norm_over_rest = norm / rest  # (B, T)
    prop_4_2 = {"tokens": norm.numel(), "within": int(within.sum()),
                "norm_over_rest": [float(norm_over_rest.min()), float(norm_over_rest.max())]}
    return {"settings": asdict(s), "bins": BIN_NAMES, "figure1": figure1, "prop_4_2": prop_4_2,
            "reward": reward, "reward_late": {m: float(r.mean()) for m, r in late.items()},
            "reward_paired": reward_paired, "figure3": figure3}


def late_reward(rewards: list[list[float]]) -> Tensor:
    """Each seed's mean reward over the second half of its steps (or its one step): (seeds,)"""
    rewards = torch.tensor(rewards, dtype=torch.float64)  # (seeds, steps)
    return rewards[:, rewards.shape[1] // 2:].mean(1)


def plot_toy(r: dict, out: Path) -> None:
    """figures.png: Figure 1 (a), (d) on a first batch, Figure 3 of each method's own runs, its
    mean reward per step."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    bins = range(len(r["bins"]))
    figure1 = r["figure1"]
    shares = [math.nan if x is None else x for x in figure1["token_share"]]  # (None: no token)
    axes[0].bar([b - 0.2 for b in bins], shares, 0.4, label="share of tokens")
    all_tokens = figure1["grad_norm"]["all"] or math.nan
    norms = [n / all_tokens for n in figure1["grad_norm"]["bins"]]
    axes[0].bar([b + 0.2 for b in bins], norms, 0.4, label="gradient norm / all tokens'")
    axes[0].set(title="Figure 1 (a), (d): first batch, GRPO")
    for method, rose in r["figure3"]["rose"].items():
        axes[1].plot(bins, [math.nan if x is None else x for x in rose], marker="o", label=method)
    axes[1].set(title="Figure 3: share of A > 0 tokens that rose", ylabel="own runs, steps pooled")
    for ax in axes[:2]:
        ax.set_xticks(list(bins), r["bins"])
        ax.set_xlabel("pi_old bin")
    for method, seeds in r["reward"].items():
        mean = torch.tensor(seeds).mean(0)  # (steps,)
        axes[2].plot(range(1, len(mean) + 1), mean, label=method)
    axes[2].set(title=f"mean reward over {len(seeds)} seeds", xlabel="RL step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def pyplot():
    """matplotlib.pyplot, drawing to files; without matplotlib, one ValueError."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("figures need matplotlib: pip install matplotlib") from None
    return plt


def fmt_p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p {p:.3f}"


def fmt_list(xs: list, spec: str = ".3f") -> str:
    return " / ".join("-" if x is None else format(x, spec) for x in xs)


def toy_checks(r: dict) -> list[str]:  # the lines `lopti.py toy` prints
    p = r["prop_4_2"]
    lo, hi = p["norm_over_rest"]
    holds = "yes" if p["within"] == p["tokens"] else "NO "
    bound = "sqrt(N/(N-1)) (1 - pi_j) <= ||e_j - pi|| <= sqrt(2) (1 - pi_j)"
    checks = [f"[{holds}] Prop. 4.2, {bound}, holds on {p['within']} of {p['tokens']} sampled "
              f"tokens: ||e_j - pi|| / (1 - pi_j) from {lo:.3f} to {hi:.3f}"]
    rose = r["figure3"]["rose"]["grpo"]
    if None in (rose[0], rose[3]):
        checks.append(f"[NO ] GRPO's lowest or top bin has no A > 0 token: {fmt_list(rose)}")
    else:
        gap = rose[0] - rose[3]
        declines = "yes" if gap >= 0.05 else "NO "
        checks.append(f"[{declines}] GRPO's top bin rose at least 0.05 less often than its lowest: "
                      f"{fmt_list(rose)} (lowest - top {gap:+.3f})")
    for method, shares in r["figure3"]["rose"].items():
        checks.append(f"[own runs] {method} rose {fmt_list(shares)}")
    for method, d in r["figure3"]["paired"].items():
        verdict = "does not resolve"
        if d["delta"][3] is None:
            verdict = "has no top-bin token for"
        elif d["resolved"][3]:
            verdict = "raises" if d["delta"][3] > 0 else "lowers"
        every_bin = fmt_list(d["delta"], "+.3f")
        top = "-" if d["delta"][3] is None else f"{d['delta'][3]:+.3f}"
        checks.append(f"[paired] {method} {verdict} the top bin's share vs GRPO: "
                      f"{top}, {fmt_p(d['p'][3])}; every bin {every_bin}")
    steps = r["settings"]["steps"]
    for pair, d in r["reward_paired"].items():
        verdict = "not resolved"
        if d["resolved"]:
            verdict = "higher" if d["delta"] > 0 else "lower"
        checks.append(f"[reward] {pair}, steps {steps // 2 + 1}-{steps}, paired by seed: "
                      f"{d['delta']:+.3f}, {fmt_p(d['p'])}: {verdict}")
    return checks


# --- Knights and Knaves: the paper's task, its prompt and reward (Logic-RL's)
# Data: the K&K benchmark (github.com/AlphaPav/mem-kk-logic) as Logic-RL ships it (the official
# code's data/kk/instruct/); reward: Logic-RL's verl/utils/reward_score/kk.py, as in AR-Lopti.


KK_MAX_REWARD = 3.0  # format +1 and answer +2: accuracy is the share of completions scoring this
KK_FORMAT_ERROR = -3.0  # format -1, and the answer is not read (-2)
THINK_PREFIX = "<think>"  # pre-fills the assistant turn; the reward reads it as part of the text
KK_SYSTEM_PROMPT = (  # Logic-RL's qwen-instruct prompt, verbatim: "and<answer>" included
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the "
    "mind and then provides the user with the answer. The reasoning process and answer are "
    "enclosed within <think> </think> and<answer> </answer> tags, respectively, i.e., <think> "
    "reasoning process here </think><answer> answer here </answer>.  Now the user asks you to "
    "solve a logical reasoning problem. After thinking, when you finally reach a conclusion, "
    "clearly state the identity of each character within <answer> </answer> tags. i.e., "
    "<answer> (1) Zoey is a knight\n(2) ... </answer>.\n")


def kk_prompt(tokenizer, quiz: str) -> str:  # Logic-RL's, byte for byte
    system = {"role": "system", "content": KK_SYSTEM_PROMPT}
    messages = [system, {"role": "user", "content": quiz + "\n"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + THINK_PREFIX


def kk_parse_solution(solution_text_format: str) -> dict[str, str]:
    """{name: "knight" | "knave"} from "(1) Amelia is a knight\\n(2) ...", by Logic-RL's regex."""
    roles = {}
    for line in solution_text_format.split("\n"):
        match = re.search(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", line, re.IGNORECASE)
        if match:
            roles[match.group(1)] = match.group(2).lower()
    return roles


def kk_reward(completion: str, solution_text_format: str) -> float:
    """Logic-RL's reward of a completion (with THINK_PREFIX), on its text after the first
    "Assistant:". Format: +1 if each tag occurs once and in order, else -1 and -2 for the answer.
    Answer: -2 unless the knight/knave words number the people and each name matches "NAME is a
    knight|knave" (first match); else +2 if all are right, -1.5 if not. Totals: 3 correct, -0.5
    wrong, -1 unreadable, -3 format error."""
    text = completion.split("Assistant:", 1)[-1]
    truth = kk_parse_solution(solution_text_format)
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    positions = [text.find(tag) for tag in tags]
    if any(text.count(tag) != 1 for tag in tags) or positions != sorted(positions):
        return KK_FORMAT_ERROR
    answer = text[positions[2] + len("<answer>"):positions[3]]
    roles_said = answer.lower().count("knight") + answer.lower().count("knave")
    found = {}
    for name in truth:
        pattern = rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b"
        found[name] = re.search(pattern, answer, re.IGNORECASE)
    if roles_said != len(truth) or None in found.values():
        return -1.0
    said = {name: match.group(1).lower() for name, match in found.items()}
    return KK_MAX_REWARD if said == truth else -0.5


def kk_rewards(completions: list[str], solutions: list[str]) -> Tensor:
    """Logic-RL's rewards (B,) of completions as generated after THINK_PREFIX."""
    return torch.tensor([kk_reward(THINK_PREFIX + c, s) for c, s in zip(completions, solutions)])


# --- K&K puzzles: the benchmark's generator and solver, Logic-RL's files

KK_NAMES = tuple((  # the benchmark's 51 names
    "Emma Liam Olivia Noah Ava Ethan Sophia Mason Isabella William Mia James Charlotte Benjamin "
    "Amelia Lucas Harper Henry Evelyn Alexander Abigail Michael Emily Daniel Elizabeth Jacob Sofia "
    "Logan Avery Jackson Ella Sebastian Scarlett Jack Grace Aiden Chloe Owen Victoria Samuel Riley "
    "Matthew Aria Joseph Lily Luke Aurora David Zoey Oliver Penelope"
).split())
_KK_SAYINGS = (  # the benchmark's 18 speech templates
    "{name} said that {content}.", "{name} told you that {content}.",
    '{name} said, "{content}."', '{name} stated, "{content}".',
    'According to {name}, "{content}".', "In {name}'s words: \"{content}\".",
    '{name} remarked, "{content}".', '"{content}," {name} declared.',
    '{name} was heard saying, "{content}".', "{name} expressed that {content}.",
    '"{content}" - {name}.', 'As {name} put it, "{content}".',
    '{name} asserted: "{content}".', '"{content}," {name} mentioned.',
    '{name} commented, "{content}".', 'In a statement by {name}: "{content}".',
    '{name} noted, "{content}".', '"{content}," {name} claimed.',
)
KK_MAX_PEOPLE = 8  # a solver tries all 2^n worlds


def _kk_true(statement: tuple, world: tuple[bool, ...]) -> bool:
    """Truth of e.g. ("and", ("lying", 0), ("telling-truth", 2)) in a world (True = knight)."""
    op, *args = statement
    if op in ("telling-truth", "lying"):
        if not 0 <= args[0] < len(world):
            raise ValueError(f"person {args[0]} is not one of 0..{len(world) - 1}")
        return world[args[0]] == (op == "telling-truth")
    values = [_kk_true(arg, world) for arg in args]
    if op == "and":
        return all(values)  # (the official rows' and/or may have more than two operands)
    if op == "or":
        return any(values)
    if op == "not":
        return not values[0]
    if op == "->":
        return not values[0] or values[1]
    if op == "<=>":
        return values[0] == values[1]
    raise ValueError(f"unknown statement {op!r}")


def kk_solve(statements) -> list[list[bool]]:
    """Every world where person i is a knight (True) iff statement i is true, in the benchmark's
    order. `statements`: the tuple, or its repr (parsed as a literal, never run)."""
    if isinstance(statements, str):
        statements = ast.literal_eval(statements)
    worlds = itertools.product((True, False), repeat=len(statements))
    consistent = [w for w in worlds
                  if all(_kk_true(s, w) == w[i] for i, s in enumerate(statements))]
    return [list(w) for w in consistent]


def _kk_statement(rng: random.Random, n: int, speaker: int) -> tuple:
    """The benchmark's grammar: a leaf, not, and, or, ->, <=> (1/6 each) over distinct leaves;
    never "I am a knave"."""
    def leaf():
        while True:
            candidate = (rng.choice(("telling-truth", "lying")), rng.randrange(n))
            if candidate != ("lying", speaker):
                return candidate

    kind = rng.randrange(6)
    if kind == 0:
        return leaf()
    if kind == 1:
        return ("not", leaf())
    first = leaf()
    second = leaf()
    while second == first:
        second = leaf()
    return (("and", "or", "->", "<=>")[kind - 2], first, second)


def _kk_text(names: list[str], statement: tuple) -> str:  # the benchmark's English
    def leaf(x, negate=False):
        role = "knight" if x[0] == "telling-truth" else "knave"
        return f"{names[x[1]]} is {'not ' if negate else ''}a {role}"

    op = statement[0]
    if op == "not":
        return leaf(statement[1], negate=True)
    if op in ("telling-truth", "lying"):
        return leaf(statement)
    a, b = leaf(statement[1]), leaf(statement[2])
    if op == "->":
        return f"If {a} then {b}"
    if op == "<=>":
        return f"{a} if and only if {b}"
    return f"{a} {op} {b}"


def _kk_solution_texts(names: list[str], solution: list[bool]) -> tuple[str, str]:
    """(solution_text, solution_text_format) as the official rows write them."""
    roles = ["knight" if knight else "knave" for knight in solution]
    parts = [f"{name} is a {role}" for name, role in zip(names, roles)]
    text = ", ".join(parts[:-1]) + ", and " + parts[-1] + "."
    return text, "\n".join(f"({i}) {part}" for i, part in enumerate(parts, 1))


def kk_generate(n: int, num_people: int | tuple[int, int] = (3, 7), seed: int = 0,
                up_to: bool = False, exclude=()):
    """`n` distinct puzzles with one solution each, of num_people (int, or (lo, hi)), in the
    benchmark's schema, none with `exclude`'s statements; `up_to`: fewer where fewer exist."""
    import datasets
    lo, hi = (num_people, num_people) if isinstance(num_people, int) else num_people
    assert 2 <= lo <= hi <= KK_MAX_PEOPLE, f"num_people must lie within 2..8, got {num_people}"
    rng = random.Random(seed)
    seen = set(exclude)
    rows = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        for _try in range(10_000):  # (2-person puzzles run out after 399)
            statements = tuple(_kk_statement(rng, k, i) for i in range(k))
            solutions = [] if repr(statements) in seen else kk_solve(statements)
            if len(solutions) == 1:
                break
        else:
            if up_to:
                break
            raise ValueError(f"only {len(rows)} distinct {k}-person puzzles found: ask for fewer")
        seen.add(repr(statements))
        names = rng.sample(KK_NAMES, k)
        said = " ".join(rng.choice(_KK_SAYINGS).format(name=names[i], content=_kk_text(names, s))
                        for i, s in enumerate(statements))
        people = f"You meet {k} inhabitants: {', '.join(names[:-1])}, and {names[-1]}."
        quiz = ("A very special island is inhabited only by knights and knaves. Knights always "
                f"tell the truth, and knaves always lie. {people} {said} So who is a knight and "
                "who is a knave?")
        text, text_format = _kk_solution_texts(names, solutions[0])
        rows.append({"quiz": quiz, "names": names, "solution": solutions[0], "solution_text": text,
                     "solution_text_format": text_format, "statements": repr(statements),
                     "num_people": k})
    return datasets.Dataset.from_list(rows)


def _first_line(e: Exception) -> str:
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines() or [""]  # (no colour)
    return f"{type(e).__name__}: {lines[0][:200]}"


def _as_tuples(x):
    return tuple(_as_tuples(item) for item in x) if isinstance(x, list) else x


KK_SOLUTION_LINE = re.compile(r"\((\d+)\) ([A-Za-z]+) is a (knight|knave)")  # what the reward reads
KK_MAX_QUIZ = 20_000  # characters; an 8-person quiz has ~1,500


def _kk_row(row) -> dict:
    """A loaded row in kk_generate's schema, checked for what the reward needs to score it; a
    ValueError names the field that is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object with fields, got {type(row).__name__}")
    reward_model = row.get("reward_model") or {}  # (Logic-RL's rows)
    truth = (reward_model.get("ground_truth") or {}) if isinstance(reward_model, dict) else None
    if not isinstance(truth, dict):
        raise ValueError("field 'reward_model' must be an object with a 'ground_truth' object")
    quiz = row.get("quiz")
    text_format = row.get("solution_text_format") or truth.get("solution_text_format")
    statements = row.get("statements") or truth.get("statements")
    for name, value in (("quiz", quiz), ("solution_text_format", text_format),
                        ("statements", statements)):
        if value is None:
            raise ValueError(f"field {name!r} is missing")
    if not isinstance(quiz, str) or not quiz.strip() or len(quiz) > KK_MAX_QUIZ:
        raise ValueError(f"field 'quiz' must be text of 1 to {KK_MAX_QUIZ:,} characters")
    if not isinstance(text_format, str):
        kind = type(text_format).__name__
        raise ValueError(f"field 'solution_text_format' must be text, got {kind}")
    lines = [KK_SOLUTION_LINE.fullmatch(line.strip()) for line in text_format.split("\n")]
    if None in lines or [int(m.group(1)) for m in lines] != list(range(1, len(lines) + 1)):
        raise ValueError("field 'solution_text_format' must be lines '(1) NAME is a knight|knave', "
                         f"NAME in letters A-Z (the reward reads no other), got {text_format!r}")
    names = [m.group(2) for m in lines]
    solution = [m.group(3) == "knight" for m in lines]
    unnamed = [name for name in names if not re.search(rf"\b{name}\b", quiz)]
    distinct = {name.lower() for name in names}  # as the reward matches them
    if not 2 <= len(distinct) == len(names) <= KK_MAX_PEOPLE or unnamed:
        raise ValueError(f"field 'solution_text_format' must name 2 to {KK_MAX_PEOPLE} people of "
                         f"the quiz, distinct ignoring case, got {names}")
    if not isinstance(statements, str):  # JSON has lists; the official form is the tuple's repr
        statements = repr(_as_tuples(statements))
    try:
        parsed = _as_tuples(ast.literal_eval(statements))
        if len(parsed) != len(names):
            raise ValueError(f"{len(parsed)} statements for {len(names)} people")
        if kk_solve(parsed) != [solution]:
            raise ValueError("solution_text_format is not their unique solution")
    except Exception as e:
        raise ValueError(f"field 'statements': {str(e) or type(e).__name__}") from None
    solution_text = row.get("solution_text")
    if not isinstance(solution_text, str) or not solution_text:
        solution_text = _kk_solution_texts(names, solution)[0]
    return {"quiz": quiz, "names": names, "solution": solution, "statements": repr(parsed),
            "solution_text": solution_text, "solution_text_format": text_format,
            "num_people": len(names)}


def _read_rows(path: Path) -> list:
    """The rows of a .jsonl, .json (a list, or JSON lines) or .parquet file."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet
        return pyarrow.parquet.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark read too)
    if not text.strip():
        raise ValueError("the file is empty")
    if path.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
            return rows if isinstance(rows, list) else [rows]
        except json.JSONDecodeError:
            pass  # JSON lines
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number} is not JSON ({e.msg})") from None
    return rows


def kk_load(source: str) -> datasets.Dataset:
    """Checked K&K rows from a .parquet/.jsonl/.json file (the benchmark's or Logic-RL's format) or
    a hub dataset "OWNER/NAME[:[CONFIG/]SPLIT]" ("K-and-K/knights-and-knaves:test/3ppl"); else one
    ValueError naming the file, the row (from 1) or line, and the field."""
    import datasets
    path = Path(source).expanduser()
    has_file_suffix = path.suffix.lower() in (".parquet", ".jsonl", ".json")
    if path.exists() and not has_file_suffix:
        raise ValueError(f"{source!r} is not a .parquet, .jsonl or .json file")
    try:
        if has_file_suffix:
            rows = _read_rows(path)
        else:  # a hub dataset, cached by datasets (~/.cache/huggingface/datasets)
            name, _, selection = source.partition(":")
            config, _, split = selection.rpartition("/")
            rows = list(datasets.load_dataset(name, config or None, split=split or "train"))
    except Exception as e:  # no file, bad JSON or parquet, no network: datasets' errors name little
        message = str(e) if isinstance(e, ValueError) and has_file_suffix else _first_line(e)
        raise ValueError(f"cannot read K&K puzzles from {source!r} ({message})") from e
    checked = []
    for i, row in enumerate(rows, 1):
        try:
            checked.append(_kk_row(row))
        except ValueError as e:
            raise ValueError(f"{source!r} row {i} is not a K&K puzzle: {e}") from None
    if not checked:
        raise ValueError(f"{source!r} has no rows")
    return datasets.Dataset.from_list(checked)


def kk_case_analysis(row: dict) -> str:
    """The warm-up's target after THINK_PREFIX: per world, each statement's truth, if it fits, e.g.
    " Emma knight, Liam knight: Emma says false, Liam says true: no. ... </think><answer> ..."."""
    statements = ast.literal_eval(row["statements"])
    names = row["names"]
    cases = []
    for world in itertools.product((True, False), repeat=len(names)):
        kinds = ["knight" if knight else "knave" for knight in world]
        roles = ", ".join(f"{name} {kind}" for name, kind in zip(names, kinds))
        truths = [_kk_true(statement, world) for statement in statements]
        says = ["true" if true else "false" for true in truths]
        said = ", ".join(f"{name} says {say}" for name, say in zip(names, says))
        fits = truths == list(world)  # knights say true, knaves say false
        cases.append(f"{roles}: {said}: {'yes' if fits else 'no'}.")
    return f" {' '.join(cases)} </think><answer> {row['solution_text_format']} </answer>"


def constant_accuracy(rows) -> float:
    """The best constant answer's accuracy (per size, the most common solution, e.g. "(1) knave
    (2) knave"): the floor that a model's accuracy must beat."""
    best: dict[int, int] = {}
    for solution, count in collections.Counter(tuple(s) for s in rows["solution"]).items():
        best[len(solution)] = max(best.get(len(solution), 0), count)
    return sum(best.values()) / max(len(rows), 1)


# --- The run's puzzles: training and the warm-up skip the evaluation's statements (2-person
# puzzles fall in 95 logical classes, so an evaluation shares classes with training)


def evaluation_rows(cfg: Config, train_rows=None) -> datasets.Dataset:
    """cfg.eval_size generated puzzles per size, from a seed of their own, or --eval_data's rows:
    none with a statement of a --train_data file (read unless given); dropped rows are said."""
    import datasets
    if train_rows is None and cfg.train_data != "generate":
        train_rows = kk_load(cfg.train_data)
    training = set(train_rows["statements"]) if train_rows is not None else ()
    if cfg.eval_data != "generate":
        evals = kk_load(cfg.eval_data)
        kept = [i for i, s in enumerate(evals["statements"]) if s not in training]
        if not kept:
            raise ValueError("every --eval_data puzzle is also in --train_data")
        if len(kept) < len(evals):
            print(f"note: {len(evals) - len(kept)} of {len(evals)} --eval_data puzzles are also in "
                  "--train_data: not evaluated")
        return evals.select(kept)
    lo, hi = people_range(cfg.num_people)
    sizes = []
    for people in range(lo, hi + 1):
        try:
            sizes.append(kk_generate(cfg.eval_size, people, seed=cfg.seed + 1_000_003 + people,
                                     exclude=training))
        except ValueError as e:
            raise ValueError(f"--eval_size {cfg.eval_size}, {people} people: {e}") from None
    return datasets.concatenate_datasets(sizes)


def load_task_data(cfg: Config):
    """Training and evaluation rows; generated training skips the evaluation's puzzles."""
    if cfg.train_data != "generate":
        train_rows = kk_load(cfg.train_data)
        return train_rows, evaluation_rows(cfg, train_rows)
    evals = evaluation_rows(cfg)
    up_to = cfg.num_train == Config.num_train  # the default: all there are, where fewer exist
    try:
        train_rows = kk_generate(cfg.num_train, people_range(cfg.num_people), cfg.seed,
                                 up_to=up_to, exclude=evals["statements"])
    except ValueError as e:
        raise ValueError(f"--num_train {cfg.num_train}, --num_people {cfg.num_people}: {e}")
    if not len(train_rows):
        raise ValueError(f"--eval_size {cfg.eval_size} takes every {cfg.num_people}-person puzzle")
    return train_rows, evals


def warmup_puzzles(cfg: Config, eval_rows) -> datasets.Dataset:
    """The warm-up's puzzles: up to warmup_steps * prompts_per_step (warm_up cycles them)."""
    return kk_generate(cfg.warmup_steps * cfg.prompts_per_step, people_range(cfg.num_people),
                       seed=cfg.seed + 2_000_003, up_to=True, exclude=eval_rows["statements"])


def step_rows(num_rows: int, cfg: Config, step: int) -> list[int]:
    """Step `step`'s rows (0-based), of per-epoch shuffles seeded by (seed, epoch): replayable."""
    rows = []
    for i in range(step * cfg.prompts_per_step, (step + 1) * cfg.prompts_per_step):
        shuffle = torch.Generator().manual_seed(cfg.seed * 100_003 + i // num_rows)  # the epoch's
        rows.append(int(torch.randperm(num_rows, generator=shuffle)[i % num_rows]))
    return rows


# --- Rewards: Logic-RL's, or --reward's, checked where they enter


def reward_function(spec) -> Callable:
    """cfg.reward's function: 'kk' (kk_rewards), a function, FILE.py:FUNCTION, MODULE:FUNCTION."""
    if callable(spec):
        return spec
    return kk_rewards if spec == "kk" else load_function(spec)


@functools.cache  # (a file runs once)
def load_function(spec: str) -> Callable:
    import importlib.util
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(Path(where).stem,
                                                                 Path(where).expanduser())
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return functools.reduce(getattr, name.split("."), module)
    except Exception as e:
        raise ValueError(f"--reward {spec}: cannot load it ({_first_line(e)})") from None


def score(cfg: Config, completions: list[str], solutions: list[str]) -> Tensor:
    """cfg.reward's rewards (B,) of completions (after THINK_PREFIX) for their solution_text_format,
    checked: one finite number per completion, else one line."""
    function = reward_function(cfg.reward)
    name = getattr(function, "__name__", cfg.reward)
    rewards = function(completions, solutions)
    try:
        values = torch.as_tensor(rewards, dtype=torch.float32).cpu()
        ok = values.shape == (len(completions),) and bool(values.isfinite().all())
    except (TypeError, ValueError, RuntimeError):
        ok = False
    if not ok:
        raise ValueError(f"reward {name} must return {len(completions)} finite numbers, got "
                         f"{rewards!r:.100}")
    return values
# --- Devices, models and the warm-up


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
    params = model.parameters()
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                             fused=True)


def eos_token_ids(model, tokenizer) -> list[int]:  # (Qwen has two)
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted(set(ids + [tokenizer.eos_token_id]) - {None})


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("mps" if torch.backends.mps.is_available() else "cpu")


def wait_for_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def has_bf16(device: torch.device) -> bool:
    """A GPU with native bf16 (not a T4)."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def autocast(device: torch.device, enabled: bool = True):
    """bf16 where the GPU has it; weights and AdamW's state stay fp32 (bf16 rounds away lr 1e-6)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and has_bf16(device))


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def load_model(name: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A causal LM with SDPA attention and dropout off (it would make the first ratio != 1); else
    one ValueError."""
    from transformers import AutoModelForCausalLM
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ValueError(f"--model {name}: no such folder")
    try:
        source = str(path) if path.exists() else name
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype,
                                                     attn_implementation="sdpa")
    except Exception as e:  # no such model, a torn or mismatched checkpoint
        if is_out_of_memory(e):
            raise
        raise ValueError(f"cannot load the model {name} ({_first_line(e)})") from None
    text_config = model.config.get_text_config()
    # Gemma 2, Cohere and Granite rescale their logits after the output layer
    scaling = ("final_logit_softcapping", "logit_scale", "logits_scaling")
    scaled = {k: getattr(text_config, k) for k in scaling
              if getattr(text_config, k, None) not in (None, 1)}
    if scaled:  # sequence_logprobs applies the output layer alone
        raise ValueError(f"{name} rescales its logits after the output layer ({scaled}): not "
                         "supported")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model.to(device)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(Path(name).expanduser()))
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # masks come from positions
    return tokenizer


def load_policy(cfg: Config, device: torch.device, start: Path | None = None):
    """Policy (checkpoint `start`, or cfg.model), tokenizer, frozen reference (None at beta 0)."""
    source = str(start or cfg.model)
    model = load_model(source, device)
    tokenizer = load_tokenizer(source)
    ref_model = None
    if cfg.beta > 0:
        ref_dtype = torch.bfloat16 if has_bf16(device) else torch.float32
        ref_model = load_model(cfg.model, device, ref_dtype).eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model, tokenizer, ref_model


def needs_warm_up(cfg: Config, source: str) -> bool:  # (a run's checkpoint is warmed up)
    return cfg.warmup_steps > 0 and not (Path(source).expanduser() / "trainer_state.pt").exists()


def warm_up(cfg: Config, model, tokenizer, device: torch.device, rows,
            stop: StopOnSignal | None = None) -> None:
    """A supervised warm-up, ours (the paper's 3B needs none; pure RL on K&K stalls below ~1.5B):
    cfg.warmup_steps steps of cross-entropy on kk_case_analysis + EOS of `rows`, prompts_per_step
    puzzles each (cycling); AdamW, as SGD would warm nothing at this rate. A signal (`stop`) ends it
    unsaved: it is deterministic, and --resume redoes it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_learning_rate,
                                  weight_decay=cfg.weight_decay)
    model.train()
    for step in tqdm(range(cfg.warmup_steps), desc="warm-up"):
        if stop and stop.signum:
            print(f"lopti.py: stopped in warm-up step {step + 1}, unsaved; --resume redoes the "
                  "warm-up", file=sys.stderr)
            raise SystemExit(128 + stop.signum)
        pairs = []  # (prompt, target) token ids
        first = step * cfg.prompts_per_step
        for i in range(first, first + cfg.prompts_per_step):
            row = rows[i % len(rows)]
            texts = (kk_prompt(tokenizer, row["quiz"]), kk_case_analysis(row) + tokenizer.eos_token)
            pairs.append([tokenizer(text, add_special_tokens=False).input_ids for text in texts])
        L = max(len(p + t) for p, t in pairs)
        C = max(len(t) for _, t in pairs)
        pad = tokenizer.pad_token_id  # left-padded, as generate() pads
        ids = [[pad] * (L - len(p + t)) + p + t for p, t in pairs]
        attention = [[0] * (L - len(p + t)) + [1] * len(p + t) for p, t in pairs]
        mask = [[0] * (C - len(t)) + [1] * len(t) for _, t in pairs]
        ids = torch.tensor(ids, device=device)  # (B, L)
        attention = torch.tensor(attention, device=device)  # (B, L)
        mask = torch.tensor(mask, device=device)  # (B, C)
        with autocast(device):
            logprobs = sequence_logprobs(model, ids, attention, C, 1.0)  # (B, C)
        loss = -(logprobs * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# --- Run files: config.json, logs, checkpoints, resume, signals

# What --resume may change. Memory settings keep the steps (up to rounding); the learning rate may
# fall after a divergence. Not the evaluation's puzzles: the gain is paired.
RESUME_MAY_CHANGE = ("steps", "eval_every", "save_every", "eval_batch_size", "micro_batch_size",
                     "generation_batch_size", "gradient_checkpointing", "measure_update",
                     "learning_rate", "output_dir", "report_to", "reward")
STALLED_STEPS = 3  # steps in a row in which no group has spread: train says so


@functools.cache  # (once a process)
def lopti_version() -> str:
    """git's commit ("changed": this file differs), where there is one; this file's sha256."""
    import subprocess
    here = Path(__file__).resolve()
    digest = hashlib.sha256(here.read_bytes()).hexdigest()[:12]
    git = functools.partial(subprocess.run, cwd=here.parent, capture_output=True, text=True)
    try:
        commit = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        changed = git(["git", "status", "--porcelain", "--", here.name]).stdout.strip()
    except OSError:  # no git
        commit = changed = ""
    return f"{commit or 'no git'}{' changed' if changed else ''}, lopti.py sha256 {digest}"


def config_record(cfg: Config) -> dict:  # config.json's: settings, method, version
    settings = asdict(cfg)
    if callable(cfg.reward):
        name = getattr(cfg.reward, "__qualname__", type(cfg.reward).__name__)
        settings["reward"] = f"{cfg.reward.__module__}:{name}"
    return {**settings, "method": method_name(settings), "version": lopti_version()}


def read_config(path: Path) -> dict:
    """A run's config.json, its Config fields (older runs': defaults), else one ValueError."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({_first_line(e)})") from None
    if not isinstance(saved, dict) or "lopti" not in saved:
        raise ValueError(f"{path} holds no settings of a lopti.py run")
    return {f.name: saved.get(f.name, f.default) for f in fields(Config)}


def write_json(path: Path, value) -> None:  # written beside, renamed: never half a file
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:  # (a line torn by a crash is skipped)
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class MetricsLog:
    """metrics.jsonl; --report_to tensorboard: numbers as scalars (a bin's as KEY/0..3), texts as
    text, a resumed run's redone steps replacing the first."""

    def __init__(self, out: Path, cfg: Config, first_step: int = 0):
        self.path = out / "metrics.jsonl"
        self.writer = None
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=first_step + 1)
            self.writer.add_text("config", json.dumps(config_record(cfg), indent=2))

    def write(self, record: dict) -> None:
        append_jsonl(self.path, record)
        if self.writer is None:
            return
        for key, value in record.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=record["step"])
            values = value if isinstance(value, list) else [value]
            for i, number in enumerate(values):
                if key != "step" and type(number) in (int, float):  # (no None, bool, text)
                    tag = f"{key}/{i}" if isinstance(value, list) else key
                    self.writer.add_scalar(tag, number, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def not_started(out: Path) -> bool:
    """Only config.json and empty logs (a run stopped in its warm-up): a new run or --resume may
    start it again, with any settings."""
    names = {p.name for p in out.iterdir()}
    logs = read_jsonl(out / "metrics.jsonl") + read_jsonl(out / "samples.jsonl")
    allowed = {"config.json", "metrics.jsonl", "samples.jsonl"}
    return "config.json" in names and names <= allowed and not logs


def check_output_dir(cfg: Config, resume: bool) -> Path:
    """Before anything is written: a new run needs a new or empty folder, --resume a run whose
    config.json differs only in RESUME_MAY_CHANGE."""
    out = Path(cfg.output_dir).expanduser()
    if not out.is_dir() or not any(out.iterdir()) or not_started(out):
        return out
    if not resume:
        raise ValueError(f"--output_dir {out} is not empty: --resume continues a run there; else "
                         "choose a new folder")
    saved, now = read_config(out / "config.json"), config_record(cfg)
    changed = [f"{k} {v!r} -> {now[k]!r}" for k, v in saved.items()
               if k not in RESUME_MAY_CHANGE and v != now[k]]
    if changed:
        raise ValueError(f"--resume may not change {', '.join(changed)}: start a new --output_dir")
    return out


def start_run_files(out: Path, cfg: Config, start: int) -> None:
    """config.json; the logs cut back to step `start` (later steps are redone, logged once)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "samples.jsonl"):
        kept = [r for r in read_jsonl(out / name) if r["step"] <= start]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in kept))
    write_json(out / "config.json", config_record(cfg))


def checkpoints(out: Path) -> list[Path]:  # complete ones, oldest first
    complete = [p for p in out.glob("checkpoint-*") if p.name[11:].isdigit()]
    return sorted(complete, key=lambda p: int(p.name[11:]))


def save_checkpoint(out: Path, model, tokenizer, optimizer, step: int) -> Path:
    """out/checkpoint-STEP/ (--model loads it; + trainer_state.pt), written as .tmp, renamed."""
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
             "cuda_rng": cuda_rng}
    torch.save(state, tmp / "trainer_state.pt")
    tmp.rename(final)
    for old in checkpoints(out)[:-1]:
        shutil.rmtree(old)
    return final


def load_trainer_state(ckpt: Path | None) -> dict:
    """`ckpt`'s step, optimiser, RNG states ({"step": 0} if None); torn or unsafe: a ValueError."""
    if ckpt is None:
        return {"step": 0}
    try:
        return torch.load(ckpt / "trainer_state.pt", weights_only=True)
    except Exception as e:
        if is_out_of_memory(e):
            raise
        raise ValueError(f"{ckpt}/trainer_state.pt cannot be loaded ({_first_line(e)})") from None


def restore_trainer_state(state: dict, optimizer, cfg: Config) -> None:
    if "optimizer" not in state:
        return
    optimizer.load_state_dict(state["optimizer"])
    for group in optimizer.param_groups:  # --resume may lower it
        group["lr"] = cfg.learning_rate
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def due(every: int, step: int, cfg: Config) -> bool:
    """Every `every` steps (save_every, eval_every), and the last."""
    return step == cfg.steps or bool(every and step % every == 0)


def check_finite(model, step: int) -> None:
    if not all(p.isfinite().all() for p in model.parameters()):
        raise ValueError(f"step {step} diverged (non-finite weights), unsaved: lower "
                         "--learning_rate (train: --resume from the last checkpoint)")


class StopOnSignal:
    """A first Ctrl-C or SIGTERM sets `signum`; a second raises KeyboardInterrupt."""

    def __enter__(self):
        self.signum = 0
        signals = (signal.SIGINT, signal.SIGTERM)
        self.previous = {s: signal.signal(s, self.on_signal) for s in signals}
        return self

    def on_signal(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt(signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step (again: abort)", flush=True)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Run:
    """train's plumbing, in a run's order: __init__ loads data and model, then writes the run's
    files, warms up; evaluate_if_due; end_step (logs, checkpoint, evaluation); exit_if_stopped."""

    def __init__(self, cfg: Config, resume: bool, stop: StopOnSignal):
        self.cfg, self.stop = cfg, stop
        self.out = out = check_output_dir(cfg, resume)
        self.device = pick_device()
        torch.manual_seed(cfg.seed)
        self.train_rows, self.eval_rows = load_task_data(cfg)  # a bad data file fails here
        reward_function(cfg.reward)  # and a bad --reward
        latest = checkpoints(out)[-1] if resume and checkpoints(out) else None
        state = load_trainer_state(latest)
        self.start = state["step"]
        self.model, self.tokenizer, self.ref_model = load_policy(cfg, self.device, latest)
        self.optimizer = make_optimizer(self.model, cfg)
        restore_trainer_state(state, self.optimizer, cfg)
        logged = evaluations_by_step(read_jsonl(out / "metrics.jsonl"))
        self.evaluations = {s: r for s, r in logged.items() if s <= self.start}  # (later: redone)
        puzzles = puzzles_hash(self.eval_rows)
        if self.evaluations.get(0, {}).get("eval/puzzles", puzzles) != puzzles:
            raise ValueError("--resume: the evaluation's puzzles are not those step 0 scored: was "
                             "--eval_data changed?")
        if stop.signum:
            raise SystemExit(128 + stop.signum)  # nothing written yet
        start_run_files(out, cfg, self.start)  # config.json first: --resume continues from here
        if latest is None and needs_warm_up(cfg, cfg.model):
            warm_up(cfg, self.model, self.tokenizer, self.device,
                    rows=warmup_puzzles(cfg, self.eval_rows), stop=stop)
            self.save(0)  # the warm-up is kept: checkpoint-0
        self.log = MetricsLog(out, cfg, first_step=self.start)
        self.stalled = 0
        self.progress = tqdm(initial=self.start, total=cfg.steps, desc="train")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.progress.close()
        self.log.close()

    def evaluate_if_due(self, step: int) -> None:
        """The evaluation at `step` (unless logged), with RL's gain; then exit after a signal."""
        due_now = step == 0 or due(self.cfg.eval_every, step, self.cfg)
        if due_now and step not in self.evaluations and not self.stop.signum:
            record = evaluate(self.model, self.tokenizer, self.eval_rows, cfg=self.cfg,
                              device=self.device)
            step_0 = self.evaluations.get(0, {})
            if step > 0 and step_0.get("eval/puzzles") == record["eval/puzzles"]:
                record.update(paired_gain(step_0["eval/correct"], record["eval/correct"]))
            self.evaluations[step] = {"step": step, **record}
            self.log.write(self.evaluations[step])
        self.exit_if_stopped(step)

    def end_step(self, step: int, rows, metrics: dict) -> None:
        check_finite(self.model, step)
        samples = {"step": step, "quiz": rows["quiz"][0], "samples": metrics.pop("samples")}
        append_jsonl(self.out / "samples.jsonl", samples)
        self.log.write({"step": step, "learning_rate": self.cfg.learning_rate, **metrics})
        self.stalled = self.stalled + 1 if metrics["zero_std_groups"] == 1 else 0
        if self.stalled == STALLED_STEPS:
            print(f"\nnote: steps {step - STALLED_STEPS + 1}-{step}: in every group all samples "
                  "scored alike (no advantage): the run has stopped learning (README: "
                  "Troubleshooting)", file=sys.stderr)
        if due(self.cfg.save_every, step, self.cfg) or self.stop.signum:
            self.save(step)
        self.progress.update()
        self.evaluate_if_due(step)

    def save(self, step: int) -> None:
        save_checkpoint(self.out, self.model, self.tokenizer, optimizer=self.optimizer, step=step)

    def exit_if_stopped(self, step: int) -> None:
        if not self.stop.signum:
            return
        if not (self.out / f"checkpoint-{step}").exists():  # (a signal during an evaluation)
            self.save(step)
        print(f"lopti.py train: stopped after step {step}, saved; continue with --resume",
              file=sys.stderr)
        raise SystemExit(128 + self.stop.signum)


# --- Evaluation, and RL's gain over step 0


def puzzles_hash(rows) -> str:
    return hashlib.sha256("\n".join(rows["quiz"]).encode()).hexdigest()[:12]


def evaluate(model, tokenizer, rows, cfg: Config, device: torch.device) -> dict:
    """Greedy accuracy (reward 3), per size too with the mean reward, constant_accuracy, each
    puzzle's outcome (eval/correct: "0110..."), the puzzles' hash (eval/puzzles)."""
    rewards, sizes = [], []
    for i in range(0, len(rows), cfg.eval_batch_size):
        chunk = rows[i:i + cfg.eval_batch_size]
        prompts = [kk_prompt(tokenizer, quiz) for quiz in chunk["quiz"]]
        texts = rollout(model, tokenizer, prompts, cfg, device, greedy=True)["texts"]
        rewards += score(cfg, texts, chunk["solution_text_format"]).tolist()
        sizes += chunk["num_people"]
    correct = [reward == KK_MAX_REWARD for reward in rewards]
    out = {"eval/accuracy": sum(correct) / len(correct),
           "eval/constant_accuracy": constant_accuracy(rows),
           "eval/correct": "".join("1" if c else "0" for c in correct),
           "eval/puzzles": puzzles_hash(rows)}
    for n in sorted(set(sizes)):
        of_size = [reward for reward, size in zip(rewards, sizes) if size == n]
        out[f"eval/accuracy_{n}ppl"] = of_size.count(KK_MAX_REWARD) / len(of_size)
        out[f"eval/reward_{n}ppl"] = sum(of_size) / len(of_size)
    return out


def sign_test_p(gained: int, lost: int) -> float:
    """McNemar's exact two-sided p over the puzzles whose outcome changed, each change a fair coin:
    9 gained, 1 lost -> 2 * 11 / 2**10 = 0.021."""
    changed = gained + lost
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed
    return min(1.0, 2 * tail)


def paired_gain(before: str, after: str) -> dict:
    """From two evaluations' eval/correct: the accuracy change, puzzles gained, lost, and p."""
    assert len(before) == len(after), "two evaluations of the same puzzles"
    gained = sum(b == "0" and a == "1" for b, a in zip(before, after))
    lost = sum(b == "1" and a == "0" for b, a in zip(before, after))
    return {"eval/gain": (gained - lost) / len(before), "eval/gained": gained, "eval/lost": lost,
            "eval/gain_p": sign_test_p(gained, lost)}


def eval_main(cfg: Config) -> dict:
    device = pick_device()
    eval_rows = evaluation_rows(cfg)
    reward_function(cfg.reward)  # (before the model loads)
    model = load_model(cfg.model, device)
    tokenizer = load_tokenizer(cfg.model)
    return evaluate(model, tokenizer, eval_rows, cfg, device)


# --- diagnose: Figure 1, Figure 3 paired


def diagnose(cfg: Config, steps: int, out: Path) -> dict:
    """Figure 1 (measure_bins) on the first batch; with `steps`, Figure 3 paired along a trajectory
    of cfg's method: train_step's probe tries every other method from the same weights
    (paired_counts). `out` is rewritten after every step; cfg.model is only read."""
    cfg = dataclasses.replace(cfg, measure_update=True)
    own = method_name(asdict(cfg))
    if own not in METHODS or cfg.num_iterations != 1:
        raise ValueError(f"diagnose's trajectory is one of {', '.join(METHODS)} at one epoch")
    device = pick_device()
    torch.manual_seed(cfg.seed)
    train_rows, eval_rows = load_task_data(cfg)
    reward_function(cfg.reward)
    model, tokenizer, ref_model = load_policy(cfg, device)
    if needs_warm_up(cfg, cfg.model):
        warm_up(cfg, model, tokenizer, device, rows=warmup_puzzles(cfg, eval_rows))
    optimizer = make_optimizer(model, cfg)
    result = {"settings": config_record(cfg), "bins": BIN_NAMES}
    units = []

    def figure1(batch: dict) -> None:  # in fp32 (no autocast), as its gradients sum in fp64
        if "figure1" not in result:
            logprob_fn = functools.partial(completion_logprobs, model, temperature=cfg.temperature)
            result["figure1"] = measure_bins(cfg.micro_batch_size, model.train(), logprob_fn, batch)

    def probe(batch: dict, measure: UpdateMeasure, logprob_fn: Callable) -> dict:
        figure1(batch)
        others = [m for m in METHODS if m != own]
        units.append(paired_counts(cfg, model, optimizer, logprob_fn, batch, measure.logprobs,
                                   measure.before, others))
        return {}

    for step in range(max(steps, 1)):
        t0 = time.perf_counter()
        rows = train_rows[step_rows(len(train_rows), cfg, step)]
        if not steps:
            batch, metrics = rollout_and_score(cfg, model, ref_model, tokenizer, rows, device)
            figure1(batch)
        else:
            metrics = train_step(cfg, model, ref_model, tokenizer, optimizer, rows, device,
                                 probe=probe)
            check_finite(model, step + 1)
            units[-1][own] = {k: v for k, v in metrics.items() if k.startswith("update/")}
            result["figure3_paired"] = figure3_paired(units)
        print(f"step {step + 1}: reward {metrics['reward']:.2f}, {time.perf_counter() - t0:.0f} s",
              flush=True)
        write_json(out, result)
    for method, counts in result.get("figure3_paired", {}).get("methods", {}).items():
        shares = figure3_shares({f"update/{k}": v for k, v in counts.items()})
        print(f"{method}: rose {fmt_list(shares['rose'])}, ties {fmt_list(shares['ties'])}")
    return result


def figure3_paired(units: list[dict]) -> dict:
    """paired_deltas of diagnose's steps vs GRPO, two-epoch GRPO and Lopti; the counts summed."""
    pooled = {m: pool_counts([u[m] for u in units]) for m in METHODS}
    return {"steps": len(units), "delta_vs_grpo": paired_deltas(units),
            "delta_vs_grpo_2_epochs": paired_deltas(units, "grpo_2_epochs"),
            "delta_vs_lopti": paired_deltas(units, "lopti"), "per_step": units,
            "methods": {m: {k.removeprefix("update/"): v for k, v in c.items()}
                        for m, c in pooled.items()}}


# --- Reading runs: compare, plot


def read_run(run: Path) -> tuple[dict, list[dict]]:  # config.json, metrics.jsonl
    if not (run / "config.json").is_file() or not (run / "metrics.jsonl").is_file():
        raise ValueError(f"{run} is not a folder written by lopti.py train (no config.json and "
                         "metrics.jsonl)")
    return read_config(run / "config.json"), read_jsonl(run / "metrics.jsonl")


def evaluations_by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "eval/correct" in r}


def compare_runs(run_a: Path, run_b: Path) -> dict:
    """Two runs' accuracies at the last step both evaluated on the same puzzles (eval/puzzles), and
    B's paired gain over A with McNemar's exact p."""
    (cfg_a, records_a), (cfg_b, records_b) = read_run(run_a), read_run(run_b)
    evals_a, evals_b = evaluations_by_step(records_a), evaluations_by_step(records_b)
    common = sorted(set(evals_a) & set(evals_b))
    if not common:
        raise ValueError(f"{run_a} and {run_b} have no evaluated step in common")
    step = common[-1]
    a, b = evals_a[step], evals_b[step]
    if a.get("eval/puzzles") is None or a.get("eval/puzzles") != b.get("eval/puzzles"):
        raise ValueError(f"{run_a} and {run_b} evaluated different puzzles at step {step} "
                         "(eval/puzzles): not comparable")
    if step != max(evals_a) or step != max(evals_b):
        print(f"note: step {step} is the last step both evaluated, not the last of each "
              f"({max(evals_a)}, {max(evals_b)})")
    out = {"step": step, "puzzles": len(a["eval/correct"]), "runs": []}
    for run, cfg, record in ((run_a, cfg_a, a), (run_b, cfg_b, b)):
        out["runs"].append({"run": str(run), "method": method_name(cfg), "seed": cfg["seed"],
                            "accuracy": record["eval/accuracy"]})
    gain = paired_gain(a["eval/correct"], b["eval/correct"])
    out["b_minus_a"] = {k.removeprefix("eval/"): v for k, v in gain.items()}
    for r in out["runs"]:
        print(f"{r['run']}: {r['method']}, seed {r['seed']}: accuracy {r['accuracy']:.3f} at step "
              f"{out['step']} on {out['puzzles']} puzzles")
    d = out["b_minus_a"]
    print(f"second minus first: {d['gain']:+.3f} ({d['gained']} gained, {d['lost']} lost), "
          f"McNemar's exact p {d['gain_p']:.3f}")
    return out


def plot_runs(runs: list[Path], out: Path) -> None:
    loaded = [read_run(run) for run in runs]  # (a folder that is not a run: said first)
    plt = pyplot()
    puzzles = {r.get("eval/puzzles") for _, records in loaded for r in records
               if "eval/correct" in r}
    if len(puzzles) > 1:
        print(f"note: these runs evaluated {len(puzzles)} different sets of puzzles "
              "(eval/puzzles): their accuracies are not paired")
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for i, (run, (cfg, records)) in enumerate(zip(runs, loaded)):
        label = f"{run.name} ({method_name(cfg)}, seed {cfg['seed']})"
        for ax, key in zip(axes, ("reward", "format_error", "zero_std_groups", "eval/accuracy")):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), c=f"C{i}", label=label)
            ax.set(title=key, xlabel="RL step")
        constant = [(r["step"], r["eval/constant_accuracy"]) for r in records
                    if "eval/constant_accuracy" in r]
        if constant:
            axes[3].plot(*zip(*constant), c=f"C{i}", ls="--")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


# --- TRL: AR and Lopti inside trl.GRPOTrainer (tested with trl 1.16.0). It overrides only what
# TRL cannot do: pi_old, AR, Lopti's stages, the loss.


@functools.cache
def _lopti_grpo_trainer_class():
    from trl import GRPOTrainer

    class LoptiGRPOTrainer(GRPOTrainer):
        """trl.GRPOTrainer with AR (Eq. 4) and Lopti (Algorithm 1), its stages as TRL's iterations,
        doubled on a copy of `args` (max_steps counts both). Unlike update_policy, TRL steps on a
        zero gradient and divides A by std + 1e-4."""

        def __init__(self, model, reward_funcs, args, *, alpha=Config.alpha, lopti=Config.lopti,
                     eta=Config.eta, lopti_order=Config.lopti_order, dual_clip=Config.dual_clip,
                     **kwargs):
            Config(alpha=alpha, lopti=lopti, eta=eta, lopti_order=lopti_order,
                   dual_clip=dual_clip)  # checks the values
            assert args.loss_type == "dapo", \
                "LoptiGRPOTrainer's loss is the token-mean: loss_type='dapo'"
            # TRL's compute_loss must reach _compute_loss: the liger kernel's loss goes around it
            assert "self._compute_loss(" in inspect.getsource(GRPOTrainer.compute_loss), \
                "LoptiGRPOTrainer needs a trl whose compute_loss calls _compute_loss (1.16.0 does)"
            unapplied = {"importance_sampling_level": "token", "delta": None,
                         "top_entropy_quantile": 1.0, "off_policy_mask_threshold": None,
                         "use_liger_kernel": False}
            if args.use_vllm:
                unapplied["vllm_importance_sampling_correction"] = False
            ignored = {k: getattr(args, k, v) for k, v in unapplied.items()
                       if getattr(args, k, v) != v}
            assert not ignored, f"LoptiGRPOTrainer's loss does not apply {ignored}"
            assert not lopti or args.steps_per_generation % args.gradient_accumulation_steps == 0, \
                "with Lopti, steps_per_generation must be a multiple of gradient_accumulation_steps"
            if lopti:
                args = copy.copy(args)
                args.num_iterations *= 2
            self.alpha, self.lopti, self.eta = alpha, lopti, eta
            self.lopti_order, self.dual_clip = lopti_order, dual_clip
            super().__init__(model, reward_funcs, args=args, **kwargs)

        def _logps(self, model, batch: dict, **kwargs) -> Tensor:  # (B, T); TRL's head divides by T
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            C = batch["completion_ids"].shape[1]
            return self._get_per_token_logps_and_entropies(model, ids, mask, C, **kwargs)[0]

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)  # TRL: no pi_old for 1 pass
            mask = out["completion_mask"].bool()  # (B, T)
            if "old_per_token_logps" not in out and (self.alpha > 0 or self.lopti):
                with torch.no_grad():
                    batch_size = self.args.per_device_train_batch_size
                    out["old_per_token_logps"] = self._logps(self.model, out, batch_size=batch_size)
            old = out.get("old_per_token_logps", torch.zeros(mask.shape, device=mask.device))
            out["advantages"] = reweight_advantages(out["advantages"], old, self.alpha)  # (B, T)
            out["lopti_low"] = lopti_masks(old, mask, self.eta)[0] if self.lopti else mask
            return out

        def _compute_loss(self, model, inputs):
            mask = inputs["completion_mask"].bool()  # (b, T)
            low = inputs["lopti_low"]  # (b, T)
            stage = mask
            if self.lopti and self.model.training:
                # this micro-step's pass over the generation batch: the first half is stage 1
                replay = self._step // self.args.steps_per_generation % self.num_iterations
                first_half = replay < self.num_iterations // 2
                low_stage = first_half if self.lopti_order == "low_first" else not first_half
                stage = low if low_stage else mask & ~low
            # TRL's "dapo" denominator per process (DDP averages) and optimiser step: the generation
            # batch's tokens over its optimiser steps, both stages (update_policy's, on average)
            denom = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if self.model.training:
                steps = self.current_gradient_accumulation_steps
                denom = denom * steps / self.args.steps_per_generation
            logprobs = self._logps(model, inputs)  # (b, T)
            old = inputs.get("old_per_token_logps", logprobs.detach())
            loss, _ = policy_loss(logprobs, old, inputs["advantages"] * stage, stage,
                                  epsilon=self.epsilon_low, epsilon_high=self.epsilon_high,
                                  dual_clip=self.dual_clip, beta=self.beta,
                                  ref_logprobs=inputs.get("ref_per_token_logps"), num_tokens=denom)
            return loss

    return LoptiGRPOTrainer


def __getattr__(name: str):
    """`lopti.LoptiGRPOTrainer` imports TRL on first use; `import lopti` does not."""
    if name == "LoptiGRPOTrainer":
        return _lopti_grpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ====== The command line: lopti.py {toy,train,eval,diagnose,plot,compare} [--preset NAME] ======

PRESETS: dict[str, dict] = {
    # a laptop, < 45 minutes on 2 cores: 50x the paper's learning rate, a warm-up (pure RL on K&K
    # stalls at this size: toy/README)
    "cpu": dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", num_people="2", num_train=256,
                steps=20, prompts_per_step=4, num_generations=8, max_completion_length=160,
                mini_batch_size=32, micro_batch_size=8, beta=0.0, learning_rate=5e-5,
                warmup_steps=60, warmup_learning_rate=3e-4, stop_at_answer=True, eval_size=64,
                eval_every=10, eval_batch_size=16, save_every=10, output_dir="runs/cpu"),
    # a free Colab T4 (15 GB, fp32): the laptop's warm-up at a third of its rate, 2-3 people (a
    # 4-person case analysis is ~580 tokens). Never run on a GPU (README)
    "colab": dict(model="Qwen/Qwen2.5-0.5B-Instruct", num_people="2-3", num_train=400,
                  steps=100, prompts_per_step=4, num_generations=8, max_completion_length=512,
                  mini_batch_size=16, micro_batch_size=4, beta=0.0, warmup_steps=60,
                  warmup_learning_rate=1e-4, gradient_checkpointing=True, eval_size=32,
                  eval_every=25, save_every=25, output_dir="runs/colab"),
    # one 80 GB GPU: the paper's Qwen2.5-3B at half its batch and length, the official 100 puzzles
    # per size (README). Figure 3's measurement (two fp32 passes) is off
    "gpu": dict(prompts_per_step=32, max_completion_length=2048, mini_batch_size=128,
                micro_batch_size=8, generation_batch_size=128, steps=150, eval_size=100,
                eval_every=25, save_every=25, gradient_checkpointing=True, measure_update=False,
                output_dir="runs/gpu"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _field_docs() -> dict[str, str]:
    body = ast.parse(inspect.getsource(Config)).body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


TRAIN_ONLY = ("output_dir", "save_every", "report_to")  # what eval and diagnose refuse


def build_parser() -> argparse.ArgumentParser:
    description = "GRPO with Advantage Reweighting and Lopti (Yang et al., ICLR 2026)"
    parser = _Parser(prog="lopti.py", allow_abbrev=False, description=description)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    toy = sub.add_parser("toy", help="Figure 3's mechanism on a toy softmax policy (CPU, seconds)")
    for f in fields(ToySettings):
        toy.add_argument(f"--{f.name}", type=type(f.default), help=f"default {f.default}")
    toy.add_argument("--quick", action="store_true", help=f"a smoke test: {TOY_QUICK}")
    toy.add_argument("--out", type=_path, help="folder of results.json, figures.png (default "
                     "runs/toy/)")
    docs = _field_docs()
    kinds = {"float": float, "int": int, "str": str, "bool": _parse_bool}
    commands = (("train", "GRPO (+AR, +Lopti) on Knights and Knaves"),
                ("eval", "greedy K&K accuracy"),
                ("diagnose", "Figure 1; with an explicit --steps N, Figure 3 paired over N steps"))
    for name, what in commands:
        p = sub.add_parser(name, help=what, argument_default=argparse.SUPPRESS, allow_abbrev=False)
        p.add_argument("--preset", choices=sorted(PRESETS), help="settings for a machine (PRESETS)")
        for f in fields(Config):
            if name != "train" and f.name in TRAIN_ONLY:
                continue
            p.add_argument(f"--{f.name}", type=kinds[f.type], metavar=f.type.upper(),
                           help=f"{docs[f.name]} (default {f.default!r})")
    may_change = ", ".join(RESUME_MAY_CHANGE)
    sub.choices["train"].add_argument("--resume", action="store_true", help="continue the run in "
                                      f"--output_dir; flags may change only {may_change}")
    sub.choices["diagnose"].add_argument("--out", type=_path, default=Path("diagnose.json"),
                                         help="the JSON to write (default diagnose.json)")
    plot = sub.add_parser("plot", help="learning curves of runs")
    plot.add_argument("runs", nargs="+", type=_path, metavar="RUN_DIR", help="folders of train")
    plot.add_argument("--out", type=_path, default=Path("plot.png"), help="default plot.png")
    compare = sub.add_parser("compare", help="two runs' accuracies on the same puzzles, paired")
    compare.add_argument("runs", nargs=2, type=_path, metavar="RUN_DIR", help="folders of train")
    return parser


def resolve_config(args: dict) -> Config:
    """Defaults < preset < explicit flags. --resume: the run's config.json < explicit flags; so too
    eval of a run's checkpoint (RUN/checkpoint-N), which then scores the run's own puzzles."""
    explicit = {f.name: args[f.name] for f in fields(Config) if f.name in args}
    base = PRESETS[args["preset"]] if "preset" in args else {}
    if args["command"] == "eval":
        model = Path(explicit.get("model", Config.model)).expanduser()
        run = model.parent
        from_run = (model / "trainer_state.pt").is_file() and (run / "config.json").is_file()
    else:
        run = Path({**base, **explicit}.get("output_dir", Config.output_dir)).expanduser()
        from_run = args.get("resume")
    if not from_run:
        return Config(**{**base, **explicit})
    if not (run / "config.json").is_file():
        raise ValueError(f"--resume: {run} holds no run of lopti.py (no config.json)")
    saved = {**read_config(run / "config.json"), "output_dir": str(run)}
    if args["command"] == "eval":
        print(f"evaluating with {run}/config.json's settings (flags override)", file=sys.stderr)
        saved["report_to"] = "none"
    try:
        Config(**{**saved, "report_to": "none"})  # (the logger is checked with the flags)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{run}/config.json: {e}") from None
    return Config(**{**saved, **explicit})


def check_replaceable(path: Path, key: str, command: str) -> None:
    """Before any work: `path` is new, or JSON with `key` that `command` wrote earlier."""
    if not path.exists():
        return
    try:
        earlier = json.loads(path.read_text())
    except (ValueError, OSError):
        earlier = None
    toy = isinstance(earlier, dict) and "prop_4_2" in earlier  # (the toy's has a figure1 too)
    if not (isinstance(earlier, dict) and key in earlier and toy == (command == "toy")):
        raise ValueError(f"{path} exists and is not {command}'s output: choose another --out")


def toy_main(args: argparse.Namespace) -> dict:
    given = {f.name: getattr(args, f.name) for f in fields(ToySettings)
             if getattr(args, f.name, None) is not None}
    settings = ToySettings(**{**(TOY_QUICK if args.quick else {}), **given})
    out = args.out or Path("runs/toy")
    check_replaceable(out / "results.json", "prop_4_2", "toy")
    if (out / "figures.png").exists() and not (out / "results.json").exists():
        check_replaceable(out / "figures.png", "prop_4_2", "toy")
    threads = torch.get_num_threads()
    t0 = time.time()
    torch.set_num_threads(1)  # faster for small matrices; the same float sums on every machine
    try:
        result = run_toy(settings, workers=min(2, os.cpu_count() or 1))
    finally:
        torch.set_num_threads(threads)
    result["checks"] = toy_checks(result)
    result["version"] = lopti_version()
    print("\n".join(result["checks"]))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    wrote = [out / "results.json"]
    try:
        plot_toy(result, out / "figures.png")
        wrote.append(out / "figures.png")
    except ValueError:
        print("(pip install matplotlib: figures.png too)")
    print(f"wrote {', '.join(map(str, wrote))} in {time.time() - t0:.1f} s")
    return result


OUT_OF_MEMORY = ("out of memory: lower --micro_batch_size (update and log-prob passes), "
                 "--generation_batch_size (rollout) or --eval_batch_size; then --resume")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def main(argv: list[str] | None = None) -> int:
    """A bad value or file: one line, exit 2; out of memory: one line naming the settings to lower,
    exit 1; Ctrl-C or SIGTERM: train saves, then exits 130 or 143; the rest exit so at once."""
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # (train's StopOnSignal overrides it)
    try:
        if args.command == "toy":
            toy_main(args)
        elif args.command == "plot":
            plot_runs(args.runs, args.out)
        elif args.command == "compare":
            compare_runs(*args.runs)
        else:
            import datasets
            datasets.disable_progress_bars()
            cfg = resolve_config(vars(args))
            if args.command == "train":
                print(f"done: {train(cfg, resume=getattr(args, 'resume', False))}")
            elif args.command == "diagnose":
                if args.out.suffix != ".json" or args.out.is_dir():
                    raise ValueError(f"--out {args.out} must name a .json file")
                check_replaceable(args.out, "figure1", "diagnose")
                args.out.parent.mkdir(parents=True, exist_ok=True)
                diagnose(cfg, vars(args).get("steps", 0), args.out)  # only an explicit --steps
            else:
                print(json.dumps(eval_main(cfg), indent=2))
    except (ValueError, OSError) as e:  # a bad value, file or model name, or a folder not a run
        print(f"lopti.py {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(e):
            raise
        print(f"lopti.py {args.command}: {OUT_OF_MEMORY}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"lopti.py {args.command}: interrupted", file=sys.stderr)
        return 128 + (e.args[0] if e.args else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
