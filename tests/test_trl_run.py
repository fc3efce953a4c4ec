"""`train --engine trl` as a whole run: evaluation, --resume (against an uninterrupted run), a signal in the last step,
stop_at_answer, the vLLM arguments, the native trainer's metric names, and a stop of `accelerate launch` (2 CPU
processes) that saves before any process exits and resumes."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
from conftest import tiny_config, varied_reward  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import lopti  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)
RUN = dict(num_people="2", num_train=16, prompts_per_step=2, num_generations=4, max_completion_length=8,
           mini_batch_size=8, micro_batch_size=2, beta=0.001, learning_rate=1e-3, stop_at_answer=False, save_every=0,
           eval_size=2, eval_every=0, eval_batch_size=2)  # Lopti: 2 optimiser steps per RL step


def cfg_for(model_dir, out, **kw):
    return tiny_config(model_dir, out, **{**RUN, **kw})


def sigterm_at_reward(monkeypatch, calls: int):
    """The reward (varied_reward) sends this process SIGTERM on its `calls`-th call: during that RL step."""
    seen = []

    def reward(text, solution):
        seen.append(1)
        if len(seen) == calls * RUN["prompts_per_step"] * RUN["num_generations"]:  # the step's last row
            os.kill(os.getpid(), signal.SIGTERM)
        return varied_reward(text, solution)
    monkeypatch.setattr(lopti, "kk_reward", reward)


def weights(run: Path) -> dict:
    return load_file(run / "checkpoint" / "model.safetensors")


def lines(run: Path) -> list[dict]:
    return lopti.read_jsonl(run / "metrics.jsonl")


def test_resume_after_a_stop_continues_as_the_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    """4 RL steps at once, against SIGTERM in step 3 (the run saves after it: checkpoint-6), --resume to 4; the
    settings check refuses a changed alpha in one line before anything is written; eval at eval_every."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    lopti.train_trl(cfg_for(tiny_model_dir, tmp_path / "whole", steps=4, eval_every=2))
    sigterm_at_reward(monkeypatch, calls=3)
    cfg = cfg_for(tiny_model_dir, tmp_path / "parts", steps=4, eval_every=2)
    with pytest.raises(lopti.Stopped, match="stopped after RL step 3"):
        lopti.train_trl(cfg)
    assert (tmp_path / "parts" / "checkpoint-6" / "optimizer.pt").is_file() and len(lines(tmp_path / "parts")) == 3
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "parts").rglob("*")}
    with pytest.raises(ValueError, match=r"alpha 0.3 -> 0.2"):
        lopti.train_trl(cfg_for(tiny_model_dir, tmp_path / "parts", steps=4, alpha=0.2), resume=True)
    moved = shutil.copytree(tiny_model_dir, tmp_path / "moved")
    for change in (dict(learning_rate=1e-4), dict(model=str(moved))):  # the native engine's may change; TRL
        with pytest.raises(ValueError, match=f"{next(iter(change))} .* -> "):  # restores its own from checkpoint-N/
            lopti.train_trl(cfg_for(tiny_model_dir, tmp_path / "parts", steps=4, **change), resume=True)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "parts").rglob("*")} == before  # nothing written
    with pytest.raises(ValueError, match="resume it with --engine trl"):  # the native engine refuses a TRL run
        lopti.train(cfg, resume=True)
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    lopti.train_trl(cfg, resume=True)
    whole, parts = lines(tmp_path / "whole"), lines(tmp_path / "parts")
    assert [m["step"] for m in parts] == [1, 2, 3, 4] and ["eval/accuracy" in m for m in parts] == [0, 1, 0, 1]
    for a, b in zip(whole, parts):  # the same samples, rewards and updates: TRL restores the RNG exactly
        assert a["reward"] == b["reward"] and a["low/loss"] == pytest.approx(b["low/loss"], abs=1e-6)
    w, p, w0 = weights(tmp_path / "whole"), weights(tmp_path / "parts"), load_file(tiny_model_dir / "model.safetensors")
    assert max(float((w[k] - w0[k]).abs().max()) for k in w) > 1e-3  # the runs learned
    assert max(float((w[k] - p[k]).abs().max()) for k in w) == 0.0  # bit-equal


