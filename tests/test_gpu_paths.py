"""The code paths a GPU takes, run on CPU: bf16 autocast (LOPTI_CPU_BF16=1), running out of memory, the memory
figure, and host syncs per micro-batch."""
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import traceback
import weakref
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

import lopti

ROOT = Path(__file__).resolve().parent.parent


def _scored_batch(model_dir, tmp_path, monkeypatch, bf16: bool, **overrides):
    """A rollout of the tiny model (2 prompts x 4) with pi_old from batched_logprobs, as train_step makes them."""
    monkeypatch.setenv("LOPTI_CPU_BF16", "1" if bf16 else "0")
    cfg = tiny_config(model_dir, tmp_path, max_completion_length=24, beta=0.0, **overrides)
    device = torch.device("cpu")
    model, tokenizer = lopti.load_model(str(model_dir), device), lopti.load_tokenizer(str(model_dir))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    quizzes = lopti.kk_generate(2, 3, seed=0)["quiz"]
    torch.manual_seed(0)
    batch = lopti.rollout(model, tokenizer, [lopti.kk_prompt(tokenizer, q) for q in quizzes for _ in range(4)], cfg,
                          device)
    batch["old_logprobs"] = lopti.batched_logprobs(model, batch, cfg, device)
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0, -1.0])
    return cfg, model, {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "truncated"}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bf16_first_ratio_is_one(tiny_model_dir, tmp_path, monkeypatch, checkpointing):
    """Under bf16 autocast, pi_old (no grad, eval, the prompt's shared KV cache) and the update's first forward (grad,
    train; a full forward under gradient checkpointing) give the same log-probs: the first ratio is 1 (measured
    here: exactly; bound 1e-6). The log-probs do differ from fp32's, so the bf16 path was taken."""
    cfg, model, batch = _scored_batch(tiny_model_dir, tmp_path, monkeypatch, True,
                                      gradient_checkpointing=checkpointing)
    with torch.no_grad():
        fp32 = lopti.completion_logprobs(model, batch, cfg.temperature)
    assert (fp32 - batch["old_logprobs"])[batch["mask"]].abs().max() > 1e-4  # bf16 rounding: a different path
    seen, policy_loss = [], lopti.policy_loss

    def spy(logprobs, old, advantages, mask, **kw):
        seen.append((logprobs.detach() - old)[mask.bool()].abs().max())
        return policy_loss(logprobs, old, advantages, mask, **kw)

    monkeypatch.setattr(lopti, "policy_loss", spy)
    one_step = dataclasses.replace(cfg, mini_batch_size=8, lopti=False, micro_batch_size=2)  # 4 micro-batches

    def logprob_fn(micro):
        with lopti.autocast(torch.device("cpu")):
            return lopti.completion_logprobs(model, micro, cfg.temperature)

    model.train()
    lopti.update_policy(one_step, logprob_fn, lopti.make_optimizer(model, one_step), batch)
    assert len(seen) == 4 and max(seen) <= 1e-6, seen


def test_bf16_loss_and_gradient_near_fp32(tiny_model_dir, tmp_path, monkeypatch):
    """The update's loss and gradient under bf16 autocast stay within a bound of fp32's, at the same pi_old (measured
    here: loss 6e-5 apart, gradient 0.4 % relative error; bounds 1e-3 and 2 %, bf16's step is 0.4 %)."""
    cfg, model, batch = _scored_batch(tiny_model_dir, tmp_path, monkeypatch, False)

    def loss_and_grad(bf16: bool):
        monkeypatch.setenv("LOPTI_CPU_BF16", "1" if bf16 else "0")
        model.zero_grad(set_to_none=True)
        with lopti.autocast(torch.device("cpu")):
            logprobs = lopti.completion_logprobs(model, batch, cfg.temperature)
        assert (logprobs.dtype, lopti.has_bf16(torch.device("cpu"))) == (torch.float32, bf16)
        loss, _ = lopti.policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["mask"])
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    model.train()
    (loss32, grad32), (loss16, grad16) = loss_and_grad(False), loss_and_grad(True)
    assert 0 < abs(loss16 - loss32) <= 1e-3
    assert 0 < (grad16 - grad32).norm() / grad32.norm() <= 0.02


def test_update_policy_syncs_once_per_mini_batch(monkeypatch):
    """policy_loss's statistics and the loss stay tensors until the optimiser step: the number of host reads
    (float, int, bool, item, tolist, cpu: each waits for a GPU) does not grow with the number of micro-batches."""
    s = lopti.ToySettings(prompts=4, group=4)
    net, rule = lopti.toy_warm_start(dataclasses.replace(s, warmup_steps=2))
    batch = lopti.toy_rollout(net, rule, s, torch.Generator().manual_seed(0))
    counts = {}
    for name in ("__float__", "__int__", "__bool__", "item", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def reads(micro_batch_size: int) -> int:
        counts.clear()
        cfg = dataclasses.replace(lopti.toy_config(s, "ar_lopti"), mini_batch_size=8, micro_batch_size=micro_batch_size)
        lopti.update_policy(cfg, functools.partial(lopti.toy_logprobs, net), lopti.make_optimizer(net, cfg),
                            batch)
        return sum(counts.values())

    assert reads(1) == reads(8) > 0, counts  # 8 micro-batches per optimiser step, or 1


def test_peak_memory_gb_cuda_reports_reserved_peak_and_resets(monkeypatch):
    """On CUDA: the allocator's reserved peak (not allocated bytes), reset at each call, so a line is one step's."""
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(device))
    cuda = torch.device("cuda")
    assert lopti.peak_memory_gb(cuda) == 3.0 and lopti.peak_memory_gb(cuda) == 3.0 and calls == [cuda, cuda]


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 4177920 bytes"),
                                   MemoryError(), torch.OutOfMemoryError("CUDA out of memory")])
