"""LoptiGRPOTrainer (TRL) against update_policy: on the same generated batch one RL step gives the same weights for
GRPO, AR, Lopti and AR+Lopti with gradient accumulation; with alpha = 0 and Lopti off it is trl.GRPOTrainer; and
train_trl runs K&K in one process and under `accelerate launch` (2 CPU processes)."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

trl = pytest.importorskip("trl")
from conftest import make_tiny_model  # noqa: E402

import lopti  # noqa: E402
from lopti import _lopti_grpo_trainer_class, train_trl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

torch.set_num_threads(1)
P, G, MICRO, T, TEMP = 2, 4, 2, 12, 0.7  # 8 completions, 4 micro-batches of 2 per optimiser step, <= 12 tokens


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory) -> Path:
    """conftest's tiny model, its (tied) embeddings x3.5 so that pi_old spreads over (0, 1) and Lopti's split has
    tokens on both sides, and a tenth of the vocabulary as extra EOS ids so completions differ in length."""
    path = make_tiny_model(tmp_path_factory.mktemp("sharp"))
    model, tokenizer = lopti.load_model(str(path), torch.device("cpu")), lopti.load_tokenizer(str(path))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.5)
    model.generation_config.eos_token_id += list(range(3, len(tokenizer), 10))  # lengths vary
    model.save_pretrained(path)
    return path


def vowel_share(completions, **_):  # a reward with variance inside every group of a random model
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def grpo_args(out: Path, **kw):
    """A GRPOConfig with lopti's update settings: AdamW 0.9/0.999/1e-8, constant LR, token-mean ("dapo")."""
    return trl.GRPOConfig(**{
        "output_dir": str(out), "use_cpu": True, "bf16": False, "gradient_checkpointing": False, "seed": 0,
        "max_steps": 1, "per_device_train_batch_size": MICRO, "gradient_accumulation_steps": P * G // MICRO,
        "num_generations": G, "max_completion_length": T, "temperature": TEMP, "top_k": 0, "top_p": 1.0,
        "min_p": None, "repetition_penalty": 1.0, "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.24,
        "learning_rate": 1e-3, "lr_scheduler_type": "constant", "weight_decay": 0.1, "max_grad_norm": 1.0,
        "optim": "adamw_torch", "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "report_to": "none",
        "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True, "model_init_kwargs": {"dtype": torch.float32},
        **kw})


def run_trainer(cls, model_dir: Path, args, **knobs):
    """One RL step; returns the trainer and the generated batch as TRL made it (before AR), plus pi_old/ref."""
    data = datasets.Dataset.from_dict({"prompt": ["Hello there", "A very special island"]})
    trainer = cls(str(model_dir), vowel_share, args=args, train_dataset=data,
                  processing_class=lopti.load_tokenizer(str(model_dir)), **knobs)
    seen, parent = [], trl.GRPOTrainer._generate_and_score_completions

    def capture(inputs):
        raw = parent(trainer, inputs)
        seen.append(dict(raw))  # TRL's own fields, before LoptiGRPOTrainer replaces the advantages
        return raw

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trl.GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: capture(inputs))
        trainer.train()
    assert len(seen) == 1, "one generation per RL step"
    return trainer, seen[0]


def update_policy_step(model_dir: Path, trainer, raw: dict, cfg: lopti.Config, optim: str):
    """lopti.update_policy on the trainer's batch, from the initial weights, with the trainer's AdamW groups."""
    model = lopti.load_model(str(model_dir), torch.device("cpu"))
    decay = set(trainer.get_decay_parameter_names(model))
    groups = [{"params": [p for n, p in model.named_parameters() if (n in decay) == d], "weight_decay": wd}
              for d, wd in ((True, cfg.weight_decay), (False, 0.0))]
    optimizer = (torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8)
                 if optim == "adamw_torch" else torch.optim.SGD(groups, lr=cfg.learning_rate))
    batch = {"input_ids": torch.cat([raw["prompt_ids"], raw["completion_ids"]], 1),
             "attention_mask": torch.cat([raw["prompt_mask"], raw["completion_mask"]], 1),
             "mask": raw["completion_mask"].bool(), "advantages": raw["advantages"]}
    C = batch["mask"].shape[1]
    logprob_fn = lambda mb: lopti.sequence_logprobs(model, mb["input_ids"], mb["attention_mask"], C,  # noqa: E731
                                                    cfg.temperature)
    with torch.no_grad():
        batch["old_logprobs"] = logprob_fn(batch)  # (B, C) pi_old at the sampling temperature
    if "old_per_token_logps" in raw:  # TRL's pi_old (Lopti) is lopti's: the same temperature, the same tokens
        torch.testing.assert_close(raw["old_per_token_logps"][batch["mask"]], batch["old_logprobs"][batch["mask"]],
                                   atol=1e-5, rtol=0)
        batch["old_logprobs"] = raw["old_per_token_logps"]
    if "ref_per_token_logps" in raw:
        batch["ref_logprobs"] = raw["ref_per_token_logps"]
    stats = lopti.update_policy(cfg, logprob_fn, optimizer, batch)
    return dict(model.named_parameters()), stats


