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

import argparse
import ast
import functools
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
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import datasets
import torch
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm


# ====== Config: one dataclass, paper defaults (PAPER.md Sec. 1, 3, 4) ======


@dataclass
class Config:
    """Every field is settable as `--field value`; PRESETS change a few for smaller machines.
    Defaults are the paper's K&K run (PAPER.md Sec. 1); names shared with TRL's GRPOConfig keep TRL's
    spelling (num_generations, temperature, max_completion_length, epsilon, epsilon_high, beta, ...)."""

    # --- method
    alpha: float = 0.3
    """Advantage Reweighting strength, Eq. 4; 0 turns AR off (paper: 0.3 on K&K, 0.1 on math)."""
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
    """Dual-clip constant c for negative advantages (official code; not in the paper's text)."""
    beta: float = 0.001
    """Weight of the k3 KL penalty to the reference model; 0 loads no reference model."""
    learning_rate: float = 1e-6
    """AdamW learning rate, constant (betas 0.9/0.999)."""
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
    gradient_checkpointing: bool = False
    """Trade compute for memory in the update's forward passes."""
    # --- data and schedule
    train_data: str = "generate"
    """'generate' (fresh puzzles), a .jsonl/.parquet file, or a hub dataset (see kk_load)."""
    num_people: str = "3-7"
    """Puzzle sizes to generate: 'lo-hi' or one number."""
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
    output_dir: str = "runs/lopti"
    """Checkpoints, metrics.jsonl and config.json go here."""
    seed: int = 0
    """Seeds data order, sampling and generated puzzles."""

    def __post_init__(self):
        checks = [
            ("alpha", 0 <= self.alpha <= 1, "in [0, 1]"), ("eta", 0 < self.eta <= 1, "in (0, 1]"),
            ("lopti_order", self.lopti_order in ("low_first", "high_first"), "'low_first' or 'high_first'"),
            ("epsilon", self.epsilon >= 0, ">= 0"), ("epsilon_high", self.epsilon_high >= 0, ">= 0"),
            ("dual_clip", self.dual_clip > 1, "> 1"), ("beta", self.beta >= 0, ">= 0"),
            ("learning_rate", self.learning_rate > 0, "> 0"), ("temperature", self.temperature > 0, "> 0"),
        ] + [(f, getattr(self, f) >= 1, ">= 1") for f in (
            "mini_batch_size", "micro_batch_size", "num_iterations", "prompts_per_step", "num_generations",
            "max_completion_length", "num_train", "eval_size", "eval_batch_size")]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")


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
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (B*T, V): a view if logits is contiguous, else a copy
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


# ====== Knights and Knaves: the paper's task (Sec. 5; Logic-RL's data and reward) ======
# PAPER.md §7. Data: the K&K benchmark (github.com/AlphaPav/mem-kk-logic, hub K-and-K/knights-and-knaves)
# as Logic-RL ships it; reward: Logic-RL's verl/utils/reward_score/kk.py (the same file in AR-Lopti).


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
        raise ValueError(f"unknown operator {op!r} in {stmt!r}; allowed: telling-truth, lying, "
                         f"{', '.join(_KK_OPS)}")
    lo, hi = _KK_OPS[op]
    if len(args) < lo or (hi is not None and len(args) > hi):
        raise ValueError(f"operator {op!r} got {len(args)} operand(s) in {stmt!r}")
    vals = [_kk_truth(a, masks, full) for a in args]
    if op == "not":
        return full ^ vals[0]
    if op == "and":
        return functools.reduce(lambda x, y: x & y, vals)
    if op == "or":
        return functools.reduce(lambda x, y: x | y, vals)
    if op == "->":
        return (full ^ vals[0]) | vals[1]
    return full ^ (vals[0] ^ vals[1])  # "<=>"