def test_on_oom_one_line_frees_the_call_and_keeps_its_traceback(error):
    """Out of memory on CPU or GPU: one line naming the phase and the setting; the failed call's tensors are freed
    (no __context__ holds its frames), and the original traceback is the __cause__ (--debug shows it)."""
    held = []

    def failing_phase():
        big = torch.ones(1000)
        held.append(weakref.ref(big))
        raise error

    with pytest.raises(MemoryError) as info:
        lopti._on_oom("update", "--micro_batch_size", failing_phase)
    gc.collect()
    assert held[0]() is None  # the failed call's tensor is gone while the error is alive
    where = "GPU" if isinstance(error, torch.OutOfMemoryError) else "CPU"
    assert str(info.value).startswith(f"out of {where} memory in the update; lower --micro_batch_size, then continue "
                                      "with --resume (the last checkpoint is intact)")
    assert info.value.__cause__ is error and info.value.__suppress_context__
    assert "failing_phase" in "".join(traceback.format_exception(info.value))
    with pytest.raises(RuntimeError, match="not memory"):  # any other error passes through as it is
        lopti._on_oom("update", "--micro_batch_size", lambda: (_ for _ in ()).throw(RuntimeError("not memory")))


def _train(args: list[str], out: Path, limit: int = 0) -> subprocess.CompletedProcess:
    """`lopti.py train` in a child process under an address-space limit (RLIMIT_AS, bytes; 0 = none); its VmPeak
    (KiB) is printed last on stderr."""
    code = ("import atexit, resource, runpy, sys\n"
            f"if {limit}: resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
            "atexit.register(lambda: print('VmPeak', next(l.split()[1] for l in open('/proc/self/status') "
            "if l.startswith('VmPeak')), file=sys.stderr))\n"
            f"sys.argv = ['lopti.py', 'train'] + {args!r}\n"
            f"runpy.run_path({str(ROOT / 'lopti.py')!r}, run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_cpu_out_of_memory_is_one_line_and_the_checkpoint_resumes(tiny_model_dir, tmp_path):
    """A laptop's out-of-memory: step 1 fits; step 2, resumed with 8x the micro-batch under an address-space limit
    between the two runs' needs, stops with one line (the phase, the setting to lower) and exit 2; checkpoint/ still
    holds step 1, and --resume with the old setting completes the run."""
    out = tmp_path / "run"
    base = ["--model", str(tiny_model_dir), "--output_dir", str(out), "--prompts_per_step", "4", "--num_generations",
            "8", "--max_completion_length", "512", "--mini_batch_size", "32", "--micro_batch_size", "4", "--num_train",
            "16", "--num_people", "3", "--eval_size", "2", "--eval_every", "0", "--eval_batch_size", "4", "--beta",
            "0.001", "--save_every", "1", "--seed", "0"]  # beta > 0: every row is scored and updated
    first = _train(base + ["--steps", "1"], out)
    assert first.returncode == 0, first.stderr[-2000:]
    need = int(first.stderr.split("VmPeak")[-1].split()[0]) * 1024
    saved = (out / "checkpoint" / "model.safetensors").read_bytes()
    big = _train(base + ["--steps", "2", "--resume", "--micro_batch_size", "32"], out, limit=need + 150 * 2**20)
    errors = [line for line in big.stderr.splitlines() if line.startswith("lopti.py train:")]
    assert big.returncode == 2 and len(errors) == 1, big.stderr[-3000:]
    assert "out of CPU memory in the " in errors[0] and "lower --micro_batch_size" in errors[0], errors[0]
    assert "the last checkpoint is intact" in errors[0]
    assert (out / "checkpoint" / "model.safetensors").read_bytes() == saved
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)["step"] == 1
    done = _train(base + ["--steps", "2", "--resume"], out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_bf16_diagnose_compares_log_probs_of_one_precision_and_path(tiny_model_dir, tmp_path, monkeypatch):
    """Under bf16 the batch's pi_old comes from the autocast pass, diagnose's forwards are fp32: measure_bins takes
    pi_old from its own forward, so every ratio its gradients see is exactly 1 (it was off by bf16's rounding)."""
    cfg, model, batch = _scored_batch(tiny_model_dir, tmp_path, monkeypatch, True)
    fp32 = functools.partial(lopti.completion_logprobs, model, temperature=cfg.temperature)
    with torch.no_grad():
        assert (fp32(batch) - batch["old_logprobs"])[batch["mask"]].abs().max() > 1e-4  # two precisions
    seen, policy_loss = [], lopti.policy_loss

    def spy(logprobs, old, advantages, mask, **kw):
        seen.append(float((logprobs.detach() - old)[mask.bool()].abs().max()))
        return policy_loss(logprobs, old, advantages, mask, **kw)

    monkeypatch.setattr(lopti, "policy_loss", spy)
    lopti.measure_bins(cfg, model, fp32, batch)
    assert seen and max(seen) == 0.0, seen