def logged(trainer) -> dict:
    """Each metric TRL logged during the run, averaged over the optimiser steps that logged it."""
    values = {}
    for entry in trainer.state.log_history:
        for k, v in entry.items():
            values.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in values.items() if all(isinstance(x, float) for x in v)}


METHODS = {"grpo": dict(alpha=0.0, lopti=False), "ar": dict(alpha=0.3, lopti=False),
           "lopti": dict(alpha=0.0, lopti=True), "ar_lopti": dict(alpha=0.3, lopti=True, beta=0.05),
           "lopti_high_first": dict(alpha=0.0, lopti=True, lopti_order="high_first"),
           "ar_lopti_2_epochs": dict(alpha=0.3, lopti=True, num_iterations=2)}  # replays: low, low, high, high


def distance(a: dict, b: dict, initial: dict) -> float:
    """|a - b| / |a - initial| over all parameters. AdamW's first steps divide each gradient by its own size, which
    turns float rounding in a near-zero gradient into a visible difference of that one weight: compare norms."""
    return (sum(float((a[n] - b[n]).detach().square().sum()) for n in b) / sum(
        float((a[n] - initial[n]).detach().square().sum()) for n in b)) ** 0.5


@pytest.mark.parametrize("method,optim", [(m, "adamw_torch") for m in METHODS] + [("ar_lopti", "sgd")])
def test_one_rl_step_matches_update_policy(method, optim, sharp_model_dir, tmp_path):
    knobs = dict(METHODS[method])
    beta, epochs = knobs.pop("beta", 0.0), knobs.pop("num_iterations", 1)
    knobs = {"eta": 0.3, "lopti_order": "low_first", "dual_clip": 10.0, **knobs}
    lr, steps = 1e-3 if optim == "adamw_torch" else 0.3, (2 if knobs["lopti"] else 1) * epochs
    args = grpo_args(tmp_path, beta=beta, num_iterations=epochs, max_steps=steps, optim=optim, learning_rate=lr)
    trainer, raw = run_trainer(_lopti_grpo_trainer_class(), sharp_model_dir, args, **knobs)
    mask = raw["completion_mask"].bool()
    assert len(set(mask.sum(1).tolist())) > 1 and raw["advantages"].abs().min() > 0  # lengths vary, no zero row
    cfg = lopti.Config(**knobs, beta=beta, epsilon=0.2, epsilon_high=0.24, learning_rate=lr, weight_decay=0.1,
                       max_grad_norm=1.0, temperature=TEMP, mini_batch_size=P * G, micro_batch_size=MICRO,
                       num_iterations=epochs)
    if cfg.lopti:  # both stages hold tokens, so update_policy takes an optimiser step in each, as TRL does
        low, high = lopti.lopti_masks(raw["old_per_token_logps"], mask, cfg.eta)
        assert low.any() and high.any()
    initial = dict(lopti.load_model(str(sharp_model_dir), torch.device("cpu")).named_parameters())
    params, stats = update_policy_step(sharp_model_dir, trainer, raw, cfg, optim)
    got = dict(trainer.model.named_parameters())
    other, _ = update_policy_step(sharp_model_dir, trainer, raw, dataclasses.replace(cfg, alpha=0.3 - cfg.alpha), optim)
    assert distance(got, params, initial) < (1e-3 if optim == "adamw_torch" else 1e-5)
    assert distance(got, other, initial) > 1e-2  # the comparison discriminates: AR on/off is far away
    # the losses are scale-sensitive (one AdamW step is not): same token-mean denominator, same stages
    logs, stages = logged(trainer), ["low", "high"] if cfg.lopti else ["all"]
    for name in stages:
        assert logs[f"{name}/loss"] == pytest.approx(stats[f"{name}/loss"], rel=1e-4, abs=1e-7), name
        assert logs[f"{name}/token_share"] == pytest.approx(stats[f"{name}/token_share"], rel=1e-6)
    assert logs["ar_weight"] == pytest.approx(stats["ar_weight"], rel=1e-6)
    assert (logs["ar_weight"] < 0.99) == (cfg.alpha > 0)
    assert trainer.state.global_step == steps  # Lopti: twice the optimiser steps per generation batch


