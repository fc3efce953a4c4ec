"""The code paths a GPU takes, run on CPU: bf16 autocast (lopti.has_bf16 made true for the CPU), Figure 3's fp32
measurement under it, host reads per micro-batch, and the memory figure."""
import dataclasses
import functools

import pytest
import torch

import lopti
from conftest import tiny_config

CPU = torch.device("cpu")
ADVANTAGE_REWARDS = [0.0, 1.0, 2.0, 3.0, 3.0, 1.0, 0.0, 2.0]  # 2 groups of 4, every row with an advantage


def bf16(monkeypatch, on: bool) -> None:
    """The bf16 path on (autocast in bf16, Figure 3 measured in fp32) or off, for this test."""
    monkeypatch.setattr(lopti, "has_bf16", lambda device: on)
    assert lopti.has_bf16(CPU) is on


def bf16_step(model_dir, tmp_path, monkeypatch, *, update=None, **overrides):
    """train_step of the tiny model (2 prompts x 4, GRPO, one optimiser step) on the bf16 path (has_bf16 true on the
    CPU), rewarded ADVANTAGE_REWARDS. Returns its metrics, the model, and the batch's tensors and pi_old as
    batched_logprobs gave them."""
    bf16(monkeypatch, True)
    cfg = tiny_config(model_dir, tmp_path, max_completion_length=24, beta=0.0, mini_batch_size=8,
                      micro_batch_size=2, reward=lambda completions, solutions: torch.tensor(ADVANTAGE_REWARDS),
                      **{**lopti.METHODS["grpo"], **overrides})
    model, tok = lopti.load_model(str(model_dir), CPU), lopti.load_tokenizer(str(model_dir))
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    seen, real = [], lopti.batched_logprobs
    def spy(model, batch, cfg, device, rows=None, fp32=False):
        seen.append((batch, fp32))
        return real(model, batch, cfg, device, rows, fp32)

    monkeypatch.setattr(lopti, "batched_logprobs", spy)
    if update is not None:
        monkeypatch.setattr(lopti, "update_policy", update)
    torch.manual_seed(0)
    m = lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), lopti.kk_generate(2, 3, seed=0), CPU)
    return cfg, m, model, seen


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bf16_first_ratio_is_one(tiny_model_dir, tmp_path, monkeypatch, checkpointing):
    """Under bf16 autocast, pi_old (no grad, eval, the prompt's shared KV cache) and the update's forwards before the
    optimiser step (grad, train; a full forward under gradient checkpointing) give the same log-probs: ratio 1
    (bound 1e-6). The bf16 path was taken: pi_old differs from fp32's log-probs."""
    ratios, real_loss = [], lopti.policy_loss

    def spy(logprobs, old, advantages, mask, **kw):
        ratios.append(float((logprobs.detach() - old)[mask.bool()].abs().max()))
        return real_loss(logprobs, old, advantages, mask, **kw)

    monkeypatch.setattr(lopti, "policy_loss", spy)
    cfg, m, model, seen = bf16_step(tiny_model_dir, tmp_path, monkeypatch, gradient_checkpointing=checkpointing)
    assert len(ratios) == 4 and max(ratios) <= 1e-6, ratios  # 4 micro-batches, one optimiser step
    batch = seen[0][0]
    bf16(monkeypatch, False)
    with torch.no_grad():
        fp32 = lopti.completion_logprobs(model.eval(), batch, cfg.temperature)
    assert (fp32 - batch["old_logprobs"])[batch["mask"]].abs().max() > 1e-4  # bf16's rounding: another path


def test_bf16_figure3_measures_before_and_after_in_fp32(tiny_model_dir, tmp_path, monkeypatch):
    """Under bf16, Figure 3 compares two fp32 passes (bf16's rounding, 0.4 %, exceeds what an lr 1e-6 update moves a
    token): with the update skipped, no token moved, though bf16's pi_old differs from fp32's."""
    cfg, m, model, seen = bf16_step(tiny_model_dir, tmp_path, monkeypatch, update=lambda *a: {})
    assert [fp32 for _, fp32 in seen] == [False, True, True]  # pi_old (bf16), then the fp32 before and after
    assert sum(m["update/pos_tokens"]) + sum(m["update/neg_tokens"]) > 0
    assert all(sum(m[f"update/{k}"]) == 0 for k in ("pos_rose", "pos_fell", "neg_fell", "neg_rose")), m


def test_bf16_loss_and_gradient_near_fp32(tiny_model_dir, tmp_path, monkeypatch):
    """The update's loss and gradient under bf16 autocast stay near fp32's at the same pi_old (measured: loss 6e-5
    apart, gradient 0.4 % relative error; bounds 1e-3 and 2 %; bf16's step is 0.4 %)."""
    cfg, _, model, seen = bf16_step(tiny_model_dir, tmp_path, monkeypatch, update=lambda *a: {})
    batch = seen[0][0]
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0, -1.0])

    def loss_and_grad(on: bool):
        bf16(monkeypatch, on)
        model.zero_grad(set_to_none=True)
        with lopti.autocast(CPU):
            logprobs = lopti.completion_logprobs(model, batch, cfg.temperature)
        assert logprobs.dtype == torch.float32  # (the loss is fp32 either way; bf16 differs by rounding)
        loss, _ = lopti.policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["mask"])
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    model.train()
    (loss32, grad32), (loss16, grad16) = loss_and_grad(False), loss_and_grad(True)
    assert 0 < abs(loss16 - loss32) <= 1e-3
    assert 0 < (grad16 - grad32).norm() / grad32.norm() <= 0.02


def test_update_policy_host_reads_do_not_grow_with_micro_batches(monkeypatch):
    """policy_loss's statistics and the loss stay tensors until the optimiser step: the host reads (float, int,
    bool, item, tolist, cpu: on a GPU each waits for it) are the same for 8 micro-batches per optimiser step as for
    1, and grow by a fixed few per optimiser step: the gradient norm (logged), the loss, and the mini-batch's row
    check (on a CPU tensor: no wait)."""
    s = lopti.ToySettings(prompts=4, group=4)
    net = lopti.ToyPolicy(s, 0)
    batch = lopti.toy_rollout(net, torch.Generator().manual_seed(0))
    batch["advantages"] = torch.randn(16, generator=torch.Generator().manual_seed(0))  # every row computed
    counts = {}
    for name in ("__float__", "__int__", "__bool__", "item", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def reads(mini: int, micro: int, method: str = "grpo") -> int:
        cfg = dataclasses.replace(lopti.method_config(lopti.Config(prompts_per_step=4, num_generations=4,
                                                                   beta=0.0, mini_batch_size=16), method),
                                  mini_batch_size=mini, micro_batch_size=micro)
        counts.clear()
        lopti.update_policy(cfg, functools.partial(lopti.toy_logprobs, net), lopti.make_optimizer(net, cfg), batch)
        return sum(counts.values())

    assert reads(8, 1) == reads(8, 8) > 0, counts  # 8 micro-batches per optimiser step, or 1
    assert reads(16, 1, "ar_lopti") == reads(16, 16, "ar_lopti")
    per_step = reads(8, 8) - reads(16, 16)  # 2 optimiser steps in the pass instead of 1
    assert 0 < per_step <= 3, counts
