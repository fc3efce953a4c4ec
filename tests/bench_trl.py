"""Time TRL's GRPOTrainer step on the same model, prompts and shapes as tests/bench_step.py times lopti's step.

    python tests/bench_step.py --build-only --model-dir /tmp/smol135           # the model folder, once
    python -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 && \\
        /tmp/trlvenv/bin/pip install trl transformers datasets tqdm accelerate   # throwaway; trl is no dependency
    /tmp/trlvenv/bin/python tests/bench_trl.py --model-dir /tmp/smol135 --betas 0.001,0 --threads 1 --json /tmp/trl.json
    python tests/bench_step.py --model-dir /tmp/smol135 --variants grpo --betas 0.001,0 --threads 1 --json /tmp/lopti.json

Not a test. Each beta runs in its own child process (peak RSS = ru_maxrss of that configuration alone), which
builds a GRPOTrainer exactly as a user would and runs 1 warm-up step plus --steps measured steps; a TrainerCallback
times each step (on_step_begin -> on_step_end: generation, rewards, reference log-probs, forward/backward of both
micro-batches, grad clip, AdamW step), with wall seconds, CPU seconds (os.times user + system) and machine-wide CPU
wait (Linux PSI) per step, as bench_step.py does; a step that waited more than --max-cpu-wait s is re-measured.

What is the same on both sides: the model folder (random SmolLM2-135M-shaped Llama, fp32, SDPA), 3-person K&K rows
from lopti.kk_generate(seed) consumed in order (shuffle_dataset=False), the prompt string lopti.kk_prompt renders
(chat template + "<think>", passed to TRL as a plain string; the child asserts TRL's prompt token ids equal lopti's),
G=4 completions for P=2 prompts = 8 completions and ONE optimiser step per RL step (per_device_train_batch_size=4
x gradient_accumulation_steps=2 = lopti's micro-batch 4 / mini-batch 8), max_completion_length=64 (a random model
never samples EOS; the child logs every completion's length), sampling at T=0.7 with top_k=0, top_p=1, min_p=None,
repetition_penalty=1, beta (a reference model is loaded when beta > 0), lr 1e-6 constant, weight decay 0.01, plain
torch AdamW (optim="adamw_torch", as lopti; TRL's default on torch >= 2.8 is "adamw_torch_fused"), grad clip 1.0,
epsilon 0.2 / epsilon_high 0.24, num_iterations=1, fp32 on CPU (use_cpu=True, bf16=False), no gradient checkpointing
(TRL defaults to bf16=True and gradient_checkpointing=True; both are off here, as in lopti's CPU run), reward
lopti.kk_reward("<think>" + completion, solution), torch threads --threads.
loss_type: "dapo" (TRL's default here): token-mean over the whole generation batch, as lopti's mini-batch token-mean.

Asymmetries, read from TRL 1.16's grpo_trainer.py (check them again for another version):
- pi_old: with num_iterations=1 and steps_per_generation == gradient_accumulation_steps, TRL skips the no-grad
  pi_old forward (old_per_token_logps = per_token_logps.detach(); ratio == 1 exactly). lopti always runs it
  (batched_logprobs(model) after rollout; AR and Lopti need pi_old), so lopti does one no-grad forward over the
  8 sequences that TRL does not. bench_step.py reports it as logprobs_old.
- Log-probs: TRL patches the policy and the reference with a fused, chunked LM head (add_fused_lm_head): no (B, T, V)
  logits. On CPU (no Triton) it scores EVERY position of prompt + completion (labels -100 on the prompt are masked
  after the projection), i.e. ~prompt_len + 64 rows of the 49152-wide LM head per sequence; lopti uses
  logits_to_keep=C+1 (65 rows) and a chunked fp32 log-softmax. The policy's fused head also computes entropy.
- Generation: both call transformers' model.generate on the 8 left-padded prompts in one batch (TRL: no vLLM, no
  continuous batching; disable_compile=True). TRL decodes completions and builds masks, lopti likewise.
- TRL's timed step includes its metric bookkeeping (reward stats, entropy, clip ratios); the Trainer's log call
  runs after on_step_end and is not timed (lopti's bench times train_step, whose metrics are cheap).
- The per-phase split differs: TRL's `update` is the step minus generation+scoring (policy forward/backward of
  both micro-batches, grad clip, AdamW, zero_grad); lopti's pi_old forward has no TRL counterpart.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # lopti.py (the venv has torch, transformers, datasets, tqdm)
from bench_step import cpu_pressure_s, cpu_time_s  # noqa: E402  (the same step accounting as lopti's bench)


def bench_child(args) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback

    import lopti

    if args.threads:
        torch.set_num_threads(args.threads)
    P, G, C = args.prompts, args.generations, args.completion
    n_steps = 1 + args.steps + args.max_extra_steps
    rows = lopti.kk_generate(P * n_steps, 3, seed=args.seed)  # the same rows, in the same order, as bench_step
    tokenizer = lopti.load_tokenizer(str(args.model_dir))
    prompts = [lopti.kk_prompt(tokenizer, q) for q in rows["quiz"]]
    lopti_ids = {p: tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts}
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "solution_text_format": rows["solution_text_format"]})

    def kk_reward(prompts, completions, solution_text_format, **kwargs):
        return [lopti.kk_reward(lopti.THINK_PREFIX + c, s) for c, s in zip(completions, solution_text_format)]

    cfg = trl.GRPOConfig(
        output_dir=str(args.out_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=P * G // args.micro_batch_size,
        num_generations=G, max_completion_length=C, temperature=0.7, top_k=0, top_p=1.0, min_p=None,
        repetition_penalty=1.0, beta=args.beta, epsilon=0.2, epsilon_high=0.24, num_iterations=1, loss_type="dapo",
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, adam_beta1=0.9,
        adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch", max_steps=n_steps, shuffle_dataset=False,
        seed=args.seed, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
    )
    t0 = time.perf_counter()
    trainer = trl.GRPOTrainer(model=str(args.model_dir), reward_funcs=kk_reward, args=cfg, train_dataset=dataset,
                              processing_class=tokenizer)
    load_s = time.perf_counter() - t0
    rss_after_load = lopti.peak_memory_gb(torch.device("cpu"))
    assert trainer.args.generation_batch_size == P * G and not trainer.use_vllm, trainer.args.generation_batch_size

    # Per-phase timers on the trainer's own methods (instance attributes shadow the class's)
    acc: dict[str, float] = {}
    lengths: list[int] = []

    def timed(name, fn, key_fn=None):
        def wrapper(*a, **kw):
            key = key_fn(*a) if key_fn else name
            t, c = time.perf_counter(), cpu_time_s()
            out = fn(*a, **kw)
            acc[f"wall/{key}"] = acc.get(f"wall/{key}", 0.0) + time.perf_counter() - t
            acc[f"cpu/{key}"] = acc.get(f"cpu/{key}", 0.0) + cpu_time_s() - c
            return out
        return wrapper

    gen = trainer._generate_single_turn

    def generate_checked(prompt_ids, *a, **kw):
        texts = [tokenizer.decode(ids) for ids in prompt_ids]  # same ids as lopti tokenises its prompt string?
        assert all(list(ids) == lopti_ids.get(t) for ids, t in zip(prompt_ids, texts)), "prompt tokens differ"
        completion_ids, logprobs = gen(prompt_ids, *a, **kw)
        lengths.extend(len(c) for c in completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = timed("rollout", generate_checked)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprobs", trainer._get_per_token_logps_and_entropies,
        key_fn=lambda model, *a: ("logprobs_ref" if model is trainer.ref_model else "logprobs_policy_nograd")
        if not torch.is_grad_enabled() else "policy_forward")
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            acc.clear()
            lengths.clear()
            self.t, self.c, self.psi = time.perf_counter(), cpu_time_s(), cpu_pressure_s()

        def on_step_end(self, a, state, control, **kw):
            m = {"time/step": time.perf_counter() - self.t, "cpu/step": cpu_time_s() - self.c,
                 "cpu_wait_s": cpu_pressure_s() - self.psi, **acc}
            m["cpu_util"] = m["cpu/step"] / m["time/step"]
            for u in ("wall", "cpu"):  # update = everything after generation+scoring: policy fwd/bwd, clip, AdamW
                m[f"{u}/update"] = m[f"{u if u == 'cpu' else 'time'}/step"] - m[f"{u}/generate_and_score"]
                m[f"{u}/other"] = (m[f"{u}/generate_and_score"] - m[f"{u}/rollout"]
                                   - m.get(f"{u}/logprobs_ref", 0.0) - m.get(f"{u}/logprobs_policy_nograd", 0.0))
            m["completion_lengths"] = list(lengths)
            m["clean"] = m["cpu_wait_s"] <= args.max_cpu_wait
            i = state.global_step - 1
            print(f"  [trl beta={args.beta}] step {i}{' (warm-up)' if i == 0 else ''}: {m['time/step']:.2f} s "
                  f"(cpu {m['cpu/step']:.2f} s, cpu_wait {m['cpu_wait_s']:.1f} s) completion lengths {lengths}"
                  f"{'' if m['clean'] or i == 0 else ' CONTENDED'}", file=sys.stderr, flush=True)
            if i > 0:
                steps.append(m)
            if sum(s["clean"] for s in steps) >= args.steps:
                control.should_training_stop = True

    trainer.add_callback(StepTimer())
    trainer.train()
    assert all(s["completion_lengths"] == [C] * (P * G) for s in steps), "TRL did not generate P*G x C tokens"
    clean = [s for s in steps if s["clean"]]
    used = clean or steps
    keys = [k for k in used[0] if isinstance(used[0][k], float)]
    mean = {k: sum(s.get(k, 0.0) for s in used) / len(used) for k in keys}
    mean.update(step_times=[s["time/step"] for s in steps], cpu_wait_per_step=[s["cpu_wait_s"] for s in steps],
                completion_lengths=[s["completion_lengths"] for s in steps], clean_steps=len(clean),
                peak_memory_gb=lopti.peak_memory_gb(torch.device("cpu")), rss_after_load_gb=rss_after_load, load_s=load_s, beta=args.beta,
                threads=torch.get_num_threads(), prompts=P, generations=G, max_completion_length=C,
                micro_batch_size=args.micro_batch_size, loss_type=cfg.loss_type, optim=str(cfg.optim),
                prompt_tokens_mean=sum(len(v) for v in lopti_ids.values()) / len(lopti_ids),
                versions={m.__name__: m.__version__ for m in (torch, transformers, trl, datasets)})
    return mean


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="folder from bench_step.py --build-only")
    p.add_argument("--betas", default="0.001,0")
    p.add_argument("--steps", type=int, default=2, help="measured steps after 1 warm-up step")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--max-cpu-wait", type=float, default=2.0)
    p.add_argument("--max-extra-steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--beta", type=float, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.child_out.write_text(json.dumps(bench_child(args)))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        for beta in (float(b) for b in args.betas.split(",")):
            out = Path(tmp) / f"trl_{beta}.json"
            cmd = [sys.executable, __file__, "--child", "--beta", str(beta), "--child-out", str(out),
                   "--out-dir", str(Path(tmp) / "out"), "--model-dir", str(args.model_dir)]
            for k in ("steps", "prompts", "generations", "completion", "micro_batch_size", "threads",
                      "max_cpu_wait", "max_extra_steps", "seed"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            subprocess.run(cmd, check=True)
            results.append(json.loads(out.read_text()))
    r0 = results[0]
    print(f"\nTRL GRPOTrainer, {r0['versions']}, {r0['threads']} threads; P={args.prompts} x G={args.generations}, "
          f"max_completion_length={args.completion}, micro-batch {args.micro_batch_size}, loss_type {r0['loss_type']}, "
          f"{r0['optim']}; mean of up to {args.steps} clean step(s) after 1 warm-up\n")
    cols = ["beta", "rollout", "ref", "other", "update", "step_s", "cpu_step_s", "cores", "peak_GB", "compl_len",
            "cpu_wait", "clean"]
    print(" | ".join(cols))
    for r in results:
        lens = [x for s in r["completion_lengths"] for x in s]
        print(" | ".join([f"{r['beta']:g}", f"{r['wall/rollout']:.2f}", f"{r.get('wall/logprobs_ref', 0.0):.2f}",
                          f"{r['wall/other']:.2f}", f"{r['wall/update']:.2f}", f"{r['time/step']:.2f}",
                          f"{r['cpu/step']:.2f}", f"{r['cpu_util']:.2f}", f"{r['peak_memory_gb']:.2f}",
                          f"{sum(lens) / max(len(lens), 1):.1f}", f"{r['cpu_wait_s']:.1f}",
                          f"{r['clean_steps']}/{len(r['step_times'])}"]))
    print("CPU seconds per phase: " + "; ".join(
        f"beta {r['beta']:g}: " + ", ".join(f"{k[4:]} {v:.2f}" for k, v in r.items() if k.startswith("cpu/"))
        for r in results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