def test_a_signal_in_the_last_step_leaves_a_run_that_resume_completes(tiny_model_dir, tmp_path, monkeypatch):
    """SIGTERM in the last RL step: saved without the final evaluation; --resume runs no step, only that evaluation."""
    sigterm_at_reward(monkeypatch, calls=2)
    cfg = cfg_for(tiny_model_dir, tmp_path / "run", steps=2)
    with pytest.raises(lopti.Stopped, match="stopped after RL step 2"):
        lopti.train_trl(cfg)
    assert "eval/accuracy" not in lines(tmp_path / "run")[-1] and (tmp_path / "run" / "checkpoint-4").is_dir()
    lopti.train_trl(cfg, resume=True)
    assert [m["step"] for m in lines(tmp_path / "run")] == [1, 2] and "eval/accuracy_2ppl" in lines(tmp_path / "run")[-1]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-4"]  # save_total_limit 1


def test_stop_at_answer_ends_the_completion_and_its_loss_mask(tiny_model_dir, tmp_path, monkeypatch):
    """TRL's generation returns completions running past '</answer>'; the trainer cuts each at the token that
    completes it, so the text scored and the completion_mask of the loss end there (rows without it are kept)."""
    tokenizer = lopti.load_tokenizer(str(tiny_model_dir))
    texts = ["<answer> (1) Zoey is a knight </answer> Zoey Zoey", "Zoey is a knave", "</answer></answer> knight"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", lambda self, p, *a, **k: (
        [ids[i % 3] for i in range(len(p))], None))
    seen, real = [], lopti.LoptiGRPOTrainer._generate_and_score_completions
    monkeypatch.setattr(lopti.LoptiGRPOTrainer, "_generate_and_score_completions",
                        lambda self, inputs: seen.append(real(self, inputs)) or seen[-1])
    scored = []
    monkeypatch.setattr(lopti, "kk_rewards", lambda c, s, f=0.0: scored.extend(c) or (torch.zeros(len(c)),) * 2)
    lopti.train_trl(cfg_for(tiny_model_dir, tmp_path / "run", steps=1, stop_at_answer=True))
    want = [t[: t.index("</answer>") + 9] if "</answer>" in t else t for t in texts]
    assert scored[:3] == want
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in want]  # (the tags are tokens)
    assert seen[0]["completion_mask"].sum(1).tolist() == [lengths[i % 3] for i in range(8)]
    assert lopti._trl_args(cfg_for(tiny_model_dir, tmp_path / "x", stop_at_answer=True))[0].generation_kwargs == {
        "stop_strings": ["</answer>"]}  # HF generate stops there too (train_trl above passed it the tokenizer)