def kk_solve(statements):
    """Every consistent knight/knave assignment (True = knight), by brute force over all 2^n.

    `statements` is the official tuple (one statement per person) or its string, parsed with
    ast.literal_eval. Person i is consistent iff (i is a knight) <=> (statement i is true). Assignments
    come in itertools.product([True, False], repeat=n) order, as in the benchmark's solver.
    """
    if isinstance(statements, str):
        statements = ast.literal_eval(statements)  # a literal only, never eval: rows may come from anywhere
    if not isinstance(statements, (tuple, list)) or not statements:
        raise ValueError(f"statements must be a non-empty tuple of statements, got {statements!r}")
    n = len(statements)
    masks, full = _kk_knight_masks(n), (1 << 2 ** n) - 1
    ok = full
    for i, stmt in enumerate(statements):
        ok &= full ^ (masks[i] ^ _kk_truth(stmt, masks, full))  # speaker truthful iff knight
    return [[not (a >> (n - 1 - i)) & 1 for i in range(n)] for a in range(2 ** n) if (ok >> a) & 1]


def _kk_sample_statement(rng, n, speaker):
    """One statement by `speaker`, drawn from the benchmark's grammar (depth 2, width 2; PAPER.md §7)."""
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
    if stmt[0] == "not":
        return _kk_leaf_text(names, stmt[1], negate=True)
    if stmt[0] in ("and", "or"):
        return f" {stmt[0]} ".join(_kk_leaf_text(names, s) for s in stmt[1:])
    if stmt[0] == "->":
        return f"If {_kk_leaf_text(names, stmt[1])} then {_kk_leaf_text(names, stmt[2])}"
    if stmt[0] == "<=>":
        return f"{_kk_leaf_text(names, stmt[1])} if and only if {_kk_leaf_text(names, stmt[2])}"
    return _kk_leaf_text(names, stmt)


def _kk_solution_texts(names, solution):
    """(solution_text, solution_text_format) exactly as the official rows write them."""
    parts = [f"{name} is {'a knight' if knight else 'a knave'}" for name, knight in zip(names, solution)]
    text = ", ".join(parts[:-1]) + ", and " + parts[-1] + "."  # the benchmark's ", and" even for two people
    return text, "\n".join(f"({i}) {p}" for i, p in enumerate(parts, 1))


def kk_generate(n, num_people=(3, 7), seed=0):
    """`n` K&K puzzles with exactly one solution, in the official schema (KK_FEATURES).

    num_people: an int, or an inclusive (lo, hi) range drawn uniformly per puzzle; allowed 2..8 (the
    benchmark's sizes; the paper trains on 3..7). Reproducible: everything comes from random.Random(seed).
    Like the benchmark, a statement tuple is never repeated within one call.
    """
    bounds = (num_people,) * 2 if isinstance(num_people, int) else num_people
    lo, hi = tuple(bounds) if isinstance(bounds, (tuple, list)) and len(bounds) == 2 else (None, None)
    if not (isinstance(lo, int) and isinstance(hi, int) and 2 <= lo <= hi <= 8):
        raise ValueError(f"num_people must be an int or an inclusive (lo, hi) range within 2..8 with "
                         f"lo <= hi, got {num_people!r}")
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
            raise ValueError(f"n={n}: only {len(rows)} distinct {k}-person puzzles found; "
                             f"ask for fewer puzzles or more people")
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


def _kk_normalise(row):
    """One loaded row in KK_FEATURES, checked: its statements must have exactly its solution."""
    truth = (row.get("reward_model") or {}).get("ground_truth") or {}  # Logic-RL keeps the answer here
    text_format = row.get("solution_text_format") or truth.get("solution_text_format")
    statements = row.get("statements") or truth.get("statements")
    if not isinstance(statements, str):  # a JSON list of lists; the official form is the tuple's repr
        statements = repr(_kk_as_tuple(statements))
    roles = kk_parse_solution(text_format)
    names, solution = list(roles), [role == "knight" for role in roles.values()]
    for key, value in (("names", names), ("solution", solution)):
        if row.get(key) is not None and list(row[key]) != value:
            raise ValueError(f"{key} {list(row[key])} disagrees with solution_text_format ({value})")
    if kk_solve(statements) != [solution]:
        raise ValueError(f"statements {statements} do not have the unique solution {solution}")
    text = row.get("solution_text") or _kk_solution_texts(names, solution)[0]
    return {"quiz": row["quiz"], "names": names, "solution": solution, "solution_text": text,
            "solution_text_format": text_format, "statements": statements, "num_people": len(names)}


