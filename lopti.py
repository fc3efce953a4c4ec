"""lopti.py: GRPO with Advantage Reweighting and Lopti, in one file.

Reference implementation of "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs" (Yang et al.,
ICLR 2026, arXiv 2505.12929). Official code: github.com/zhyang2226/AR-Lopti (a fork of verl 0.1).

    python lopti.py toy                  # Figure 3's mechanism on a toy softmax policy, CPU, seconds
    python lopti.py train --preset cpu   # GRPO + AR + Lopti on Knights and Knaves with a Hugging Face LM
    python lopti.py eval | diagnose | fig3 | plot    # accuracy; Figures 1 and 3 of a model or runs; curves

Sections (grep -n '^# ===' lopti.py): config -> core maths -> the update (Algorithm 1) -> Figures 1 and 3 -> toy
-> Knights and Knaves -> the LLM run. A first read can stop at the TRL section.
"""
from __future__ import annotations

import argparse
import ast
import collections
import copy
import dataclasses
import functools
import inspect
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import datasets
import torch
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

# ====== Config: one dataclass, the paper's K&K settings ======


@dataclass
class Config:
    """Every field is a flag (--field value); PRESETS change a few. Defaults: the paper's K&K run (Qwen2.5-3B;
    official scripts/train_kklogic_*.sh). Names shared with TRL's GRPOConfig keep TRL's spelling."""

    # --- method
    alpha: float = 0.3
    """Advantage Reweighting strength, Eq. 4; 0 is GRPO (paper: 0.3 on K&K, 0.1 on math; official: reweight_k)."""
    lopti: bool = True
    """Lopti: two update passes per step, low-probability tokens first (Algorithm 1)."""
    eta: float = 0.5
    """Lopti's threshold: tokens with pi_old < eta go in the low pass (official: seperate_prob)."""
    lopti_order: str = "low_first"
    """'low_first' is the paper's method; 'high_first' its ablation (worse than GRPO in the paper)."""
    # --- PPO / GRPO update
    epsilon: float = 0.2
    """Lower clip range of the ratio."""
    epsilon_high: float = 0.24
    """Upper clip range of the ratio (the official K&K scripts clip asymmetrically)."""
    dual_clip: float = 10.0
    """Dual-clip constant for negative advantages (official code's clip_ratio_c; not in the paper's text)."""
    beta: float = 0.001
    """Weight of the k3 KL penalty to the reference model; 0 loads no reference model."""
    learning_rate: float = 1e-6
    """Constant learning rate."""
    optimizer: str = "adamw"
    """'adamw' (betas 0.9/0.999) or 'sgd', without momentum or decay (the paper's analysis: SGD, lr 1e-3)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip per optimiser step."""
    mini_batch_size: int = 256
    """Responses per optimiser step (paper: 512 responses per RL step, 2 optimiser steps per pass)."""
    micro_batch_size: int = 4
    """Responses per forward/backward; gradients accumulate over a mini-batch."""
    num_iterations: int = 1
    """PPO epochs over the rollout batch in each update pass (paper: 1)."""
    # --- rollout
    model: str = "Qwen/Qwen2.5-3B-Instruct"
    """Hub id or local folder of a causal LM with a chat template."""
    prompts_per_step: int = 64
    """Prompts per RL step; each gets num_generations samples."""
    num_generations: int = 8
    """Group size G: samples per prompt."""
    temperature: float = 0.7
    """Sampling temperature T. Every log-prob (current, old, reference) is of logits / T, as the official actor's:
    scoring softmax(z) while sampling softmax(z / T) would make the first ratio != 1 and move Lopti's split."""
    max_completion_length: int = 4096
    """Longest completion, in tokens."""
    generation_batch_size: int = 0
    """Sequences per generate() call (0: all at once); smaller bounds the KV cache's memory."""
    stop_at_answer: bool = False
    """End completions at their first '</answer>', as many K&K reproductions do (the paper's end at EOS)."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in the update's forward passes."""
    # --- task, warm-up and schedule
    warmup_steps: int = 0
    """Supervised steps on the solver's own case analysis before RL (kk_case_analysis; 0: none, the paper's)."""
    warmup_learning_rate: float = 2e-5
    """The warm-up's constant learning rate."""
    train_data: str = "generate"
    """'generate' (ours: fresh puzzles; the official run: Logic-RL's 3-7 people files), a file or a hub dataset."""
    num_people: str = "3-7"
    """Puzzle sizes to generate: 'lo-hi' or one number, within 2..8."""
    num_train: int = 4480
    """Generated training puzzles (paper: 70 steps of 64 prompts per data epoch)."""
    steps: int = 350
    """RL steps (paper: 5 data epochs)."""
    eval_data: str = "generate"
    """'generate' (puzzles from a seed disjoint from training's) or a file / hub dataset."""
    eval_size: int = 20
    """Generated evaluation puzzles per number of people (the official: 100 per size, Logic-RL's test files)."""
    eval_every: int = 50
    """Evaluate every this many steps (0: only at the end)."""
    eval_batch_size: int = 32
    """Prompts per greedy-generation batch in evaluation."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end, and on Ctrl-C or SIGTERM)."""
    measure_update: bool = True
    """Log Figure 3 of every step's own update (update_counts: one no-grad forward after it; two fp32 under bf16)."""
    output_dir: str = "runs/lopti"
    """The run's folder: config.json, metrics.jsonl, samples.jsonl, checkpoint-STEP/."""
    seed: int = 0
    """Seeds data order, sampling and generated puzzles."""

    def __post_init__(self):  # every value is checked here, before anything loads; main prints the error's one line
        lo, hi = people_range(self.num_people)
        B, mini = self.prompts_per_step * self.num_generations, self.mini_batch_size
        rules = {**{n: (getattr(self, n) >= 0, ">= 0") for n in ("epsilon", "epsilon_high", "beta", "weight_decay",
                    "generation_batch_size", "eval_every", "save_every", "seed", "warmup_steps")},
                 **{n: (getattr(self, n) > 0, "> 0") for n in ("learning_rate", "temperature", "max_grad_norm",
                    "warmup_learning_rate",
                    "micro_batch_size", "num_iterations", "num_train", "max_completion_length", "steps",
                    "eval_size", "eval_batch_size", "prompts_per_step", "num_generations")},
                 "alpha": (0 <= self.alpha <= 1, "in [0, 1]"), "eta": (0 < self.eta <= 1, "in (0, 1]"),
                 "dual_clip": (self.dual_clip > 1, "> 1"), "num_people": (2 <= lo <= hi <= 8, "within 2..8"),
                 "lopti_order": (self.lopti_order in ("low_first", "high_first"), "low_first or high_first"),
                 "optimizer": (self.optimizer in ("adamw", "sgd"), "adamw or sgd"),
                 "mini_batch_size": (mini > 0 and B % mini == 0 and mini % max(self.micro_batch_size, 1) == 0,
                                     f"a divisor of prompts_per_step * num_generations ({B}), x micro_batch_size")}
        for name, (ok, allowed) in rules.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")


def people_range(spec: str) -> tuple[int, int]:
    """'3-7' -> (3, 7); '5' -> (5, 5)."""
    lo, _, hi = spec.partition("-")
    if not (lo.isdigit() and (hi.isdigit() or not hi)):
        raise ValueError(f"num_people must be 'lo-hi' or a number, e.g. '3-7', got {spec!r}")
    return int(lo), int(hi or lo)


# ====== Core maths: group advantage, log-probs, AR (Eq. 4), Lopti's split (Algorithm 1), the loss ======
# Pure tensor functions that never mutate their inputs: copy one into another trainer, with its test.


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (advantages.float().unsqueeze(-1) if advantages.dim() == 1 else advantages.float()).expand(like.shape)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage, one per response (official: compute_grpo_outcome_advantage):

        A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)        std: unbiased, as the official code's

    `rewards` (B,): each prompt's G responses in consecutive rows. Equal rewards give A = 0 (not 0/eps noise); a
    group of one gets mean 0, std 1, as in the official code.
    Example: G = 8, rewards [1, 0, 0, 0, 0, 0, 0, 0] -> A = [2.47, -0.35, ..., -0.35]."""
    assert rewards.dim() == 1 and rewards.numel() % group_size == 0, "rewards must be (B,), B a multiple of G"
    r = rewards.float().view(-1, group_size)  # (P, G)
    if group_size == 1:
        return (r / (1.0 + eps)).view(-1)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)  # (P, G)
    return torch.where((r == r[:, :1]).all(1, keepdim=True), 0.0, adv).view(-1)  # (B,)


def _chunk_logprobs(x: torch.Tensor, tokens: torch.Tensor, temperature: float, head) -> torch.Tensor:
    z = (x if head is None else head(x)).float() / temperature  # (n, V): one chunk of logits
    top = z.detach().amax(-1, keepdim=True)  # (n, 1): a constant shift, whose gradient would cancel
    log_sum = (z - top).exp().sum(-1, dtype=torch.float64).log()  # (n,): log(1 + rest), summed in fp64
    return ((z.gather(-1, tokens.unsqueeze(-1)) - top).squeeze(-1) - log_sum).float()  # (n,)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   chunk_elems: int = 2**24, head: torch.nn.Linear | None = None) -> torch.Tensor:
    """log pi(o_t) = log softmax(z_t / T)[o_t] in fp32 for logits (B, T, V) and tokens (B, T); with `head` (an LM's
    output layer), `logits` are final hidden states (B, T, H) and z_t = head(h_t).
    - The softmax's sum in fp64: near pi = 1 it is 1 + a tiny rest, which fp32 rounds in steps of 6e-8, so that an
      update's change to such a token would read as none (Figure 3's ties).
    - With `head`, chunks of ~`chunk_elems` logits: the (B, T, V) logits never exist whole, and under autograd a
      chunk and its head are recomputed in the backward pass, not stored."""
    flat_x, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)  # (B*T, V or H), (B*T,)
    rows = max(1, chunk_elems // (logits.shape[-1] if head is None else head.out_features))
    recompute = head is not None and torch.is_grad_enabled()
    out = [checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args)
           for args in ((flat_x[i:i + rows], flat_tokens[i:i + rows], temperature, head)
                        for i in range(0, len(flat_x), rows))]
    return torch.cat(out).view(tokens.shape) if out else torch.zeros(tokens.shape, device=logits.device)  # (B, T)


def reweight_advantages(advantages: torch.Tensor, old_logprobs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting, Eq. 4, for (B,) or (B, T) advantages and (B, T) log pi_old at the sampling temperature:

        A_{i,t} <- (alpha * pi_old(o_{i,t}) + 1 - alpha) * A_{i,t}

    The weight is a constant (no gradient), for positive and negative advantages alike; alpha = 0 is GRPO."""
    return (alpha * old_logprobs.detach().float().exp() + 1 - alpha) * _per_token(advantages, old_logprobs)  # (B, T)