@pytest.mark.parametrize("batching", [{}, dict(gradient_accumulation_steps=2, steps_per_generation=4, max_steps=2)])
def test_alpha_zero_without_lopti_is_trl_grpo(batching, sharp_model_dir, tmp_path):
    """Also with two optimiser steps per generation batch, where TRL's normaliser is the mean mini-batch's count."""
    ours, raw_ours = run_trainer(_lopti_grpo_trainer_class(), sharp_model_dir, grpo_args(tmp_path / "a", **batching),
                                 alpha=0.0, lopti=False)
    theirs, raw_theirs = run_trainer(trl.GRPOTrainer, sharp_model_dir, grpo_args(tmp_path / "b", **batching))
    assert torch.equal(raw_ours["completion_ids"], raw_theirs["completion_ids"])  # the same batch
    initial = dict(lopti.load_model(str(sharp_model_dir), torch.device("cpu")).named_parameters())
    params = [dict(t.model.named_parameters()) for t in (ours, theirs)]
    assert distance(*params, initial) < 1e-4
    # the loss of each optimiser step (scale-sensitive, unlike AdamW's first steps): the same normaliser
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (ours, theirs)]
    assert len(losses[0]) == batching.get("max_steps", 1) and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_lopti_trainer_is_lazy_and_checks_its_knobs(sharp_model_dir, tmp_path):
    code = "import sys, lopti; sys.exit('trl' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0  # import lopti imports no TRL
    cls = _lopti_grpo_trainer_class()
    assert cls is lopti.LoptiGRPOTrainer is _lopti_grpo_trainer_class() and issubclass(cls, trl.GRPOTrainer)
    with pytest.raises(ValueError, match="dapo"):
        cls(str(sharp_model_dir), vowel_share, args=grpo_args(tmp_path, loss_type="grpo"))
    with pytest.raises(ValueError, match="eta"):
        cls(str(sharp_model_dir), vowel_share, args=grpo_args(tmp_path), eta=0.0)
    for setting in (dict(importance_sampling_level="sequence"), dict(top_entropy_quantile=0.5), dict(delta=2.0)):
        with pytest.raises(ValueError, match=next(iter(setting))):  # a TRL option its loss would silently drop
            cls(str(sharp_model_dir), vowel_share, args=grpo_args(tmp_path, **setting))
    with pytest.raises(ValueError, match="steps_per_generation"):  # an optimiser step would span both stages
        cls(str(sharp_model_dir), vowel_share, args=grpo_args(tmp_path, steps_per_generation=6))


KK = dict(num_people="2", num_train=8, prompts_per_step=2, num_generations=2, max_completion_length=8,
          mini_batch_size=4, micro_batch_size=1, steps=2, beta=0.001, learning_rate=1e-4, format_reward=1.0,
          stop_at_answer=False, save_every=0, eval_size=1)
KEYS = {"step", "reward", "accuracy", "format_error", "ar_weight", "low/token_share", "high/token_share", "low/loss",
        "high/loss"}


def check_metrics(out: Path):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert KEYS <= m.keys() and m["low/token_share"] + m["high/token_share"] == pytest.approx(1.0)
        assert all(m[k] is not None for k in KEYS) and m["format_error"] == 1.0 and m["accuracy"] == 0.0
    assert (out / "checkpoint" / "config.json").is_file() and json.loads((out / "config.json").read_text())["lopti"]


def test_train_trl_writes_one_metrics_line_per_rl_step(sharp_model_dir, tmp_path):
    cfg = lopti.Config(model=str(sharp_model_dir), output_dir=str(tmp_path / "run"), **{**KK, "stop_at_answer": True})
    train_trl(cfg)
    check_metrics(tmp_path / "run")
    with pytest.raises(FileExistsError):
        train_trl(cfg)


def test_train_trl_on_sigterm_finishes_the_rl_step_and_saves(sharp_model_dir, tmp_path, monkeypatch):
    """SIGTERM during RL step 1 of 3: TRL stops at the end of the step (its optimiser steps all taken), saves
    checkpoint/ and TRL's own checkpoint-2/ (with the optimiser), and Stopped carries the signal."""
    def mine(*a):
        pytest.fail("SIGTERM reached the handler that train_trl replaces")

    real_reward, sent = lopti.kk_reward, []

    def reward(*args):  # the first reward is computed during RL step 1: the scheduler's SIGTERM arrives then
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return real_reward(*args)

    monkeypatch.setattr(lopti, "kk_reward", reward)
    before = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(lopti.Stopped, match="SIGTERM: stopped after RL step 1") as stopped:
            train_trl(lopti.Config(model=str(sharp_model_dir), output_dir=str(tmp_path / "run"), **{**KK, "steps": 3}))
        assert stopped.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
    assert [m["step"] for m in lopti.read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]
    assert (tmp_path / "run" / "checkpoint" / "config.json").is_file()
    assert (tmp_path / "run" / "checkpoint-2" / "optimizer.pt").is_file()  # 2 optimiser steps per RL step (Lopti)


def test_train_trl_under_accelerate_launch_on_two_cpu_processes(sharp_model_dir, tmp_path):
    """`python lopti.py train --engine trl` under accelerate, 2 CPU processes (DDP over gloo). accelerate 1.16's
    `launch --cpu --num_processes 2` starts ONE process (several need --mpirun_hostfile); two CPU processes are
    `launch --multi_gpu` (torchrun) with ACCELERATE_USE_CPU=1, which the Trainer's arguments read."""
    flags = [f"--{k}={v}" for k, v in {**KK, "model": sharp_model_dir, "output_dir": tmp_path / "run"}.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "lopti.py"),
           "train", "--engine", "trl", *flags]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done: ") == 2 and "2 processes" in done.stdout  # both ranks ran main() to the end
    check_metrics(tmp_path / "run")