_KK_HUB_NAME = re.compile(r"[\w-]+/[\w.-]+(:[\w.-]+(/[\w.-]+)?)?")
_KK_FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip")


def kk_load(source):
    """K&K puzzles from a local file or the Hugging Face hub, normalised to KK_FEATURES and validated.

    source: a `.parquet`, `.jsonl` or `.json` path in the K&K benchmark's format (quiz, statements,
    solution_text_format, ...) or Logic-RL's (the same plus prompt/reward_model; solution_text_format and
    statements are taken from reward_model.ground_truth when the top-level columns are absent); or a hub
    dataset "OWNER/NAME", "OWNER/NAME:SPLIT" or "OWNER/NAME:CONFIG/SPLIT" (default split "train"). The
    benchmark is "K-and-K/knights-and-knaves" with configs "train"/"test" and splits "2ppl".."8ppl", e.g.
    "K-and-K/knights-and-knaves:test/3ppl". Files and hub go through the same datasets.load_dataset.
    """
    source = str(source)
    if not os.path.exists(source) and _KK_HUB_NAME.fullmatch(source) \
            and not source.split(":")[0].lower().endswith(_KK_FILE_SUFFIXES):
        name, _, sel = source.partition(":")
        config, _, split = sel.rpartition("/")
        try:
            ds = datasets.load_dataset(name, config or None, split=split or "train")
        except OSError as e:  # ConnectionError (offline, no network) and missing-repo errors are OSErrors
            raise ConnectionError(
                f"could not load {source!r} from the Hugging Face hub: the hub needs internet (and "
                f"HF_HUB_OFFLINE must be unset). Offline, pass a local .parquet/.jsonl file or make puzzles "
                f"with kk_generate(n). Cause: {type(e).__name__}: {e}") from e
    else:
        path = Path(source).expanduser()
        builder = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"kk_load: unknown file type {path.suffix!r} for {source!r}; "
                             f"accepted: .parquet, .jsonl, .json, or a hub dataset name")
        if not path.is_file():
            raise FileNotFoundError(f"kk_load: no such file: {source!r}")
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
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
    """The prompt text for one quiz: Logic-RL's system prompt, the quiz, and the pre-filled THINK_PREFIX.

    With a chat template this is apply_chat_template([system, user]) + "<think>"; the user turn is
    quiz + "\\n" because Logic-RL's hand-written ChatML prompt has "{quiz}\\n<|im_end|>", so a Qwen2.5
    template reproduces the official prompt byte for byte. Without a chat template (base models) a plain
    "...\\nUser: {quiz}\\nAssistant: <think>" layout, like Logic-RL's base template, is used with a warning
    (Python's default warning filter shows it once per process).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": KK_SYSTEM_PROMPT}, {"role": "user", "content": quiz + "\n"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + THINK_PREFIX
    warnings.warn("kk_prompt: the tokenizer has no chat template, so a plain 'User: ... Assistant:' template "
                  "is used; an instruct model (e.g. Qwen2.5-*-Instruct) is recommended", UserWarning)
    return f"{KK_SYSTEM_PROMPT}\nUser: {quiz}\nAssistant: {THINK_PREFIX}"


def kk_parse_solution(solution_text_format):
    """{name: "knight" | "knave"} from a ground truth like "(1) Amelia is a knight\\n(2) ...", per line.

    Logic-RL's parse: the first word of letters on each line is the name, the next knight/knave its role.
    """
    if not isinstance(solution_text_format, str):
        raise ValueError(f"solution_text_format must be a string, got {type(solution_text_format).__name__}")
    roles = {}
    for line in solution_text_format.split("\n"):
        m = re.search(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", line.strip(), re.IGNORECASE)
        if m:
            roles[m.group(1)] = m.group(2).lower()
    if not roles:
        raise ValueError(f"solution_text_format has no 'NAME is a knight/knave' line: "
                         f"{solution_text_format!r}")
    return roles


_KK_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def kk_reward(completion, solution_text_format):
    """Logic-RL's K&K reward of one completion: 3 (correct), -0.5 (wrong), -1 (unreadable answer), -3.

    `completion` is the assistant text with the pre-filled THINK_PREFIX in front. Format +1 iff each tag
    of <think></think><answer></answer> occurs exactly once and in that order, else -1 and the answer is
    not read (answer -2). Answer (inside <answer>...</answer>): the number of "knight"/"knave" substrings
    must equal the number of people and every name must match r"\\bNAME\\b\\s+is\\s+a\\s+\\b(knight|knave)\\b"
    (case-insensitive, first match), else -2; then +2 if all roles are right, -1.5 if any is wrong.
    Logic-RL scores the decoded prompt + response after its first "Assistant:" (else after
    "<|im_start|>assistant"); its ChatML prompts contain no "Assistant:", so that equals keeping the text
    after the first "Assistant:" of the assistant text, if any, which is done here. Never raises on model
    text; a non-string completion scores -3.
    """
    truth = kk_parse_solution(solution_text_format)
    if not isinstance(completion, str):
        return KK_FORMAT_ERROR
    text = completion.split("Assistant:", 1)[1] if "Assistant:" in completion else completion
    positions = [text.find(tag) for tag in _KK_TAGS]
    if any(text.count(tag) != 1 for tag in _KK_TAGS) or positions != sorted(positions):
        return KK_FORMAT_ERROR
    answer = text[positions[2] + len("<answer>"):positions[3]]  # the only <answer> block
    lowered = answer.lower()  # an empty answer (Logic-RL checks it first) fails this count as well
    if lowered.count("knight") + lowered.count("knave") != len(truth):
        return -1.0
    predicted = {}
    for name in truth:
        m = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
        if m is None:
            return -1.0
        predicted[name] = m.group(1).lower()
    return KK_MAX_REWARD if predicted == truth else -0.5


# ====== Model I/O and rollout (Algorithm 1, lines 3-5: sample G responses, score them, pi_old) ======


def pick_device() -> torch.device:
    """cuda -> mps -> cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def autocast(device: torch.device):
    """bf16 autocast where the GPU has bf16, fp32 elsewhere. The parameters (and AdamW's state) stay fp32:
    at lr 1e-6 an update is below bf16's resolution, so bf16 weights would barely move."""
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def load_model(name: str, device: torch.device):
    """A causal LM in fp32 with PyTorch SDPA attention and dropout off, from a local folder or the hub."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, name, dtype=torch.float32, attn_implementation="sdpa")
    for module in model.modules():  # dropout would make the first ratio != 1 (STYLE.md pitfalls)
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


def _from_pretrained(cls, name: str, **kwargs):
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        if not path.is_dir():
            raise FileNotFoundError(f"no model folder at {name!r}: pass a folder written by save_pretrained "
                                    "or a hub id such as Qwen/Qwen2.5-0.5B-Instruct")
        return cls.from_pretrained(str(path), **kwargs)
    try:
        return cls.from_pretrained(name, **kwargs)
    except OSError as e:
        raise OSError(f"could not load {name!r}: there is no local folder of that name, and the Hugging Face "
                      "hub did not serve it. Check the id; the hub needs internet (offline, pass a local folder "
                      "written by save_pretrained).") from e


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
        -> mask [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], truncated [F, F, T]
    """
    is_eos = torch.isin(completions, torch.tensor(eos_ids, device=completions.device))  # (B, C)
    truncated = ~is_eos.any(dim=1)  # (B,)
    # the number of EOS strictly before each position: 0 means "not yet stopped"
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # (B, C)
    return eos_before == 0, truncated


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion: int,
                      temperature: float) -> torch.Tensor:
    """log pi(o_t) at temperature T for the last `num_completion` tokens of left-padded rows: (B, C).

    Position ids come from the attention mask, as generate() computed them, so a left-padded row scores
    exactly as it would alone (models with absolute positions are wrong without them). Only the logits
    that predict the completion are computed (logits_to_keep), which keeps the (B, T, V) tensor small.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=num_completion + 1, use_cache=False).logits  # (B, C + 1, V)
    # Score all C + 1 positions against the completion plus a dummy last token and drop that column:
    # slicing logits[:, :-1] instead would make token_logprobs copy the whole (B, C, V) tensor.
    targets = torch.nn.functional.pad(input_ids[:, -num_completion:], (0, 1))  # (B, C + 1)
    return token_logprobs(logits, targets, temperature)[:, :-1]  # (B, C)


@torch.no_grad()
def rollout(model, tokenizer, prompts: list[str], cfg: Config, device: torch.device, greedy: bool = False):
    """Sample one completion per prompt (repeat prompts for groups) from pi_old at `cfg.temperature`.

    Sampling is plain softmax(z / T): no top-k, top-p or repetition penalty from the model's generation
    config, because pi_old must be the distribution the tokens were drawn from. Returns a dict with the
    left-padded prompt + completion `input_ids` and `attention_mask` (B, P + C), the completion `mask`
    (B, C), `truncated` (B,) and the decoded completion `texts`.
    """
    from transformers import GenerationConfig

    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    eos_ids = eos_token_ids(model, tokenizer)
    # Unset fields are filled from the model's own generation config (Qwen's has top_p 0.8, top_k 20,
    # repetition_penalty 1.05), so every knob that reshapes the distribution is set to "off" here.
    sampling = {} if greedy else dict(temperature=cfg.temperature, top_k=0, top_p=1.0)
    gen_cfg = GenerationConfig(do_sample=not greedy, repetition_penalty=1.0, max_new_tokens=cfg.max_completion_length,
                               eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, **sampling)
    with autocast(device):
        out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             generation_config=gen_cfg)  # (B, P + C); no token_type_ids (4.x tokenizers add them)
    completions = out[:, enc["input_ids"].shape[1]:]  # (B, C)
    mask, truncated = completion_mask(completions, eos_ids)  # (B, C), (B,)
    texts = tokenizer.batch_decode(torch.where(mask, completions, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    attention_mask = torch.cat([enc["attention_mask"], torch.ones_like(completions)], dim=1)  # (B, P + C)
    return {"input_ids": out, "attention_mask": attention_mask, "mask": mask, "truncated": truncated,
            "texts": texts}


@torch.no_grad()
def batched_logprobs(model, batch: dict, cfg: Config, device: torch.device) -> torch.Tensor:
    """No-grad log-probs of the completions, micro-batched: pi_old right after rollout, or the reference."""
    model.eval()
    C = batch["mask"].shape[1]
    out = []
    for i in range(0, batch["mask"].shape[0], cfg.micro_batch_size):
        rows = slice(i, i + cfg.micro_batch_size)
        with autocast(device):
            out.append(sequence_logprobs(model, batch["input_ids"][rows], batch["attention_mask"][rows], C,
                                         cfg.temperature))
    return torch.cat(out)  # (B, C) float32


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
        t0 = time.perf_counter()
        # token-weighted sums of policy_loss's stats, every key present even if the stage is empty
        token_sums = dict.fromkeys(("clip_high", "clip_low", "clip_dual", "kl_ref", "kl_old"), 0.0)
        losses, grad_norms, total = [], [], 0.0
        for _ in range(cfg.num_iterations):
            for start in range(0, B, cfg.mini_batch_size):
                rows = slice(start, min(start + cfg.mini_batch_size, B))
                if not stage_mask[rows].any():
                    # Nothing of this stage here: no update. A step on a zero gradient would still move
                    # the weights through AdamW's momentum and weight decay.
                    continue
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
                        token_sums[k] += v * t
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
                optimizer.step()
                losses.append(loss_sum)
        out.update({f"{name}/{k}": v / max(total, 1.0) for k, v in token_sums.items()})
        out[f"{name}/loss"] = sum(losses) / max(len(losses), 1)
        out[f"{name}/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        out[f"{name}/token_share"] = float(stage_mask.sum()) / max(float(mask.sum()), 1.0)
        out[f"time/update_{name}"] = time.perf_counter() - t0
    optimizer.zero_grad(set_to_none=True)  # free the gradients before the next rollout
    return out


# ====== Training loop: rollout -> reward -> advantage -> pi_old -> update, with checkpoints ======


def train_step(cfg: Config, model, ref_model, tokenizer, optimizer, rows: dict, device: torch.device) -> dict:
    """One RL step (Algorithm 1) on a batch of K&K rows; returns its metrics."""
    G = cfg.num_generations
    t0 = time.perf_counter()
    prompts = [kk_prompt(tokenizer, quiz) for quiz in rows["quiz"] for _ in range(G)]
    batch = rollout(model, tokenizer, prompts, cfg, device)
    t1 = time.perf_counter()
    solutions = [sol for sol in rows["solution_text_format"] for _ in range(G)]
    rewards = torch.tensor([kk_reward(THINK_PREFIX + text, sol) for text, sol in zip(batch["texts"], solutions)])
    if cfg.mask_truncated:
        batch["mask"] = batch["mask"] & ~batch["truncated"].unsqueeze(1)
    batch["advantages"] = group_advantages(rewards, G).to(device)  # (B,)
    batch["old_logprobs"] = batched_logprobs(model, batch, cfg, device)  # (B, C), fixed for this step
    if ref_model is not None:
        batch["ref_logprobs"] = batched_logprobs(ref_model, batch, cfg, device)
    t2 = time.perf_counter()

    def logprob_fn(micro: dict) -> torch.Tensor:
        with autocast(device):
            return sequence_logprobs(model, micro["input_ids"], micro["attention_mask"], micro["mask"].shape[1],
                                     cfg.temperature)

    model.train()  # for gradient checkpointing; dropout is off (load_model)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "truncated"}
    stats = update_policy(cfg, logprob_fn, optimizer, tensors)
    lengths = batch["mask"].sum(1).float()
    grouped = rewards.view(-1, G)
    return {
        "reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "accuracy": (rewards == KK_MAX_REWARD).float().mean().item(),
        "format_error": (rewards == KK_FORMAT_ERROR).float().mean().item(),
        "zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean().item(),
        "completion_length": lengths.mean().item(), "truncated": batch["truncated"].float().mean().item(),
        "learning_rate": optimizer.param_groups[0]["lr"], **stats,
        "time/rollout": t1 - t0, "time/logprobs": t2 - t1,
        "gen_tokens_per_s": lengths.sum().item() / max(t1 - t0, 1e-9), "peak_memory_gb": peak_memory_gb(device),
    }


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch on CUDA; peak resident memory of the process elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def parse_num_people(spec: str) -> int | tuple[int, int]:
    """'3-7' -> (3, 7); '5' -> 5."""
    try:
        lo, _, hi = spec.partition("-")
        return (int(lo), int(hi)) if hi else int(lo)
    except ValueError:
        raise ValueError(f"num_people must be 'lo-hi' or a number, e.g. '3-7', got {spec!r}") from None


def load_task_data(cfg: Config):
    """Training rows and evaluation rows (evaluation puzzles never appear in training)."""
    train = (kk_generate(cfg.num_train, parse_num_people(cfg.num_people), seed=cfg.seed)
             if cfg.train_data == "generate" else kk_load(cfg.train_data))
    if cfg.eval_data == "generate":
        spec = parse_num_people(cfg.num_people)
        lo, hi = spec if isinstance(spec, tuple) else (spec, spec)
        evals = datasets.concatenate_datasets([kk_generate(cfg.eval_size, n, seed=cfg.seed + 1_000_003 + n)
                                      for n in range(lo, hi + 1)])
    else:
        evals = kk_load(cfg.eval_data)
    seen = set(train["quiz"])
    evals = evals.filter(lambda row: row["quiz"] not in seen)
    if len(evals) == 0:
        raise ValueError("the evaluation set is empty once training puzzles are removed: use other --eval_data")
    return train, evals


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


def save_checkpoint(cfg: Config, model, tokenizer, optimizer, step: int) -> Path:
    out = Path(cfg.output_dir)
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    if old.exists() and not final.exists():  # a crash between the two renames below: restore first
        old.rename(final)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng, "config": asdict(cfg)},
               tmp / "trainer_state.pt")
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


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def train(cfg: Config, resume: bool = False) -> Path:
    """GRPO (+AR, +Lopti) on K&K. Writes config.json, metrics.jsonl and checkpoint/ under cfg.output_dir."""
    out = Path(cfg.output_dir)
    B = cfg.prompts_per_step * cfg.num_generations
    if B % cfg.mini_batch_size or cfg.mini_batch_size % cfg.micro_batch_size:
        raise ValueError(f"batch sizes do not divide: prompts_per_step * num_generations = {B} must be a multiple "
                         f"of mini_batch_size = {cfg.mini_batch_size}, itself a multiple of micro_batch_size = "
                         f"{cfg.micro_batch_size}")
    ckpt = latest_checkpoint(cfg.output_dir)
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out}/; start without --resume")
    if not resume and (ckpt is not None or (out / "metrics.jsonl").exists()):
        raise FileExistsError(f"{out}/ holds another run; pass --resume to continue it, or choose another "
                              "--output_dir")
    device = pick_device()
    torch.manual_seed(cfg.seed)
    train_rows, eval_rows = load_task_data(cfg)
    model = load_model(str(ckpt) if resume else cfg.model, device)
    tokenizer = load_tokenizer(str(ckpt) if resume else cfg.model)
    ref_model = load_model(cfg.model, device).eval().requires_grad_(False) if cfg.beta > 0 else None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=cfg.weight_decay)
    start = 0
    if resume:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        start = state["step"]
        _truncate_metrics(out / "metrics.jsonl", start)  # drop steps logged after the checkpoint
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "config.json", json.dumps(asdict(cfg), indent=2))

    stop = {"requested": False}

    def on_sigint(signum, frame):
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True
        print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again aborts without saving)")

    previous_handler = signal.signal(signal.SIGINT, on_sigint)
    step = start
    try:
        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", dynamic_ncols=True)
        for step in bar:
            rows = train_rows[step_rows(len(train_rows), cfg, step)]
            metrics = {"step": step + 1, **train_step(cfg, model, ref_model, tokenizer, optimizer, rows, device)}
            done = step + 1 == cfg.steps or stop["requested"]
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or done:
                metrics.update(evaluate(model, tokenizer, eval_rows, cfg, device))
            append_jsonl(out / "metrics.jsonl", metrics)
            bar.set_postfix(reward=f"{metrics['reward']:.2f}", acc=f"{metrics['accuracy']:.2f}")
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or done:
                save_checkpoint(cfg, model, tokenizer, optimizer, step + 1)
            if stop["requested"]:
                print(f"stopped after step {step + 1}; continue with --resume")
                break
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    return out / "checkpoint"


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the metrics of steps up to the checkpoint; a line torn by a crash mid-write is dropped too."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    _atomic_write(path, "".join(keep))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ====== Evaluation: greedy accuracy per number of people (PAPER.md Sec. 5) ======


def evaluate(model, tokenizer, rows, cfg: Config, device: torch.device) -> dict[str, float]:
    """Greedy decoding on K&K rows; accuracy (share of reward == 3) and mean reward per number of people."""
    rewards, sizes = [], []
    for i in range(0, len(rows), cfg.eval_batch_size):
        chunk = rows[i : i + cfg.eval_batch_size]
        batch = rollout(model, tokenizer, [kk_prompt(tokenizer, q) for q in chunk["quiz"]], cfg, device, greedy=True)
        rewards += [kk_reward(THINK_PREFIX + t, s) for t, s in zip(batch["texts"], chunk["solution_text_format"])]
        sizes += [len(names) for names in chunk["names"]]
    out = {}
    for n in sorted(set(sizes)):
        r = [x for x, k in zip(rewards, sizes) if k == n]
        out[f"eval/accuracy_{n}ppl"] = sum(x == KK_MAX_REWARD for x in r) / len(r)
        out[f"eval/reward_{n}ppl"] = sum(r) / len(r)
    out["eval/accuracy"] = sum(x == KK_MAX_REWARD for x in rewards) / max(len(rewards), 1)
    return out


# ====== CLI: python lopti.py {toy,train,eval} [--preset NAME] [--field value ...] ======

PRESETS: dict[str, dict] = {
    # a laptop CPU: a 135M instruct model, 3-person puzzles, short completions; minutes, not hours
    "cpu": dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", num_people="3", num_train=256, steps=20,
                prompts_per_step=4, num_generations=4, max_completion_length=256, mini_batch_size=16,
                micro_batch_size=4, eval_size=16, eval_every=10, eval_batch_size=16, save_every=10,
                output_dir="runs/cpu"),
    # a free Colab GPU (16 GB): Qwen2.5-0.5B-Instruct, 3-5 people, 1k-token completions
    "colab": dict(model="Qwen/Qwen2.5-0.5B-Instruct", num_people="3-5", steps=200, prompts_per_step=8,
                  num_generations=8, max_completion_length=1024, mini_batch_size=32, micro_batch_size=4,
                  gradient_checkpointing=True, eval_every=25, save_every=25, output_dir="runs/colab"),
    # one large GPU: the paper's Qwen2.5-3B-Instruct run (the Config defaults)
    "gpu": dict(micro_batch_size=8, gradient_checkpointing=True, output_dir="runs/gpu"),
}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def config_parser(prog: str) -> argparse.ArgumentParser:
    """--preset, --resume and one --field for every Config field (unset fields are absent)."""
    parser = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="settings for a machine size (see PRESETS)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output_dir from its "
                        "latest checkpoint, with its saved config (explicit --field values override it)")
    types = {"float": float, "int": int, "str": str, "bool": _parse_bool}
    docs = _field_docs()
    for f in fields(Config):
        names = {f"--{f.name}", f"--{f.name.replace('_', '-')}"}
        parser.add_argument(*sorted(names), dest=f.name, type=types[f.type], metavar=f.type.upper(),
                            help=f"{docs.get(f.name, '')} (default {f.default!r})")
    return parser


def _field_docs() -> dict[str, str]:
    """The docstring under each Config field, for --help (the dataclass above is the one place to edit)."""
    body = ast.parse(inspect.getsource(Config)).body[0].body
    return {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def resolve_config(args: dict) -> Config:
    """Defaults < preset < (on --resume) the run's saved config < explicit --field values."""
    preset = PRESETS[args["preset"]] if "preset" in args else {}
    explicit = {f.name: args[f.name] for f in fields(Config) if f.name in args}
    values = {**preset, **explicit}
    if args.get("resume"):
        saved = Path(values.get("output_dir", Config.output_dir)) / "config.json"
        if not saved.exists():
            raise FileNotFoundError(f"--resume: {saved} not found; is --output_dir the run's folder?")
        values = {**json.loads(saved.read_text()), **explicit}
    return Config(**values)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = ("toy", "train", "eval")
    if not argv or argv[0] not in commands:
        print(__doc__)
        sys.exit(f"usage: python lopti.py {{{','.join(commands)}}} [options]; --help after a command lists them")
    command, rest = argv[0], argv[1:]
    if command == "toy":
        toy_main(rest)
        return
    args = vars(config_parser(f"lopti.py {command}").parse_args(rest))
    cfg = resolve_config(args)
    if command == "train":
        print(f"done: {train(cfg, resume=args.get('resume', False))}")
        return
    device = pick_device()
    model, tokenizer = load_model(cfg.model, device), load_tokenizer(cfg.model)
    rows = load_task_data(cfg)[1] if cfg.eval_data == "generate" else kk_load(cfg.eval_data)
    results = evaluate(model, tokenizer, rows, cfg, device)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