def lopti_masks(old_logprobs: torch.Tensor, mask: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lopti's split of the response tokens (Algorithm 1): low = pi_old < eta, high = the rest; two (B, T) masks
    that partition `mask`, made once per RL step for both stages.
    Example, eta = 0.5: exp(old_logprobs) [[0.9, 0.2, 0.6, 1.0]], mask [[1, 1, 1, 0]] -> low [[F, T, F, F]],
    high [[T, F, T, F]]"""
    low = mask.bool() & (old_logprobs.detach().float().exp() < eta)  # (B, T)
    return low, mask.bool() & ~low


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                epsilon: float = 0.2, epsilon_high: float = 0.24, dual_clip: float = 10.0,
                ref_logprobs: torch.Tensor | None = None, beta: float = 0.0, kl_mask: torch.Tensor | None = None,
                num_tokens: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped surrogate with a k3 KL penalty, aggregated token-mean (official: core_algos.py); and the
    counts of clipped tokens, the KL's sum and the token counts behind them:

        ratio = exp(logp - old_logp)
        pg    = max(-A * ratio, -A * clip(ratio, 1 - epsilon, 1 + epsilon_high))
        pg    = min(pg, -A * dual_clip)                  where A < 0
        kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1
        loss  = (sum_{mask} pg + beta * sum_{kl_mask} kl) / num_tokens

    (B, T) inputs (`advantages` may be (B,)). num_tokens: the whole mini-batch's count for a micro-batch (so that
    accumulation is exact), and in a Lopti stage too: stages are not renormalised, so they add up to GRPO. The dual
    clip, `kl_mask` per stage, the token-mean (the paper averages each response with 1/|o_i| first) and the shared
    denominator follow the official code; the paper's text has none of them."""
    assert beta == 0 or ref_logprobs is not None, "beta > 0 needs ref_logprobs"
    adv, mask = _per_token(advantages, logprobs), mask.bool()  # (B, T)
    kl_mask = mask if kl_mask is None else kl_mask.bool() & mask
    denom = (mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)).clamp(min=1)
    # 0 on padding before exp (no NaN gradient); the clamp is upstream verl's (the fork's has none): exp overflows
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.float(), 0.0).clamp(-20, 20)  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - epsilon, 1 + epsilon_high))  # (B, T)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)  # (B, T): the dual clip
    loss = torch.where(mask, pg, 0.0).sum() / denom
    kl = torch.zeros_like(pg)
    if ref_logprobs is not None:  # k3, with the official clamps: log-ratio to [-5, 5], KL to [-10, 10]
        d = torch.where(kl_mask, ref_logprobs.float() - logprobs.float(), 0.0).clamp(-5, 5)  # (B, T)
        kl = torch.where(kl_mask, (d.exp() - d - 1).clamp(-10, 10), 0.0)  # (B, T)
        loss = loss + beta * kl.sum() / denom
    with torch.no_grad():  # sums (0-dim tensors: no GPU sync), to add up over micro-batches
        stats = {"clip_high": ((ratio > 1 + epsilon_high) & (adv > 0) & mask).sum(),
                 "clip_low": ((ratio < 1 - epsilon) & (adv < 0) & mask).sum(), "kl_ref": kl.sum(),
                 "tokens": mask.sum(), "kl_tokens": kl_mask.sum()}
    return loss, stats


# ====== The update: Algorithm 1 (one GRPO pass, or Lopti's two passes) ======


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW as the official scripts train (betas 0.9/0.999, constant lr), or SGD: p <- p - lr * g."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
    return torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)


def rows_with_gradient(advantages: torch.Tensor, beta: float) -> torch.Tensor:
    """(B,) bool: rows with a non-zero advantage, or all when beta > 0 (the KL term). The rest have no gradient:
    they need no pi_old, no forward and no backward."""
    return (advantages != 0).view(len(advantages), -1).any(1) | (beta > 0)