def test_vllm_arguments_sample_from_pi_old(tiny_model_dir, tmp_path):
    cfg = cfg_for(tiny_model_dir, tmp_path, temperature=0.9, stop_at_answer=True)
    for mode in ("colocate", "server"):
        args, per_step = lopti._trl_args(cfg, mode, save_total_limit=0)
        assert (args.use_vllm, args.vllm_mode, args.vllm_importance_sampling_correction) == (True, mode, False)
        assert (args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty) == (0.9, 0, 1.0, None, 1.0)
        assert args.generation_kwargs == {"stop": ["</answer>"], "include_stop_str_in_output": True}
        assert args.save_total_limit is None and per_step == 2 and args.max_steps == 2 * cfg.steps
    args = lopti._trl_args(cfg)[0]
    assert not args.use_vllm and args.save_total_limit == 1
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction"):  # its loss would drop TRL's factor
        lopti.LoptiGRPOTrainer(str(tiny_model_dir), varied_reward, args=trl.GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, loss_type="dapo",
            vllm_importance_sampling_correction=True))
    done = subprocess.run([sys.executable, str(ROOT / "lopti.py"), "train", "--vllm", "server"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.returncode == 2 and "--vllm and --save_total_limit need --engine trl" in done.stderr


def test_both_engines_log_the_same_names(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    lopti.train(cfg_for(tiny_model_dir, tmp_path / "native", steps=1, format_reward=1.0))
    lopti.train_trl(cfg_for(tiny_model_dir, tmp_path / "trl", steps=1, format_reward=1.0))
    native, trl_line = lines(tmp_path / "native")[0], lines(tmp_path / "trl")[0]
    shared = {"step", "reward", "accuracy", "format_error", "zero_std_groups",
              "completion_length", "truncated", "learning_rate", "ar_weight", "low/token_share", "high/token_share",
              "low/loss", "high/loss", "low/grad_norm", "high/grad_norm", "eval/accuracy", "eval/accuracy_2ppl",
              "eval/reward_2ppl", "time/rollout", "time/logprobs", "peak_memory_gb"}
    assert shared <= native.keys() and shared <= trl_line.keys()
    for k in ("reward", "accuracy", "format_error"):  # (not the same samples: both draw from the same model)
        assert -3 <= trl_line[k] <= 4 and trl_line[k] is not None


def output_of(proc) -> str:
    proc.kill()
    return proc.communicate()[0][-3000:]


def launch(model_dir, out: Path, *extra, **kw) -> subprocess.Popen:
    flags = [f"--{k}={v}" for k, v in {**RUN, "steps": 6, "model": model_dir, "output_dir": out, **kw}.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "lopti.py"),
           "train", "--engine", "trl", *flags, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out.parent,
                            start_new_session=True)


def test_sigterm_to_accelerate_launch_saves_on_every_rank_and_resumes(tiny_model_dir, tmp_path):
    """SIGTERM during an RL step as SLURM sends it: to each worker and to the launcher, which sends the workers
    another one at once: both ranks finish the step, checkpoint-N/ and checkpoint/ are complete before
    any rank exits, and --resume (2 processes again) runs the remaining steps."""
    run = tmp_path / "run"
    proc = launch(tiny_model_dir, run)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").is_file() and lines(run)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, output_of(proc)
    for pid in [*workers, proc.pid]:  # SLURM's SIGTERM reaches each worker, then the launcher sends them another
        os.kill(int(pid), signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and output.count("and saved it") == 2, output[-3000:]
    assert "sent twice" not in output, output[-3000:]
    steps = [m["step"] for m in lines(run)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 6
    ckpt = run / f"checkpoint-{2 * len(steps)}"
    assert {"optimizer.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= {
        p.name for p in ckpt.iterdir()}, output[-3000:]
    assert {"config.json", "model.safetensors"} <= {p.name for p in (run / "checkpoint").iterdir()}
    proc = launch(tiny_model_dir, run, "--resume")
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert [m["step"] for m in lines(run)] == list(range(1, 7)) and "eval/accuracy" in lines(run)[-1]


def test_the_same_signal_again_within_5_s_is_one_signal(tmp_path, monkeypatch):
    stop, now = {}, [100.0]
    monkeypatch.setattr(lopti.time, "monotonic", lambda: now[0])
    with lopti._run_guard(tmp_path, stop):
        for _ in range(2):  # SLURM's SIGTERM, then the launcher's
            os.kill(os.getpid(), signal.SIGTERM)
        now[0] += 4.9
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop["signum"] == signal.SIGTERM
        with pytest.raises(lopti.Stopped, match="SIGINT: sent twice"):  # another signal: at once
            os.kill(os.getpid(), signal.SIGINT)
        now[0] += 0.2
        with pytest.raises(lopti.Stopped, match="SIGTERM: sent twice"):  # 5.1 s later: a second signal
            os.kill(os.getpid(), signal.SIGTERM)