def update_policy(cfg: Config, logprob_fn: Callable[[dict], torch.Tensor], optimizer: torch.optim.Optimizer,
                  batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """One RL step's update: AR (Eq. 4), then one GRPO pass or Lopti's two complete passes (Algorithm 1). `batch`:
    (B, T) `old_logprobs` and `mask`, (B,) `advantages`, optionally `ref_logprobs`, and what `logprob_fn(micro)`
    needs to return the current (b, T) log-probs with gradients. One optimiser step per mini-batch, micro-batches
    accumulated (policy_loss's num_tokens). Stage 2 starts from stage 1's weights and optimiser state, with the same
    pi_old and split. Rows without gradient are skipped but counted in the denominator."""
    B, mask = len(batch["mask"]), batch["mask"].bool()
    adv = reweight_advantages(batch["advantages"], batch["old_logprobs"], cfg.alpha)  # (B, T): AR before Lopti
    stages = [("all", mask)]
    if cfg.lopti:
        low, high = lopti_masks(batch["old_logprobs"], mask, cfg.eta)
        stages = [("low", low), ("high", high)] if cfg.lopti_order == "low_first" else [("high", high), ("low", low)]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    active = mask & rows_with_gradient(batch["advantages"], cfg.beta)[:, None]  # (B, T)
    out = {}
    for name, stage in stages:
        t0, in_pass = time.perf_counter(), (active & stage).any(1).cpu()  # (B,): the rows computed in this pass
        sums, losses, norms = collections.Counter(), [], []
        for _ in range(cfg.num_iterations):
            for start in range(0, B, cfg.mini_batch_size):
                rows = torch.arange(start, min(start + cfg.mini_batch_size, B))
                if not in_pass[rows].any():  # no gradient, no step (the official code steps: AdamW's momentum
                    continue  # and decay move the weights even so)
                n = mask[rows].sum()  # the mini-batch's tokens, in both stages (verl: a mean per micro-batch)
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for micro in rows[in_pass[rows]].split(cfg.micro_batch_size):
                    sub = {k: v[micro] for k, v in batch.items()}
                    loss, stats = policy_loss(
                        logprob_fn(sub), sub["old_logprobs"], adv[micro] * stage[micro], mask[micro],
                        epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, dual_clip=cfg.dual_clip, beta=cfg.beta,
                        ref_logprobs=sub.get("ref_logprobs"), kl_mask=stage[micro], num_tokens=n)
                    loss.backward()
                    loss_sum += loss.detach()
                    sums.update(stats)
                norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
                if math.isfinite(norm):  # ours: a NaN/inf step would corrupt the weights for good (official: steps)
                    optimizer.step()
                    norms.append(norm)
                    losses.append(loss_sum)  # (a tensor: read once, after the pass)
        per = lambda a, b: float(a) / max(float(b), 1.0)  # noqa: E731
        out.update({f"{name}/clip_high": per(sums["clip_high"], sums["tokens"]), f"{name}/loss": per(sum(losses),
                    len(losses)), f"{name}/clip_low": per(sums["clip_low"], sums["tokens"]), f"{name}/grad_norm":
                    per(sum(norms), len(norms)), f"{name}/kl_ref": per(sums["kl_ref"], sums["kl_tokens"]),
                    f"{name}/token_share": per((stage & active).sum(), active.sum()),
                    f"time/update_{name}": time.perf_counter() - t0})
    optimizer.zero_grad(set_to_none=True)  # free the gradients before the next rollout
    return out


# ====== Figures 1 and 3, per pi_old bin [0,.25], (.25,.5], (.5,.75], (.75,1] ======
# Figure 3: after an update, the share of A > 0 tokens whose probability rose; of every step's own update
# (update_counts) and paired, every method's update from one state (paired_counts). Figure 1: measure_bins.

BIN_NAMES = ("[0,.25]", "(.25,.5]", "(.5,.75]", "(.75,1]")
PAPER_FIGURES = {  # the paper's K&K runs (Qwen2.5-7B-Instruct-1M): Figure 1 (a) and (d) of GRPO, Figure 3
    "token_share": [0.1922, 0.1015, 0.1009, 0.6054], "grad_norm": {"bins": [0.71, 0.36, 0.24, 0.15], "all": 0.82},
    "pos_rose": {"grpo": [0.530, 0.514, 0.501, 0.497], "ar": [0.520, 0.525, 0.530, 0.526],
                 "lopti": [0.524, 0.517, 0.512, 0.534]}}
UPDATE_KEYS = ("pos_tokens", "pos_rose", "pos_fell", "neg_tokens", "neg_fell", "neg_rose")  # update/...: 4 bins
METHODS = {"grpo": dict(alpha=0.0, lopti=False), "ar": dict(lopti=False), "lopti": dict(alpha=0.0, lopti=True),
           "ar_lopti": dict(lopti=True), "grpo_2_epochs": dict(alpha=0.0, lopti=False),  # (2 epochs: method_config)
           "lopti_high_first": dict(alpha=0.0, lopti=True, lopti_order="high_first")}  # the paper's ablation


def method_config(cfg: Config, method: str) -> Config:
    """`cfg` switched to a method of METHODS (AR's alpha: cfg's, or the paper's if 0). 'grpo_2_epochs' makes as
    many passes as Lopti: the compute-matched control."""
    extra = {"num_iterations": 2 * cfg.num_iterations} if method == "grpo_2_epochs" else {}
    return dataclasses.replace(cfg, **{"alpha": cfg.alpha or Config.alpha, "lopti_order": "low_first",
                                       **METHODS[method], **extra})


def method_name(cfg: dict) -> str:
    """grpo, ar, lopti or ar_lopti (+ _high_first, the ablation), from a run's config.json."""
    name = {(0, 0): "grpo", (1, 0): "ar", (0, 1): "lopti", (1, 1): "ar_lopti"}[(cfg["alpha"] > 0, cfg["lopti"])]
    return name + ("_high_first" if cfg["lopti"] and cfg["lopti_order"] == "high_first" else "")


def bin_masks(old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(4, B, T) bool: the response tokens of each pi_old bin."""
    bins = torch.bucketize(old_logprobs.float().exp(), torch.tensor([0.25, 0.5, 0.75], device=mask.device))
    return torch.stack([(bins == b) & mask.bool() for b in range(4)])


def update_counts(before: torch.Tensor, after: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  old_logprobs: torch.Tensor | None = None) -> dict[str, list[int]]:
    """Figure 3 per bin: the A > 0 tokens (A before AR) and how many rose or fell from `before` to `after` (one
    pass's log-probs, so that an unmoved token compares equal), and the A < 0 tokens and how many fell or rose; the
    rest are ties. Counts pool by summing. (The official code saves the probabilities before and after a step,
    verl/trainer/ppo/ray_trainer.py's "prob_stat", in bf16: its ratios are counted from those.)"""
    masks = bin_masks(before if old_logprobs is None else old_logprobs, mask)  # (4, B, T)
    adv, move, out = _per_token(advantages, before), (after - before).sign(), {}  # (B, T), (B, T)
    for sign, name, good, bad in ((1, "pos", "rose", "fell"), (-1, "neg", "fell", "rose")):
        m = masks & (adv.sign() == sign)  # (4, B, T)
        out[f"update/{name}_tokens"] = m.sum((1, 2)).tolist()
        out[f"update/{name}_{good}"] = (m & (move == sign)).sum((1, 2)).tolist()
        out[f"update/{name}_{bad}"] = (m & (move == -sign)).sum((1, 2)).tolist()
    return out


def pool_counts(records: list[dict]) -> dict[str, list[int]]:
    """update_counts of steps or runs, summed per bin."""
    return {f"update/{k}": [sum(r.get(f"update/{k}", [0] * 4)[b] for r in records) for b in range(4)]
            for k in UPDATE_KEYS}


def figure3_shares(c: dict) -> dict[str, list]:
    """Per bin: the share of A > 0 tokens that rose (Figure 3), that share among those that moved, the ties."""
    n, rose, fell = c["update/pos_tokens"], c["update/pos_rose"], c["update/pos_fell"]
    div = lambda a, b: [x / y if y else None for x, y in zip(a, b)]  # noqa: E731
    moved = [r + f for r, f in zip(rose, fell)]
    return {"rose": div(rose, n), "rose_of_moved": div(rose, moved), "ties": div([k - m for k, m in zip(n, moved)], n)}


def paired_counts(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, logprob_fn: Callable,
                  batch: dict, measure: Callable[[], torch.Tensor], before: torch.Tensor, methods) -> dict[str, dict]:
    """Figure 3 paired: each method's whole update from the same weights, optimiser state and batch, counted against
    `before` by `measure()` (the same pass), then weights and optimiser state restored bit for bit. A difference
    between methods is then theirs, not their batches' or trajectories'."""
    snapshot = lambda x: x.to("cpu", copy=True) if torch.is_tensor(x) else copy.deepcopy(x)  # noqa: E731
    weights, state, out = {k: snapshot(v) for k, v in model.state_dict().items()}, optimizer.state_dict(), {}
    state = {"state": {i: {k: snapshot(v) for k, v in p.items()} for i, p in state["state"].items()},
             "param_groups": snapshot(state["param_groups"])}  # on the CPU: the GPU holds one model and state
    for m in methods:
        update_policy(method_config(cfg, m), logprob_fn, optimizer, batch)
        out[m] = update_counts(before, measure(), batch["advantages"], batch["mask"], batch["old_logprobs"])
        model.train()  # (measure() left it in eval mode)
        model.load_state_dict(weights)
        optimizer.load_state_dict(copy.deepcopy(state))  # (it keeps the tensors it is given)
    return out


def paired_deltas(units: list[dict], reference: str = "grpo", resamples: int = 4000) -> dict[str, dict]:
    """Per method and bin, from paired_counts of units (steps, or seeds' sums): its share of A > 0 tokens that rose
    minus the reference's (delta), a 95 % bootstrap interval over units (ci95), and a two-sided sign-flip test of
    delta = 0 (p: every sign pattern of the units' differences up to 12 units, else random ones). 'resolved' is
    p < 0.05, which 5 units can never reach (p >= 2/32): few units are "not resolved", whatever the interval."""
    n = torch.tensor([u[reference]["update/pos_tokens"] for u in units], dtype=torch.float64)  # (U, 4)
    g, U = torch.Generator().manual_seed(0), len(units)
    pick = torch.randint(U, (resamples, U), generator=g)  # (R, U)
    signs = torch.tensor(list(itertools.product((1.0, -1.0), repeat=U)), dtype=torch.float64) if U <= 12 else \
        torch.randint(0, 2, (resamples, U), generator=g).double() * 2 - 1  # (S, U)
    out = {}
    for m in [m for m in units[0] if m != reference]:
        d = torch.tensor([[a - b for a, b in zip(u[m]["update/pos_rose"], u[reference]["update/pos_rose"])]
                          for u in units], dtype=torch.float64)  # (U, 4)
        lo, hi = ((d[pick].sum(1) / n[pick].sum(1)).nanquantile(q, 0).tolist() for q in (0.025, 0.975))
        hits = ((signs @ d).abs() >= d.sum(0).abs() - 1e-9).double().sum(0)  # (4,)
        p = (hits / len(signs) if U <= 12 else (hits + 1) / (len(signs) + 1)).tolist()  # (random: never 0)
        delta = [float(v / k) if k else None for v, k in zip(d.sum(0), n.sum(0))]
        out[m] = {"delta": delta, "ci95": [[a, b] if x is not None else None for a, b, x in zip(lo, hi, delta)],
                  "p": p, "resolved": [x is not None and q < 0.05 for x, q in zip(delta, p)]}
    return out


def measure_bins(micro_batch_size: int, model: torch.nn.Module, logprob_fn: Callable, batch: dict) -> dict:
    """Figure 1 (a) and (d) on one batch: per bin, the share of the tokens of rows with A != 0, and the norm of
    GRPO's gradient at ratio 1 (pi_old from this forward) with only that bin's advantages kept; at ratio 1 the loss
    is linear in A, so the bins' gradients add up to the all-token one ("all")."""
    params, mask = [p for p in model.parameters() if p.requires_grad], batch["mask"].bool()
    masks, n = bin_masks(batch["old_logprobs"], mask), mask.sum()  # (4, B, T)
    grads = [[torch.zeros_like(p) for p in params] for _ in range(4)]
    rows = rows_with_gradient(batch["advantages"], 0.0).nonzero().squeeze(1).cpu()
    for micro in rows.split(micro_batch_size) if len(rows) else ():
        sub = {k: v[micro] for k, v in batch.items()}
        logp = logprob_fn(sub)  # (b, T)
        for b in range(4):
            loss, _ = policy_loss(logp, logp.detach(), _per_token(sub["advantages"], logp) * masks[b][micro],
                                  mask[micro], num_tokens=n)
            for g, d in zip(grads[b], torch.autograd.grad(loss, params, retain_graph=b < 3, materialize_grads=True)):
                g += d
    norm = lambda gs: math.sqrt(sum(float(g.double().square().sum()) for g in gs))  # noqa: E731
    active = mask & rows_with_gradient(batch["advantages"], 0.0)[:, None]  # (the others may have no pi_old)
    share = [float((k & active).sum() / active.sum()) if active.any() else None for k in masks]
    return {"token_share": share, "grad_norm": {"bins": [norm(g) for g in grads],
                                                      "all": norm([sum(g) for g in zip(*grads)])}}


# ====== Toy: Figure 3's mechanism on a linear softmax policy ======
# logits_t = W x_t + b_t over V = 1,024 tokens. W, the only trained weight, is shared by every context as an LLM's
# output layer is; x_t, a fixed random recurrent feature of the history (prefixes rarely repeat); b_t, a fixed bias
# s in [4, 11] on a bigram token, which makes sampled tokens' probabilities U-shaped. The first `decisions` tokens
# decide an outcome reward (1 iff all equal the prompt's target, there the *second* most likely token); the rest
# are "format" tokens, alike in right and wrong responses. Design and prediction: toy/README.md.


@dataclass(frozen=True)
class ToySettings:
    seed: int = 0  # run i of `seeds` has its own random task and samples: seed + i
    seeds: int = 8  # trajectories per method (a sign-flip test over 8 can reach p < 0.05; over 5 it cannot)
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
        for name, ok in (("seeds", self.seeds >= 1), ("steps", self.steps >= 1), ("vocab", self.vocab >= 2),
                         ("dim", self.dim >= 1), ("prompts", self.prompts >= 1), ("group", self.group >= 2),
                         ("decisions", 1 <= self.decisions <= self.length), ("target_gap", self.target_gap >= 0)):
            if not ok:
                raise ValueError(f"toy setting {name} = {getattr(self, name)!r} is out of range")


TOY_QUICK = dict(seeds=2, steps=5)  # toy --quick: a smoke test
TOY_OWN_RUNS = ("grpo", "ar", "lopti", "ar_lopti")  # each trains its own trajectories
TOY_PAIRED = ("ar", "lopti", "ar_lopti", "grpo_2_epochs", "lopti_high_first")  # probed along GRPO's trajectories


class ToyPolicy(torch.nn.Module):
    """Only W is trained: a rollout's contexts and biases are computed once (sample), a pass is one matmul."""

    def __init__(self, s: ToySettings, seed: int):
        super().__init__()
        g, V, d = torch.Generator().manual_seed(seed), s.vocab, s.dim
        self.W = torch.nn.Parameter(torch.randn(V, d, generator=g))
        self.A = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * 0.5  # the context's fixed recurrence
        self.F = torch.randn(V, d, generator=g)  # fixed input features of tokens (a prompt is a token id too)
        self.bigram, self.strength = torch.randint(V, (V,), generator=g), 4 + 7 * torch.rand(V, generator=g)
        self.target = torch.randint(V, (s.prompts, s.decisions), generator=g)  # each prompt's right answer
        self.s = s

    def forward(self, x: torch.Tensor, bias_at: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) from contexts x (B, T, d) and the fixed biases: values `bias` at ids `bias_at`."""
        return (x @ self.W.T).scatter_add(-1, bias_at, bias)

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Responses (B, T) to `prompts` (B,), with their contexts and biases."""
        x, prev, out = torch.zeros(len(prompts), self.s.dim), prompts, collections.defaultdict(list)
        for t in range(self.s.length):
            x = torch.tanh(self.F[prev] + x @ self.A.T)
            x = x / x.norm(dim=-1, keepdim=True)  # (B, d)
            at = torch.stack([self.bigram[prev], self.target[prompts, min(t, self.s.decisions - 1)]], 1)  # (B, 2)
            gap = self.s.target_gap if t < self.s.decisions else math.inf  # (a target only where it decides)
            b = torch.stack([self.strength[prev], (self.strength[prev] - gap).clamp(min=0)], 1)  # (B, 2)
            gumbel = -torch.rand(len(prompts), self.s.vocab, generator=gen).log().neg().log()  # argmax samples
            prev = ((x @ self.W.T).scatter_add(-1, at, b) + gumbel).argmax(-1)  # (B,)
            for k, v in (("tokens", prev), ("x", x), ("bias_at", at), ("bias", b)):
                out[k].append(v)
        return {k: torch.stack(v, 1) for k, v in out.items()}


def toy_logprobs(net: ToyPolicy, batch: dict) -> torch.Tensor:
    return token_logprobs(net(batch["x"], batch["bias_at"], batch["bias"]), batch["tokens"])  # (B, T)


def toy_rollout(net: ToyPolicy, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Algorithm 1, lines 3-5: G samples per prompt, outcome rewards, group advantages, pi_old by a no-grad pass."""
    prompts = torch.arange(net.s.prompts).repeat_interleave(net.s.group)  # (B,)
    batch = net.sample(prompts, gen)
    rewards = (batch["tokens"][:, :net.s.decisions] == net.target[prompts]).all(1).float()  # (B,)
    batch.update(mask=torch.ones_like(batch["tokens"], dtype=torch.bool), rewards=rewards,
                 advantages=group_advantages(rewards, net.s.group))
    with torch.no_grad():
        batch["old_logprobs"] = toy_logprobs(net, batch)
    return batch


def toy_trajectory(s: ToySettings, method: str, seed: int, paired: tuple = ()) -> dict:
    """A trajectory of `method` on seed `seed`'s task: per step the reward, the update's counts, and the `paired`
    methods' paired_counts (with the own update's under `method`)."""
    net, gen, B = ToyPolicy(s, seed), torch.Generator().manual_seed(seed), s.prompts * s.group
    half = B // 2 if B % 2 == 0 else B
    base = Config(alpha=s.alpha, eta=s.eta, learning_rate=s.learning_rate, optimizer=s.optimizer, weight_decay=0.0,
                  beta=0.0, temperature=1.0, num_generations=s.group, prompts_per_step=s.prompts,
                  mini_batch_size=half, micro_batch_size=half)  # 2 optimiser steps a pass; no decay (the paper's
    cfg = method_config(base, method)  # analysis has none, and Lopti's extra steps would decay twice)
    opt, logprob_fn = make_optimizer(net, cfg), functools.partial(toy_logprobs, net)
    out = {"reward": [], "counts": [], "paired": []}
    for _ in range(s.steps):
        batch = toy_rollout(net, gen)
        measure = torch.no_grad()(functools.partial(toy_logprobs, net, batch))
        probes = paired_counts(base, net, opt, logprob_fn, batch, measure, batch["old_logprobs"], paired)
        update_policy(cfg, logprob_fn, opt, batch)
        out["reward"].append(float(batch["rewards"].mean()))
        out["counts"].append(update_counts(batch["old_logprobs"], measure(), batch["advantages"], batch["mask"]))
        out["paired"].append({method: out["counts"][-1], **probes})
    return out


def run_toy(s: ToySettings) -> dict:
    """Every part of the toy; a pure function of `s` (with torch's threads fixed)."""
    runs = {m: [toy_trajectory(s, m, s.seed + i, TOY_PAIRED if m == "grpo" else ()) for i in range(s.seeds)]
            for m in TOY_OWN_RUNS}
    units = [{m: pool_counts([p[m] for p in r["paired"]]) for m in r["paired"][0]} for r in runs["grpo"]]  # a seed
    own = {m: figure3_shares(pool_counts([c for r in rs for c in r["counts"]])) for m, rs in runs.items()}
    net = ToyPolicy(s, s.seed)
    batch = toy_rollout(net, torch.Generator().manual_seed(s.seed))
    figure1 = measure_bins(len(batch["mask"]), net, functools.partial(toy_logprobs, net), batch)
    reward = {m: [sum(r["reward"][t] for r in rs) / len(rs) for t in range(s.steps)] for m, rs in runs.items()}
    figure3 = {k: {m: v[k] for m, v in own.items()} for k in ("rose", "rose_of_moved", "ties")}
    return {"settings": asdict(s), "bins": BIN_NAMES, "figure1": figure1, "reward": reward,
            "figure3": {**figure3, "paired": paired_deltas(units)}}


def fmt_list(xs: list, spec: str = ".3f") -> str:
    return " / ".join("-" if x is None else format(x, spec) for x in xs)


def toy_main(args: argparse.Namespace) -> dict:
    """`python lopti.py toy`: run, print the checks, write results.json to --out."""
    given = {f.name: getattr(args, f.name) for f in fields(ToySettings) if getattr(args, f.name, None) is not None}
    s = ToySettings(**{**(TOY_QUICK if args.quick else {}), **given})
    out = args.out or Path("runs/toy" if given or args.quick else "toy")
    threads, t0 = torch.get_num_threads(), time.time()
    torch.set_num_threads(1)  # faster for these small matrices, and the same float sums on every machine
    try:
        r = run_toy(s)
    finally:
        torch.set_num_threads(threads)
    rose = r["figure3"]["rose"]["grpo"]
    gap = rose[0] - rose[3]
    r["checks"] = [f"[{'yes' if gap >= 0.05 else 'NO '}] GRPO's top bin rose at least 0.05 less often than its lowest:"
                   f" {fmt_list(rose)} (lowest - top {gap:+.3f})"]
    r["checks"] += [f"[own runs] {m} rose {fmt_list(v)}" for m, v in r["figure3"]["rose"].items()]
    for m, d in r["figure3"]["paired"].items():
        lo, hi = d["ci95"][3]
        verdict = ("raises" if lo > 0 else "lowers") if d["resolved"][3] else "does not resolve"
        r["checks"].append(f"[paired] {m} {verdict} the top bin's share vs GRPO: {d['delta'][3]:+.3f} [{lo:+.3f}, "
                           f"{hi:+.3f}], p {d['p'][3]:.3f}; every bin {fmt_list(d['delta'], '+.3f')}")
    print("\n".join(r["checks"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {out / 'results.json'} in {time.time() - t0:.1f} s")
    return r


# ====== Knights and Knaves: the paper's task (Logic-RL's data and reward) ======
# Data: the K&K benchmark (github.com/AlphaPav/mem-kk-logic) as Logic-RL ships it (the official code's
# data/kk/instruct/); reward: Logic-RL's verl/utils/reward_score/kk.py, as in AR-Lopti.

KK_MAX_REWARD = 3.0  # format +1 and answer +2: accuracy is the share of completions scoring this
KK_FORMAT_ERROR = -3.0  # format -1, and the answer is not read (-2)
THINK_PREFIX = "<think>"  # the assistant turn is pre-filled with it; the reward reads it as part of the text
KK_SYSTEM_PROMPT = (  # verbatim from Logic-RL's qwen-instruct prompt, odd spacing ("and<answer>") included
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the mind and "
    "then provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and<answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think><answer> answer here </answer>.  Now the user asks you to solve a logical reasoning problem. "
    "After thinking, when you finally reach a conclusion, clearly state the identity of each character "
    "within <answer> </answer> tags. i.e., <answer> (1) Zoey is a knight\n(2) ... </answer>.\n")
KK_NAMES = tuple((  # the benchmark's 51 names
    "Emma Liam Olivia Noah Ava Ethan Sophia Mason Isabella William Mia James Charlotte Benjamin Amelia "
    "Lucas Harper Henry Evelyn Alexander Abigail Michael Emily Daniel Elizabeth Jacob Sofia Logan Avery "
    "Jackson Ella Sebastian Scarlett Jack Grace Aiden Chloe Owen Victoria Samuel Riley Matthew Aria "
    "Joseph Lily Luke Aurora David Zoey Oliver Penelope"
).split())
_KK_SAYINGS = (  # the benchmark's 18 speech templates
    "{name} said that {content}.", "{name} told you that {content}.", '{name} said, "{content}."',
    '{name} stated, "{content}".', 'According to {name}, "{content}".', "In {name}'s words: \"{content}\".",
    '{name} remarked, "{content}".', '"{content}," {name} declared.', '{name} was heard saying, "{content}".',
    "{name} expressed that {content}.", '"{content}" - {name}.', 'As {name} put it, "{content}".',
    '{name} asserted: "{content}".', '"{content}," {name} mentioned.', '{name} commented, "{content}".',
    'In a statement by {name}: "{content}".', '{name} noted, "{content}".', '"{content}," {name} claimed.',
)


def _kk_true(statement: tuple, world: tuple[bool, ...]) -> bool:
    """Truth of a statement like ("and", ("lying", 0), ("telling-truth", 2)) in a world (True = knight)."""
    op, *args = statement
    if op in ("telling-truth", "lying"):
        return world[args[0]] == (op == "telling-truth")
    v = [_kk_true(a, world) for a in args]
    return {"not": lambda: not v[0], "and": lambda: all(v), "or": lambda: any(v), "->": lambda: not v[0] or v[1],
            "<=>": lambda: v[0] == v[1]}[op]()


def kk_solve(statements) -> list[list[bool]]:
    """Every consistent world (True = knight): person i is a knight iff statement i is true. Tries all 2^n in the
    benchmark's order. `statements`: the tuple, or its string (parsed as a literal, never run)."""
    statements = ast.literal_eval(statements) if isinstance(statements, str) else statements
    return [list(w) for w in itertools.product((True, False), repeat=len(statements))
            if all(_kk_true(s, w) == w[i] for i, s in enumerate(statements))]


def _kk_statement(rng: random.Random, n: int, speaker: int) -> tuple:
    """A statement by `speaker`, by the benchmark's grammar: a leaf, not, and, or, ->, <=> (1/6 each) over distinct
    leaves; never "I am a knave"."""
    def leaf():
        while (cand := (rng.choice(("telling-truth", "lying")), rng.randrange(n))) == ("lying", speaker):
            pass
        return cand
    kind = rng.randrange(6)
    if kind < 2:
        return leaf() if kind == 0 else ("not", leaf())
    first, second = leaf(), leaf()
    while second == first:
        second = leaf()
    return (("and", "or", "->", "<=>")[kind - 2], first, second)


def _kk_text(names: list[str], statement: tuple) -> str:
    """The benchmark's English for one statement."""
    def leaf(x, negate=False):
        return f"{names[x[1]]} is {'not ' if negate else ''}{'a knight' if x[0] == 'telling-truth' else 'a knave'}"
    op = statement[0]
    if op in ("telling-truth", "lying", "not"):
        return leaf(statement[1], negate=True) if op == "not" else leaf(statement)
    a, b = leaf(statement[1]), leaf(statement[2])
    return {"and": f"{a} and {b}", "or": f"{a} or {b}", "->": f"If {a} then {b}", "<=>": f"{a} if and only if {b}"}[op]


def _kk_solution_texts(names: list[str], solution: list[bool]) -> tuple[str, str]:
    """(solution_text, solution_text_format) as the official rows write them."""
    parts = [f"{name} is {'a knight' if knight else 'a knave'}" for name, knight in zip(names, solution)]
    return ", ".join(parts[:-1]) + ", and " + parts[-1] + ".", "\n".join(f"({i}) {p}" for i, p in enumerate(parts, 1))


def kk_generate(n: int, num_people: int | tuple[int, int] = (3, 7), seed: int = 0) -> datasets.Dataset:
    """`n` puzzles with exactly one solution, of num_people (an int, or (lo, hi) drawn per puzzle) within 2..8; no
    statements repeat, as in the benchmark. Rows in its schema: quiz, names, solution (True = knight),
    solution_text, solution_text_format (the reward's truth), statements (the tuple's repr), num_people."""
    lo, hi = (num_people, num_people) if isinstance(num_people, int) else num_people
    assert 2 <= lo <= hi <= 8, f"num_people must lie within 2..8, got {num_people}"
    rng, seen, rows = random.Random(seed), set(), []
    for _ in range(n):
        k = rng.randint(lo, hi)
        for _try in range(10_000):  # (2-person puzzles run out after a few hundred)
            statements = tuple(_kk_statement(rng, k, i) for i in range(k))
            if statements not in seen and len(solutions := kk_solve(statements)) == 1:
                break
        else:
            raise ValueError(f"only {len(rows)} distinct {k}-person puzzles found: ask for fewer")
        seen.add(statements)
        names = rng.sample(KK_NAMES, k)
        said = " ".join(rng.choice(_KK_SAYINGS).format(name=names[i], content=_kk_text(names, s))
                        for i, s in enumerate(statements))
        people = f"You meet {k} inhabitants: {', '.join(names[:-1])}, and {names[-1]}."
        quiz = ("A very special island is inhabited only by knights and knaves. Knights always tell the truth, and "
                f"knaves always lie. {people} {said} So who is a knight and who is a knave?")
        text, text_format = _kk_solution_texts(names, solutions[0])
        rows.append({"quiz": quiz, "names": names, "solution": solutions[0], "solution_text": text,
                     "solution_text_format": text_format, "statements": repr(statements), "num_people": k})
    return datasets.Dataset.from_list(rows)


def kk_parse_solution(solution_text_format: str) -> dict[str, str]:
    """{name: "knight" | "knave"} from "(1) Amelia is a knight\\n(2) ...", by Logic-RL's regex, line by line."""
    roles = {}
    for line in solution_text_format.split("\n"):
        if m := re.search(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", line, re.IGNORECASE):
            roles[m.group(1)] = m.group(2).lower()
    return roles


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _kk_row(row: dict) -> dict:
    """A loaded row in kk_generate's schema, checked: its statements must have exactly its solution."""
    truth = (row.get("reward_model") or {}).get("ground_truth") or {}  # Logic-RL's rows keep them here
    text_format, statements = (row.get(k) or truth.get(k) for k in ("solution_text_format", "statements"))
    if not isinstance(statements, str):  # JSON has lists; the official form is the tuple's repr
        as_tuple = lambda x: tuple(map(as_tuple, x)) if isinstance(x, list) else x  # noqa: E731
        statements = repr(as_tuple(statements))
    roles = kk_parse_solution(text_format)
    names, solution = list(roles), [role == "knight" for role in roles.values()]
    if not row["quiz"] or len(names) < 2 or kk_solve(statements) != [solution]:
        raise ValueError(f"no quiz or people, or its statements do not have the unique solution {text_format!r}")
    return {"quiz": row["quiz"], "names": names, "solution": solution, "statements": statements,
            "solution_text": row.get("solution_text") or _kk_solution_texts(names, solution)[0],
            "solution_text_format": text_format, "num_people": len(names)}


def kk_load(source: str) -> datasets.Dataset:
    """K&K puzzles, row by row checked, from a .parquet/.jsonl/.json file in the benchmark's or Logic-RL's format,
    or a hub dataset "OWNER/NAME[:[CONFIG/]SPLIT]" (e.g. "K-and-K/knights-and-knaves:test/3ppl"). A file or row
    that cannot be read raises one ValueError naming it."""
    suffix = Path(source).suffix.lower()
    if Path(source).exists() and suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"{source!r} is not a .parquet, .jsonl or .json file")
    try:
        if suffix in (".parquet", ".jsonl", ".json"):
            builder = "parquet" if suffix == ".parquet" else "json"
            ds = datasets.load_dataset(builder, data_files=str(Path(source).expanduser()), split="train")
        else:
            name, _, selection = source.partition(":")
            config, _, split = selection.rpartition("/")
            ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # (no file, bad JSON or parquet, no network: datasets' errors name little)
        raise ValueError(f"cannot read K&K puzzles from {source!r} ({_first_line(e)})") from e
    rows = []
    for i, row in enumerate(ds):
        try:
            rows.append(_kk_row(row))
        except Exception as e:
            raise ValueError(f"{source!r} row {i} is not a K&K puzzle ({_first_line(e)})") from e
    if not rows:
        raise ValueError(f"{source!r} has no rows")
    return datasets.Dataset.from_list(rows)


def kk_prompt(tokenizer, quiz: str) -> str:
    """The chat template over [system prompt, quiz + "\\n"], then THINK_PREFIX: Logic-RL's prompt byte for byte."""
    messages = [{"role": "system", "content": KK_SYSTEM_PROMPT}, {"role": "user", "content": quiz + "\n"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + THINK_PREFIX


def kk_reward(completion: str, solution_text_format: str) -> float:
    """Logic-RL's reward of a completion (with THINK_PREFIX), on its text after the first "Assistant:". Format: +1 if
    each tag occurs once and in order, else -1 and -2 for the answer. Answer: -2 unless the knight/knave words number
    the people and each name matches "NAME is a knight|knave" (first match); else +2 if all are right, -1.5 if not.
    Totals: 3 correct, -0.5 wrong, -1 unreadable, -3 format error."""
    text, truth = completion.split("Assistant:", 1)[-1], kk_parse_solution(solution_text_format)
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    at = [text.find(tag) for tag in tags]
    if any(text.count(tag) != 1 for tag in tags) or at != sorted(at):
        return KK_FORMAT_ERROR
    answer = text[at[2] + len("<answer>"):at[3]]
    found = {name: re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
             for name in truth}
    if answer.lower().count("knight") + answer.lower().count("knave") != len(truth) or None in found.values():
        return -1.0
    return KK_MAX_REWARD if {k: m.group(1).lower() for k, m in found.items()} == truth else -0.5


def kk_rewards(completions: list[str], solutions: list[str]) -> torch.Tensor:
    """Logic-RL's rewards (B,) of completions as generated after THINK_PREFIX."""
    return torch.tensor([kk_reward(THINK_PREFIX + c, s) for c, s in zip(completions, solutions)])


def kk_case_analysis(row: dict) -> str:
    """The solver's own case analysis of a puzzle as a completion after THINK_PREFIX, e.g. " Emma knight, Liam
    knight: Emma lies. ... Emma knave, Liam knight: all fit. </think><answer> (1) Emma is a knave ... </answer>".
    The supervised warm-up's target (Config.warmup_steps)."""
    statements, names, cases = ast.literal_eval(row["statements"]), row["names"], []
    for world in itertools.product((True, False), repeat=len(names)):
        bad = next((i for i, s in enumerate(statements) if _kk_true(s, world) != world[i]), None)
        verdict = "all fit" if bad is None else f"{names[bad]} {'lies' if world[bad] else 'tells the truth'}"
        cases.append(", ".join(f"{n} {'knight' if k else 'knave'}" for n, k in zip(names, world)) + f": {verdict}.")
    return f" {' '.join(cases)} </think><answer> {row['solution_text_format']} </answer>"


def constant_accuracy(rows) -> float:
    """The accuracy of the best constant answer (per size, the roles by position right most often, e.g. "(1) knave
    (2) knave"): a model's accuracy means something above it."""
    best: dict[int, int] = {}
    for solution, count in collections.Counter(tuple(s) for s in rows["solution"]).items():
        best[len(solution)] = max(best.get(len(solution), 0), count)
    return sum(best.values()) / max(len(rows), 1)


def _kk_relabel(statement: tuple, order: tuple[int, ...]) -> tuple:
    """The statement with person i renamed order[i], the operands of and, or and <=> sorted."""
    op, *args = statement
    if op in ("telling-truth", "lying"):
        return (op, order[args[0]])
    operands = [_kk_relabel(a, order) for a in args]
    if op in ("and", "or", "<=>"):
        operands = sorted(operands)
    return (op, *operands)


def _kk_outline(statements: tuple) -> tuple:
    """What a renaming of the people keeps: each statement with its speaker as 0 and everyone else as 1, sorted."""
    outlines = [_kk_relabel(s, [0 if person == i else 1 for person in range(len(statements))])
                for i, s in enumerate(statements)]
    return tuple(sorted(outlines))


def kk_twins(rows, others) -> list[bool]:
    """For each puzzle of `rows`, whether `others` holds a logical twin: the same statements up to names (some
    renaming of the people makes them equal, the operands of and, or, <=> in any order). 2-person puzzles have
    only 95 such classes: a model can learn them by heart."""
    by_outline = collections.defaultdict(set)
    for text in others["statements"]:
        statements = ast.literal_eval(text)
        by_outline[_kk_outline(statements)].add(tuple(_kk_relabel(s, range(len(statements))) for s in statements))
    twins = []
    for text in rows["statements"]:
        statements = ast.literal_eval(text)
        candidates = by_outline[_kk_outline(statements)]
        found = False
        for order in itertools.permutations(range(len(statements))) if candidates else ():
            renamed = [None] * len(statements)
            for speaker, statement in enumerate(statements):
                renamed[order[speaker]] = _kk_relabel(statement, order)
            found = tuple(renamed) in candidates
            if found:
                break
        twins.append(found)
    return twins


def warmup_puzzles(cfg: Config) -> datasets.Dataset:
    """The warm-up's puzzles, from a seed of their own: not the RL steps' or the evaluation's."""
    lo, hi = people_range(cfg.num_people)
    return kk_generate(cfg.warmup_steps * cfg.prompts_per_step, (lo, hi), seed=cfg.seed + 2_000_003)


def load_task_data(cfg: Config):
    """Training and evaluation rows; no evaluation puzzle is a training one. The evaluation rows' column `twin`
    says which have a logical twin among the training and warm-up puzzles (kk_twins)."""
    lo, hi = people_range(cfg.num_people)
    train = kk_generate(cfg.num_train, (lo, hi), cfg.seed) if cfg.train_data == "generate" else kk_load(cfg.train_data)
    evals = (datasets.concatenate_datasets([kk_generate(cfg.eval_size, n, seed=cfg.seed + 1_000_003 + n)
                                            for n in range(lo, hi + 1)])
             if cfg.eval_data == "generate" else kk_load(cfg.eval_data))
    seen = set(train["quiz"])
    evals = evals.filter(lambda row: row["quiz"] not in seen)
    if len(evals) == 0:
        raise ValueError("every evaluation puzzle is also a training puzzle: use other --eval_data")
    seen_statements = {"statements": list(train["statements"])}
    if cfg.warmup_steps:
        seen_statements["statements"] += list(warmup_puzzles(cfg)["statements"])
    evals = evals.add_column("twin", kk_twins(evals, seen_statements))
    return train, evals


# ====== The LLM run: rollout -> reward -> group advantage -> pi_old -> update -> Figure 3, on K&K ======
# Model I/O and log-probs; then train_step, one RL step (Algorithm 1), and train(), the loop around it.


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu")


def has_bf16(device: torch.device) -> bool:
    """A GPU with native bf16 (a T4 has none: fp32). LOPTI_CPU_BF16=1: the bf16 path on CPU, for tests."""
    if device.type == "cpu":
        return os.environ.get("LOPTI_CPU_BF16") == "1"
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def autocast(device: torch.device, enabled: bool = True):
    """bf16 autocast where the GPU has it; weights and AdamW's state stay fp32 (an lr 1e-6 step is below bf16's)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and has_bf16(device))


def load_model(name: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A causal LM with SDPA attention and dropout off (it would make the first ratio != 1)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa")
    scaled = {k: v for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")  # Gemma 3, Cohere, Granite
              if (v := getattr(model.config.get_text_config(), k, None)) not in (None, 1)}
    if scaled:  # sequence_logprobs applies the output layer alone
        raise ValueError(f"{name} rescales its logits after the output layer ({scaled}): not supported")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model.to(device)


def load_tokenizer(name: str):
    """Left-padding (for generate), with a pad token."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(name)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # masks come from positions: pad == EOS is safe
    return tokenizer


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response (Qwen has two)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(ids + [tokenizer.eos_token_id]) - {None})


def completion_mask(completions: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens, from positions: up to and including the first EOS; and (B,) truncated (no EOS). From
    values (tokens != pad) the EOS is lost when pad == EOS, and the model never learns to stop.
    Example, EOS = 2 = pad: [[5, 7, 2, 2, 2], [5, 2, 9, 2, 2], [5, 7, 8, 9, 6]]
        -> mask [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], truncated [F, F, T]"""
    is_eos = torch.isin(completions, torch.tensor(eos_ids, device=completions.device)).long()  # (B, C)
    return is_eos.cumsum(1) - is_eos == 0, is_eos.sum(1) == 0  # no EOS strictly before a position


def prefix_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Prefix sharing: a group's G rows share a prompt, so its forward (and backward) runs once per distinct prompt
    and the KV cache is indexed back to every row, differentiably. Returns it and the last hidden state (B, 1, H)."""
    L = input_ids.shape[1]
    rows, inverse = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)  # (U, 2L)
    out = model.base_model(input_ids=rows[:, :L], attention_mask=rows[:, L:], use_cache=True,
                           position_ids=(rows[:, L:].long().cumsum(-1) - 1).clamp_min(0))
    out.cache.batch_select_indices(inverse)
    return out.cache, out.last_hidden_state[inverse, -1:]


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion: int,
                      temperature: float) -> torch.Tensor:
    """log pi(o_t) at temperature T of the last `num_completion` tokens of left-padded rows (B, C). Position ids from
    the attention mask, as generate() made them: a padded row scores as it would alone. The decoder runs once (a
    shared prompt once per group), the output layer in chunks."""
    C, head = num_completion, model.get_output_embeddings()
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L)
    targets = input_ids[:, -C:]  # (B, C)
    shared = len(torch.unique(input_ids[:, :-C], dim=0)) < len(input_ids) and C > 1
    if not shared or (model.is_activation_checkpointing and model.training):  # (HF drops a cache when checkpointing)
        hidden = model.base_model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                                  position_ids=position_ids[:, :-1], use_cache=False).last_hidden_state[:, -C:]
    else:
        cache, first = prefix_cache(model, input_ids[:, :-C], attention_mask[:, :-C])  # first: predicts o_1
        rest = model.base_model(input_ids=targets[:, :-1], attention_mask=attention_mask[:, :-1],
                                position_ids=position_ids[:, -C:-1], cache=cache).last_hidden_state
        hidden = torch.cat([first, rest], 1)  # (B, C, H): position t predicts o_{t+1}
    return token_logprobs(hidden, targets, temperature, head=head)  # (B, C)


def cut_at(tokenizer, completions: torch.Tensor, mask: torch.Tensor, stop: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `mask` ended at the token that completes the text `stop`; and (B,) stopped."""
    mask, stopped = mask.clone(), torch.zeros(len(mask), dtype=torch.bool, device=mask.device)
    for i, row in enumerate(completions.tolist()):
        pieces = tokenizer.batch_decode([[t] for t in row[:int(mask[i].sum())]])
        at = "".join(pieces).find(stop)
        if at >= 0:
            ends = torch.tensor([len(p) for p in pieces]).cumsum(0)  # the text's length after each token
            mask[i, int((ends < at + len(stop)).sum()) + 1:] = False
            stopped[i] = True
    return mask, stopped


@torch.no_grad()
def rollout(model, tokenizer, prompts: list[str], cfg: Config, device: torch.device, greedy: bool = False) -> dict:
    """A completion per prompt from pi_old = softmax(z / T): no top-k, top-p or repetition penalty, as pi_old must
    be what the tokens were drawn from. Returns `input_ids`, `attention_mask` (B, P + C), the completion `mask`
    (B, C), `truncated` (B,) and `texts`."""
    from transformers import GenerationConfig
    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    eos_ids = eos_token_ids(model, tokenizer)
    # Qwen's generation config has top_p 0.8, top_k 20, repetition_penalty 1.05, and generate() fills a field left
    # at its default from it: the model's config is swapped for this one while generating.
    gen_cfg = GenerationConfig(do_sample=not greedy, repetition_penalty=1.0, max_new_tokens=cfg.max_completion_length,
                               eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                               **({} if greedy else dict(temperature=cfg.temperature, top_k=0, top_p=1.0)))
    saved, model.generation_config, parts = model.generation_config, gen_cfg, []
    try:
        for i in range(0, len(prompts), cfg.generation_batch_size or len(prompts)):  # chunks bound the KV cache
            ids = enc["input_ids"][i:i + (cfg.generation_batch_size or len(prompts))]  # (b, P)
            att = enc["attention_mask"][i:i + len(ids)]
            shared = len(torch.unique(ids, dim=0)) < len(ids)
            with autocast(device):  # a group's prompt runs once (prefix_cache), not G times
                cache = prefix_cache(model, ids[:, :-1], att[:, :-1])[0] if shared else None
                parts.append(model.generate(input_ids=ids, attention_mask=att, generation_config=gen_cfg,
                                            cache=cache)[:, ids.shape[1]:])  # (b, C_i)
    finally:
        model.generation_config = saved
    C = max(p.shape[1] for p in parts)
    completions = torch.cat([torch.nn.functional.pad(p, (0, C - p.shape[1]), value=tokenizer.pad_token_id)
                             for p in parts])  # (B, C)
    mask, truncated = completion_mask(completions, eos_ids)  # (B, C), (B,)
    if cfg.stop_at_answer:
        mask, stopped = cut_at(tokenizer, completions, mask, "</answer>")
        truncated &= ~stopped
    return {"input_ids": torch.cat([enc["input_ids"], completions], 1), "mask": mask, "truncated": truncated,
            "attention_mask": torch.cat([enc["attention_mask"], torch.ones_like(completions)], 1),
            "texts": tokenizer.batch_decode(torch.where(mask, completions, tokenizer.pad_token_id),
                                            skip_special_tokens=True)}


def completion_logprobs(model, micro: dict, temperature: float) -> torch.Tensor:
    """sequence_logprobs (b, C) of a micro-batch, run only up to its longest completion (exact: attention is
    causal); later columns are 0."""
    C, cols = micro["mask"].shape[1], micro["mask"].any(0).nonzero()
    c = int(cols[-1]) + 1 if len(cols) else 1
    end = micro["input_ids"].shape[1] - C + c
    lp = sequence_logprobs(model, micro["input_ids"][:, :end], micro["attention_mask"][:, :end], c, temperature)
    return torch.nn.functional.pad(lp, (0, C - c))  # (b, C)


@torch.no_grad()
def batched_logprobs(model, batch: dict, cfg: Config, device: torch.device, rows: torch.Tensor | None = None,
                     fp32: bool = False) -> torch.Tensor:
    """No-grad log-probs (B, C): pi_old's, the reference's or Figure 3's pass; only `rows` if given (else 0)."""
    model.eval()
    out = torch.zeros(batch["mask"].shape, device=batch["mask"].device)  # (B, C)
    index = torch.arange(len(out)) if rows is None else rows.nonzero().squeeze(1).cpu()
    for micro in index.split(cfg.micro_batch_size) if len(index) else ():
        with autocast(device, not fp32):
            sub = {k: batch[k][micro] for k in ("input_ids", "attention_mask", "mask")}
            out[micro] = completion_logprobs(model, sub, cfg.temperature)
    return out


def evaluate(model, tokenizer, rows, cfg: Config, device: torch.device) -> dict[str, float]:
    """Greedy accuracy (share of reward 3) and mean reward per size, and the best constant answer's accuracy."""
    rewards, sizes = [], []
    for i in range(0, len(rows), cfg.eval_batch_size):
        chunk = rows[i:i + cfg.eval_batch_size]
        prompts = [kk_prompt(tokenizer, quiz) for quiz in chunk["quiz"]]
        texts = rollout(model, tokenizer, prompts, cfg, device, greedy=True)["texts"]
        rewards += kk_rewards(texts, chunk["solution_text_format"]).tolist()
        sizes += chunk["num_people"]
    correct = [r == KK_MAX_REWARD for r in rewards]
    out = {"eval/accuracy": sum(correct) / len(correct), "eval/constant_accuracy": constant_accuracy(rows),
           "eval/correct": "".join("1" if c else "0" for c in correct)}
    if "twin" in rows.column_names:
        no_twin = [c for c, twin in zip(correct, rows["twin"]) if not twin]
        out["eval/twins"] = len(correct) - len(no_twin)
        out["eval/accuracy_no_twin"] = sum(no_twin) / len(no_twin) if no_twin else None
    for n in sorted(set(sizes)):
        r = [x for x, k in zip(rewards, sizes) if k == n]
        out.update({f"eval/accuracy_{n}ppl": r.count(KK_MAX_REWARD) / len(r), f"eval/reward_{n}ppl": sum(r) / len(r)})
    return out


def sign_test_p(gained: int, lost: int) -> float:
    """McNemar's exact test: the two-sided p of `gained` against `lost` among the puzzles whose outcome changed,
    if each change were a fair coin. Example: 9 gained, 1 lost -> 2 * (1 + 10) / 2**10 = 0.021."""
    changed = gained + lost
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed
    return min(1.0, 2 * tail)


def paired_gain(before: str, after: str) -> dict[str, float]:
    """RL's gain on the same puzzles, from two evaluations' eval/correct ("0110..."): the accuracy difference, the
    puzzles gained and lost, and McNemar's exact p."""
    assert len(before) == len(after), "two evaluations of the same puzzles"
    gained = sum(b == "0" and a == "1" for b, a in zip(before, after))
    lost = sum(b == "1" and a == "0" for b, a in zip(before, after))
    return {"eval/gain": (gained - lost) / len(before), "eval/gained": gained, "eval/lost": lost,
            "eval/gain_p": sign_test_p(gained, lost)}


def train_step(cfg: Config, model, ref_model, tokenizer, optimizer, rows, device: torch.device,
               probe: Callable | None = None) -> dict:
    """One RL step (Algorithm 1) on K&K rows: its metrics, and the first prompt's G completions ("samples").
    `probe(batch, logprob_fn, measure, before)` runs before the update (diagnose); no optimizer, no update."""
    G, t0 = cfg.num_generations, time.perf_counter()
    batch = rollout(model, tokenizer, [kk_prompt(tokenizer, q) for q in rows["quiz"] for _ in range(G)], cfg, device)
    t1 = time.perf_counter()
    solutions = [s for s in rows["solution_text_format"] for _ in range(G)]
    rewards = kk_rewards(batch["texts"], solutions)  # (B,)
    batch["advantages"] = group_advantages(rewards, G).to(device)  # (B,)
    needed = rows_with_gradient(batch["advantages"], cfg.beta)  # (B,): the others need no pass at all
    batch["old_logprobs"] = batched_logprobs(model, batch, cfg, device, needed)  # (B, C), fixed for the step
    if ref_model is not None:
        batch["ref_logprobs"] = batched_logprobs(ref_model, batch, cfg, device, needed)
    # Figure 3: pi before and after the update by one pass (an unmoved token compares equal): pi_old's, or under
    # bf16 an fp32 pass, as bf16's rounding (0.4 %) exceeds what an update at lr 1e-6 moves a token.
    measure = functools.partial(batched_logprobs, model, batch, cfg, device, needed, has_bf16(device))
    t2 = time.perf_counter()
    before = measure() if has_bf16(device) and cfg.measure_update else batch["old_logprobs"]
    if device.type == "cuda":  # CUDA is asynchronous: wait, or the passes' time lands in the update's
        torch.cuda.synchronize(device)
    t3 = time.perf_counter()

    def logprob_fn(micro: dict) -> torch.Tensor:
        with autocast(device):
            return completion_logprobs(model, micro, cfg.temperature)

    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "truncated"}
    model.train()  # for gradient checkpointing; dropout is off (load_model)
    metrics = probe(tensors, logprob_fn, measure, before) if probe else {}
    if optimizer is not None:
        metrics.update(update_policy(cfg, logprob_fn, optimizer, tensors))
        if cfg.measure_update:
            t4 = time.perf_counter()
            metrics.update(update_counts(before, measure(), batch["advantages"], batch["mask"], batch["old_logprobs"]))
            metrics["time/measure"] = time.perf_counter() - t4 + t3 - t2
    grouped = rewards.view(-1, G)  # (P, G)
    return {"reward": rewards.mean().item(), "accuracy": (rewards == KK_MAX_REWARD).float().mean().item(),
            "format_error": (rewards == KK_FORMAT_ERROR).float().mean().item(),
            "zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean().item(),
            "completion_length": batch["mask"].sum(1).float().mean().item(),
            "truncated": batch["truncated"].float().mean().item(), **metrics, "time/rollout": t1 - t0,
            "time/logprobs": t2 - t1,
            "samples": [{"reward": r, "completion": THINK_PREFIX + t}
                        for r, t in zip(rewards[:G].tolist(), batch["texts"])]}


def warm_up(cfg: Config, model, tokenizer, device: torch.device) -> None:
    """The supervised warm-up (ours, for small models: the paper's 3B model needs none, and pure RL on K&K stalls
    below ~1.5B): cfg.warmup_steps optimiser steps of cross-entropy on kk_case_analysis + EOS, prompts_per_step
    puzzles each, generated from a seed of their own: not the RL steps' or the evaluation's puzzles."""
    rows = warmup_puzzles(cfg)
    # supervised learning: AdamW whatever cfg.optimizer says (SGD at this learning rate would warm nothing up)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_learning_rate, weight_decay=cfg.weight_decay)
    model.train()
    for step in tqdm(range(cfg.warmup_steps), desc="warm-up"):
        pairs = [(tokenizer(kk_prompt(tokenizer, r["quiz"]), add_special_tokens=False).input_ids,
                  tokenizer(kk_case_analysis(r) + tokenizer.eos_token, add_special_tokens=False).input_ids)
                 for r in rows.select(range(step * cfg.prompts_per_step, (step + 1) * cfg.prompts_per_step))]
        L, C = max(len(p + t) for p, t in pairs), max(len(t) for _, t in pairs)
        ids = torch.tensor([[tokenizer.pad_token_id] * (L - len(p + t)) + p + t for p, t in pairs], device=device)
        attention = torch.tensor([[0] * (L - len(p + t)) + [1] * len(p + t) for p, t in pairs], device=device)
        mask = torch.tensor([[0] * (C - len(t)) + [1] * len(t) for _, t in pairs], device=device)  # (B, C) targets
        with autocast(device):
            logp = sequence_logprobs(model, ids, attention, C, 1.0)  # (B, C)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def load_policy(cfg: Config, device: torch.device, start: Path | None = None):
    """The policy from `start` (a checkpoint) or cfg.model, warmed up unless it is a run's checkpoint; its tokenizer;
    the frozen reference model, cfg.model before any warm-up (None when beta = 0)."""
    model, tokenizer = load_model(str(start or cfg.model), device), load_tokenizer(str(start or cfg.model))
    ref_model = None if cfg.beta == 0 else load_model(cfg.model, device, torch.bfloat16 if has_bf16(device) else
                                                      torch.float32).eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if cfg.warmup_steps and not (Path(start or cfg.model) / "trainer_state.pt").exists():
        warm_up(cfg, model, tokenizer, device)
    return model, tokenizer, ref_model


def step_rows(num_rows: int, cfg: Config, step: int) -> list[int]:
    """The rows of step `step` (0-based): slices of per-epoch shuffles of (seed, epoch), so --resume replays them."""
    order = lambda e: torch.randperm(num_rows, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + e))  # noqa
    return [int(order(i // num_rows)[i % num_rows]) for i in range(step * cfg.prompts_per_step,
                                                                   (step + 1) * cfg.prompts_per_step)]


def read_jsonl(path: Path) -> list[dict]:
    """A .jsonl file's records; a line torn by a crash is skipped."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def checkpoints(out: Path) -> list[Path]:
    """A run's complete checkpoints, oldest first."""
    return sorted((p for p in out.glob("checkpoint-*") if p.name[11:].isdigit()), key=lambda p: int(p.name[11:]))


def save_checkpoint(out: Path, model, tokenizer, optimizer, step: int) -> Path:
    """out/checkpoint-STEP/ (a folder --model loads, with trainer_state.pt), written as .tmp and renamed, then the
    older ones removed: a crash at any moment leaves a complete latest checkpoint."""
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
               tmp / "trainer_state.pt")
    tmp.rename(final)
    for old in checkpoints(out)[:-1]:
        shutil.rmtree(old)
    return final


# What --resume may change: schedule, evaluation, memory settings (the same steps up to float rounding), the
# folder's place, and the learning rate (to continue a run that diverged).
RESUME_MAY_CHANGE = ("steps", "eval_every", "save_every", "eval_data", "eval_size", "eval_batch_size",
                     "micro_batch_size", "generation_batch_size", "gradient_checkpointing", "measure_update",
                     "learning_rate", "output_dir")


def train(cfg: Config, resume: bool = False) -> Path:
    """GRPO (+AR, +Lopti) on K&K: config.json, metrics.jsonl (a line per step and per evaluation), samples.jsonl and
    checkpoint-STEP/ in cfg.output_dir. Ctrl-C or SIGTERM finishes the step, saves it and exits 130 or 143; a second
    signal aborts at once, keeping the last checkpoint."""
    out = Path(cfg.output_dir)
    if resume:  # (resolve_config has read config.json: a run's)
        saved = json.loads((out / "config.json").read_text())
        changed = [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in saved.items()
                   if k not in RESUME_MAY_CHANGE and v != asdict(cfg).get(k)]
        if changed:
            raise ValueError(f"--resume may not change {', '.join(changed)}: start a new --output_dir")
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"--output_dir {out} is not empty: --resume continues a run there; else choose a new folder")
    device = pick_device()
    torch.manual_seed(cfg.seed)
    train_rows, eval_rows = load_task_data(cfg)  # a bad data file fails here, before anything is written
    ckpt, state = checkpoints(out)[-1] if resume and checkpoints(out) else None, {"step": 0}
    if ckpt:
        try:  # tensors and plain data only: a pickle that would run code is refused
            state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{ckpt}/trainer_state.pt cannot be loaded safely ({_first_line(e)})") from None
    model, tokenizer, ref_model = load_policy(cfg, device, ckpt)
    optimizer, start = make_optimizer(model, cfg), state["step"]
    if ckpt:
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:  # --resume may lower it
            group["lr"] = cfg.learning_rate
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "samples.jsonl"):  # the lines past the checkpoint are redone: every step once
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(out / name) if r["step"] <= start))
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))

    def log(name: str, record: dict) -> None:
        with open(out / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def evaluation(step: int) -> None:
        record = evaluate(model, tokenizer, eval_rows, cfg, device)
        if step > 0:  # RL's gain over step 0 (after the warm-up), puzzle by puzzle
            step_0 = next(r for r in read_jsonl(out / "metrics.jsonl") if r["step"] == 0)
            record.update(paired_gain(step_0["eval/correct"], record["eval/correct"]))
        log("metrics.jsonl", {"step": step, **record})

    due = lambda s: bool(cfg.eval_every and s % cfg.eval_every == 0) or s in (0, cfg.steps)  # noqa: E731
    stop = {}

    def on_signal(signum, frame):
        if stop:
            raise KeyboardInterrupt  # a second signal: abort now, the last checkpoint stays
        stop["signum"] = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving (again: abort)", flush=True)

    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if due(start) and not any("eval/accuracy" in r and r["step"] == start for r in read_jsonl(
                out / "metrics.jsonl")):
            evaluation(start)  # step 0, or the run stopped after saving this step, before evaluating it
        if stop:  # a signal during that evaluation
            save_checkpoint(out, model, tokenizer, optimizer, start)
            print(f"lopti.py train: stopped after step {start}, saved; continue with --resume", file=sys.stderr)
            raise SystemExit(128 + stop["signum"])
        for step in tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc="train"):
            rows = train_rows[step_rows(len(train_rows), cfg, step - 1)]
            metrics = train_step(cfg, model, ref_model, tokenizer, optimizer, rows, device)
            if not all(p.isfinite().all() for p in model.parameters()):  # never saved, never trained on
                raise ValueError(f"step {step} diverged (non-finite weights) and was not saved: continue from the "
                                 "last checkpoint with --resume --learning_rate LOWER")
            log("samples.jsonl", {"step": step, "quiz": rows["quiz"][0], "samples": metrics.pop("samples")})
            log("metrics.jsonl", {"step": step, "learning_rate": cfg.learning_rate, **metrics})
            saved = bool(cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or bool(stop)
            if saved:
                save_checkpoint(out, model, tokenizer, optimizer, step)
            if due(step) and not stop:
                evaluation(step)
            if stop:  # (a signal during the evaluation: the step is saved now)
                if not saved:
                    save_checkpoint(out, model, tokenizer, optimizer, step)
                print(f"lopti.py train: stopped after step {step}, saved; continue with --resume", file=sys.stderr)
                raise SystemExit(128 + stop["signum"])
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return checkpoints(out)[-1]


# --- diagnose: Figure 1, and Figure 3 paired; fig3: Figure 3 of runs; plot: learning curves


def diagnose(cfg: Config, steps: int, out: Path) -> dict:
    """Figure 1 (measure_bins) on cfg.model's first batch; with `steps`, Figure 3 paired along a trajectory of cfg's
    method (fresh optimiser): each step applies the others of GRPO, AR, Lopti, AR+Lopti (paired_counts), then its
    own update. Writes the JSON `out`; the model's folder is only read."""
    cfg = dataclasses.replace(cfg, measure_update=True)
    device, own = pick_device(), method_name(asdict(cfg))
    torch.manual_seed(cfg.seed)
    train_rows = load_task_data(cfg)[0]
    model, tokenizer, ref_model = load_policy(cfg, device)
    optimizer, units = make_optimizer(model, cfg), []
    result = {"model": cfg.model, "bins": BIN_NAMES, "paper": PAPER_FIGURES}
    others = [m for m in ("grpo", "ar", "lopti", "ar_lopti") if m != own]

    def probe(batch: dict, logprob_fn: Callable, measure: Callable, before: torch.Tensor) -> dict:
        if "figure1" not in result:  # in fp32 (no autocast), as its gradients are summed in fp64
            fp32_logprobs = functools.partial(completion_logprobs, model, temperature=cfg.temperature)
            result["figure1"] = measure_bins(cfg.micro_batch_size, model, fp32_logprobs, batch)
        if steps:
            units.append(paired_counts(cfg, model, optimizer, logprob_fn, batch, measure, before, others))
        return {}

    for step in range(max(steps, 1)):
        t0, rows = time.perf_counter(), train_rows[step_rows(len(train_rows), cfg, step)]
        metrics = train_step(cfg, model, ref_model, tokenizer, optimizer if steps else None, rows, device, probe)
        print(f"step {step + 1}: reward {metrics['reward']:.2f}, {time.perf_counter() - t0:.0f} s", flush=True)
        if steps:  # the JSON is rewritten after every step: a stopped run keeps its steps
            units[-1][own] = {k: v for k, v in metrics.items() if k.startswith("update/")}
            pooled = {m: pool_counts([u[m] for u in units]) for m in ("grpo", "ar", "lopti", "ar_lopti")}
            result["figure3_paired"] = {"steps": len(units), "delta_vs_grpo": paired_deltas(units), "per_step": units,
                                        "methods": {m: {k[7:]: v for k, v in c.items()} for m, c in pooled.items()}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    for m, c in pooled.items() if steps else ():
        d = result["figure3_paired"]["delta_vs_grpo"].get(m)
        print(f"{m}: rose {fmt_list(figure3_shares(c)['rose'])}, ties {fmt_list(figure3_shares(c)['ties'])}"
              + (f", minus GRPO's {fmt_list(d['delta'], '+.3f')}" if d else ""))
    return result


def figure_3(runs: list[Path]) -> dict:
    """Figure 3 of runs' own updates, summed per method. Unpaired: a difference between methods mixes in
    their trajectories (diagnose --steps pairs them)."""
    steps: dict[str, list] = {}
    for run in runs:
        cfg = json.loads((run / "config.json").read_text())
        label = method_name(cfg) + (", sgd" if cfg["optimizer"] == "sgd" else "")
        steps.setdefault(label, []).extend(r for r in read_jsonl(run / "metrics.jsonl") if "update/pos_tokens" in r)
    table = {m: {**figure3_shares(pool_counts(s)), "steps": len(s)} for m, s in steps.items()}
    for m, t in [*table.items(), *((f"paper, {m}", {"rose": v}) for m, v in PAPER_FIGURES["pos_rose"].items())]:
        more = f"; of the moved {fmt_list(t['rose_of_moved'])}; ties {fmt_list(t['ties'])}" if "ties" in t else ""
        print(f"{m}: rose {fmt_list(t['rose'])}{more}")
    return table


def plot_runs(runs: list[Path], out: Path) -> None:
    """Reward, format errors, zero-spread groups and greedy accuracy (the constant answer's dashed) per step."""
    try:  # matplotlib is optional: only this command draws
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot needs matplotlib: pip install matplotlib") from None
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for i, run in enumerate(runs):
        lines, cfg = read_jsonl(run / "metrics.jsonl"), json.loads((run / "config.json").read_text())
        for ax, key in zip(axes, ("reward", "format_error", "zero_std_groups", "eval/accuracy")):
            ax.plot(*zip(*[(r["step"], r[key]) for r in lines if r.get(key) is not None]), c=f"C{i}",
                    label=f"{run.name} ({method_name(cfg)}, seed {cfg['seed']})")
            ax.set(title=key, xlabel="RL step")
        constant = [(r["step"], r["eval/constant_accuracy"]) for r in lines if "eval/constant_accuracy" in r]
        axes[3].plot(*zip(*constant), c=f"C{i}", ls="--")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


# ====== A first read can stop here: TRL, then the command line ======
# LoptiGRPOTrainer: AR and Lopti inside trl.GRPOTrainer (pip install trl; tested with 1.16.0) for multi-GPU runs,
# DeepSpeed and vLLM. Only what TRL cannot do itself: pi_old, AR, the Lopti stages, the loss.


@functools.cache
def _lopti_grpo_trainer_class():
    from trl import GRPOTrainer

    class LoptiGRPOTrainer(GRPOTrainer):
        """trl.GRPOTrainer with AR (Eq. 4) and Lopti (Algorithm 1). Lopti replays each generation batch through TRL's
        num_iterations, doubled on a copy of `args`: max_steps counts both passes. Needs loss_type="dapo" (the
        token-mean). Unlike update_policy, TRL steps on a zero gradient and divides A by std + 1e-4."""

        def __init__(self, model, reward_funcs, args, *, alpha=Config.alpha, lopti=Config.lopti, eta=Config.eta,
                     lopti_order=Config.lopti_order, dual_clip=Config.dual_clip, **kwargs):
            Config(alpha=alpha, lopti=lopti, eta=eta, lopti_order=lopti_order, dual_clip=dual_clip)  # checks them
            assert args.loss_type == "dapo", "LoptiGRPOTrainer's loss is the token-mean: GRPOConfig(loss_type='dapo')"
            defaults = {"importance_sampling_level": "token", "delta": None, "top_entropy_quantile": 1.0,
                        "off_policy_mask_threshold": None,  # TRL options this loss does not apply
                        **({"vllm_importance_sampling_correction": False} if args.use_vllm else {})}
            ignored = {k: getattr(args, k, v) for k, v in defaults.items() if getattr(args, k, v) != v}
            assert not ignored, f"LoptiGRPOTrainer's loss does not apply {ignored}"
            assert not lopti or args.steps_per_generation % args.gradient_accumulation_steps == 0, \
                "with Lopti, steps_per_generation must be a multiple of gradient_accumulation_steps"
            if lopti:
                args = copy.copy(args)
                args.num_iterations *= 2
            self.alpha, self.lopti, self.eta, self.lopti_order = alpha, lopti, eta, lopti_order
            self.dual_clip = dual_clip
            super().__init__(model, reward_funcs, args=args, **kwargs)

        def _logps(self, model, batch: dict, **kwargs) -> torch.Tensor:  # (B, T) at T: TRL's head divides by it
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            return self._get_per_token_logps_and_entropies(model, ids, mask, batch["completion_ids"].shape[1],
                                                            **kwargs)[0]

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            mask = out["completion_mask"].bool()  # (B, T)
            if "old_per_token_logps" not in out and (self.alpha > 0 or self.lopti):  # TRL skips it for one pass
                with torch.no_grad():
                    out["old_per_token_logps"] = self._logps(self.model, out,
                                                             batch_size=self.args.per_device_train_batch_size)
            old = out.get("old_per_token_logps", torch.zeros(mask.shape, device=mask.device))  # (B, T); else alpha 0
            out["advantages"] = reweight_advantages(out["advantages"], old, self.alpha)  # (B, T): Eq. 4, then split
            out["lopti_low"] = lopti_masks(old, mask, self.eta)[0] if self.lopti else mask  # (B, T), carried by TRL
            return out

        def _compute_loss(self, model, inputs):
            mask, low, train = inputs["completion_mask"].bool(), inputs["lopti_low"], self.model.training  # (b, T)
            stage = mask
            if self.lopti and train:  # this micro-step's replay of the generation batch; its first half: stage 1
                second = self._step // self.args.steps_per_generation % self.num_iterations >= self.num_iterations // 2
                stage = low if second == (self.lopti_order == "high_first") else mask & ~low
            # TRL's "dapo" denominator per process (DDP averages) and optimiser step: the generation batch's tokens
            # spread over its optimiser steps, in both stages (update_policy's mini-batch count, on average)
            denom = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if train:
                denom = denom * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            logp = self._logps(model, inputs)  # (b, T)
            return policy_loss(logp, inputs.get("old_per_token_logps", logp.detach()), inputs["advantages"] * stage,
                               mask, epsilon=self.epsilon_low, epsilon_high=self.epsilon_high, dual_clip=self.dual_clip,
                               ref_logprobs=inputs.get("ref_per_token_logps"), beta=self.beta, kl_mask=stage,
                               num_tokens=denom)[0]

    return LoptiGRPOTrainer


def __getattr__(name: str):
    """`lopti.LoptiGRPOTrainer` imports TRL on first use; `import lopti` never does."""
    if name == "LoptiGRPOTrainer":
        return _lopti_grpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ====== The command line: python lopti.py {toy,train,eval,diagnose,plot,fig3} [--preset NAME] [--field value] ======

PRESETS: dict[str, dict] = {
    # a laptop, < 45 minutes on 2 cores: SmolLM2-135M-Instruct on 2-person puzzles, a 20x learning rate, no
    # reference model, and a 20-step warm-up on the solver's case analysis: pure RL on K&K stalls at this size
    "cpu": dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", num_people="2", num_train=256, steps=25,
                prompts_per_step=4, num_generations=8, max_completion_length=128, mini_batch_size=32,
                micro_batch_size=8, beta=0.0, learning_rate=2e-5, warmup_steps=20, stop_at_answer=True,
                eval_size=16, eval_every=10, eval_batch_size=16, save_every=10, output_dir="runs/cpu"),
    # a free Colab T4 (15 GB, fp32: no bf16): Qwen2.5-0.5B-Instruct, 4 x 8 completions of <= 512 tokens, no
    # reference model, the laptop's warm-up, 2-4 people (a case analysis of 5 people is ~1k tokens). Never run
    # on a GPU: README
    "colab": dict(model="Qwen/Qwen2.5-0.5B-Instruct", num_people="2-4", steps=100, prompts_per_step=4,
                  num_generations=8, max_completion_length=512, mini_batch_size=16, micro_batch_size=4, beta=0.0,
                  warmup_steps=20, gradient_checkpointing=True, eval_every=25, save_every=25,
                  output_dir="runs/colab"),
    # one 80 GB GPU: Qwen2.5-3B-Instruct (the paper's model) at half the paper's batch and length, 150 steps. Under
    # bf16 Figure 3's measurement is two fp32 forwards, estimated at 0.65-1.2x a step (H100-A100): off by default
    "gpu": dict(prompts_per_step=32, max_completion_length=2048, mini_batch_size=128, micro_batch_size=8,
                generation_batch_size=128, steps=150, eval_every=25, save_every=25, gradient_checkpointing=True,
                measure_update=False, output_dir="runs/gpu"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lopti.py", description="GRPO with Advantage Reweighting and Lopti (Yang et al., ICLR 2026)",
                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    toy = sub.add_parser("toy", help="Figure 3's mechanism on a toy softmax policy (CPU, seconds)")
    for f in fields(ToySettings):
        toy.add_argument(f"--{f.name}", type=type(f.default), help=f"default {f.default}")
    toy.add_argument("--quick", action="store_true", help=f"a smoke test: {TOY_QUICK}")
    toy.add_argument("--out", type=Path, help="folder for results.json (default toy/, or runs/toy/ when a setting "
                     "is given)")
    body = ast.parse(inspect.getsource(Config)).body[0].body  # each field's docstring, for --help
    docs = {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}
    kinds = {"float": float, "int": int, "str": str, "bool": _parse_bool}
    for name, what in (("train", "GRPO (+AR, +Lopti) on Knights and Knaves"), ("eval", "greedy K&K accuracy"),
                       ("diagnose", "Figure 1; with an explicit --steps N, Figure 3 paired over N steps")):
        p = sub.add_parser(name, help=what, argument_default=argparse.SUPPRESS, allow_abbrev=False)
        p.add_argument("--preset", choices=sorted(PRESETS), help="settings for a machine size (PRESETS)")
        for f in fields(Config):
            p.add_argument(f"--{f.name}", type=kinds[f.type], metavar=f.type.upper(),
                           help=f"{docs[f.name]} (default {f.default!r})")
    sub.choices["train"].add_argument("--resume", action="store_true", help="continue the run in --output_dir from "
                                      f"its latest checkpoint; flags may change only {', '.join(RESUME_MAY_CHANGE)}")
    sub.choices["diagnose"].add_argument("--out", type=Path, default=Path("diagnose.json"), help="the JSON to write")
    for name, what in (("plot", "learning curves of runs"), ("fig3", "Figure 3 of runs' own updates, per method")):
        p = sub.add_parser(name, help=what)
        p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="folders written by train")
    sub.choices["plot"].add_argument("--out", type=Path, default=Path("plot.png"), help="the PNG (default plot.png)")
    return parser


def resolve_config(args: dict) -> Config:
    """Defaults < preset < explicit flags; with --resume the run's config.json replaces the defaults and preset."""
    explicit = {f.name: args[f.name] for f in fields(Config) if f.name in args}
    base = PRESETS[args["preset"]] if "preset" in args else {}
    if args.get("resume"):
        out = Path({**base, **explicit}.get("output_dir", Config.output_dir))
        try:
            base = {**asdict(Config(**json.loads((out / "config.json").read_text()))), "output_dir": str(out)}
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--resume: {out} holds no run of lopti.py ({_first_line(e)})") from e
    return Config(**{**base, **explicit})


def main(argv: list[str] | None = None) -> int:
    """The command line. A bad value or file is one line and exit 2; out of memory is one line naming the settings
    to lower; Ctrl-C or SIGTERM during train saves, then exits 130 or 143."""
    args = build_parser().parse_args(argv)
    datasets.disable_progress_bars()
    try:
        if args.command == "toy":
            toy_main(args)
        elif args.command in ("plot", "fig3"):
            plot_runs(args.runs, args.out) if args.command == "plot" else figure_3(args.runs)
        else:
            cfg = resolve_config(vars(args))
            if args.command == "train":
                print(f"done: {train(cfg, resume=getattr(args, 'resume', False))}")
            elif args.command == "diagnose":
                diagnose(cfg, vars(args).get("steps", 0), args.out)  # (only an explicit --steps, not a preset's)
            else:
                device = pick_device()
                model, tokenizer = load_model(cfg.model, device), load_tokenizer(cfg.model)
                print(json.dumps(evaluate(model, tokenizer, load_task_data(cfg)[1], cfg, device), indent=2))
    except (ValueError, OSError) as e:  # a bad value, file or model name; a folder that is not a run
        print(f"lopti.py {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError, as is CPU's
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "can't allocate memory" not in str(e):
            raise
        print(f"lopti.py {args.command}: out of memory: lower --micro_batch_size (update and log-prob passes), "
              "--generation_batch_size (rollout) or --eval_batch_size; continue a run with --resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lopti.py {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
