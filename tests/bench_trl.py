"""Time an RL step through TRL's GRPOTrainer (plain, or lopti's LoptiGRPOTrainer = `lopti.py train --engine trl`) on
the same model, prompts and shapes as tests/bench_step.py times lopti's native step; --compare-native times both.

    python tests/bench_step.py --build-only --model-dir /tmp/smol135        # a random SmolLM2-135M-shaped folder, once
    pip install trl==1.16.0                                                 # optional dependency of lopti.py
    # native engine vs --engine trl in ONE invocation (two child processes per beta, one after the other):
    python tests/bench_trl.py --model-dir /tmp/smol135 --compare-native --trainer lopti --variant ar_lopti \\
        --betas 0.001 --threads 1 --steps 2 --json /tmp/native_vs_trl.json
    # real weights (e.g. SmolLM2-135M-Instruct saved with save_pretrained), the `cpu` preset's shapes: 2-person
    # puzzles, P=4 x G=8, 128 tokens, micro-batch 8, beta 0; Lopti split at eta (a real pi_old is not ~1/V)
    python tests/bench_trl.py --model-dir ./smol135 --compare-native --trainer lopti --variant ar_lopti --preset cpu \\
        --people 2 --prompts 4 --generations 8 --completion 128 --micro-batch-size 8 --betas 0 --split eta --threads 1
    # TRL only: plain trl.GRPOTrainer (the README's "Against TRL" table compares it with bench_step --variants grpo)
    python tests/bench_trl.py --model-dir /tmp/smol135 --betas 0.001,0 --threads 1 --json /tmp/trl.json

Not a test. Each measured configuration runs in its own child process, so its peak RSS (ru_maxrss, lopti's
`peak_memory_gb`) is its own: with --compare-native, bench_step.py's child (lopti.train_step, exactly as bench_step.py
runs it, with the same variant, shapes, seed, preset and --split) and then this file's child, for each beta. A TRL
child builds the trainer as a user would (--trainer grpo: trl.GRPOTrainer from the model folder; --trainer lopti:
lopti.LoptiGRPOTrainer on lopti.load_model's model with lopti.make_optimizer's AdamW, as train_trl does) and runs
1 warm-up RL step plus --steps measured ones. An RL step is one generation batch and its update passes: one
optimiser step for GRPO, two for Lopti (the trainer doubles TRL's num_iterations). A TrainerCallback times it from
on_step_begin of the optimiser step that generates to on_step_end of its last pass (with Lopti this includes the
Trainer.log call between the two passes, a few milliseconds; the log after the last pass is not timed, as nothing
after lopti.train_step is on the native side). Per phase: rollout (_generate_single_turn), pi_old and reference
(_get_per_token_logps_and_entropies without grad, on the policy or on the reference), update = each pass's optimiser
step minus generation and scoring (forward/backward of the micro-batches, grad clip, AdamW), other = the rest
(tokenising, reward, advantages, AR, Lopti's masks, metrics). Completion lengths (up to and including EOS) are
recorded per step, on both sides: real weights end most completions early, and so may a random model.
Each step records wall and CPU seconds and machine-wide CPU wait (Linux PSI), as bench_step.py does; a step that
waited more than --max-cpu-wait s is re-measured (up to --max-extra-steps more).

What is the same on both sides: the model folder (fp32, SDPA, dropout off), K&K rows from
lopti.kk_generate(n, --people, seed) consumed in order (shuffle_dataset=False; the child asserts that each RL step's
prompt token ids equal lopti's for the same rows, G copies each), the prompt lopti.kk_prompt renders (chat template
+ "<think>", passed to TRL as a plain string), P prompts x G completions, max_completion_length C, micro-batch
(per_device_train_batch_size) and one mini-batch = P*G rows per pass (gradient_accumulation_steps = P*G/micro-batch),
sampling at lopti's temperature with top_k=0, top_p=1, min_p=None, repetition_penalty=1, and every other knob from
the lopti.Config that bench_step.py builds (--preset, then the variant's alpha/lopti, then the shapes): lr (constant),
weight decay, epsilon/epsilon_high, grad clip, beta (a reference model iff beta > 0), the reward (lopti.kk_reward on
"<think>" + completion, plus format_reward x kk_format_credit, as train_step and train_trl), eta and, with --split
median, lopti_masks patched to split at each step's median pi_old as bench_step.py does (random weights: pi_old is
~1/V everywhere, so at eta every token is "low"); fp32 on CPU (use_cpu, no bf16), no gradient checkpointing,
loss_type "dapo" (token-mean over the mini-batch, as update_policy), torch threads --threads. The optimiser: with
--trainer lopti, lopti.make_optimizer (torch AdamW, decay on every weight), the same object as the native side; with
--trainer grpo, TRL's optim="adamw_torch" (no decay on biases and norms; TRL's default on torch >= 2.8 is the fused
AdamW). The same seed, but not the same samples: the two sides draw their random numbers in different orders, so
with real weights their completion lengths (and with them the step times) differ from step to step; compare the
compl_len columns, and measure several steps.

Asymmetries, read from TRL 1.16's grpo_trainer.py and trainer/utils.py (check them again for another version);
they are what the engines do, not the benchmark's choice:
- pi_old: GRPO (num_iterations=1, steps_per_generation == gradient_accumulation_steps): TRL skips the no-grad pi_old
  forward (old_per_token_logps = per_token_logps.detach(), ratio 1) and LoptiGRPOTrainer with alpha=0 too; lopti
  always runs it. AR + Lopti: with num_iterations doubled, gradient_accumulation_steps is no multiple of TRL's
  generate_every = num_iterations x steps_per_generation, so TRL computes pi_old itself, as lopti does.
- Shared prompts: lopti runs a group's prompt once (prefix_cache) in rollout, pi_old, reference and update, and
  indexes its KV cache for the G rows; TRL runs every row's prompt (the prefill in generate and every log-prob
  forward). bench_step's --no-prefix-sharing, passed through by --no-prefix-sharing here, makes the native side run
  each row's prompt too.
- Log-probs: TRL patches the policy and the reference with a fused, chunked LM head (add_fused_lm_head). On CPU (no
  Triton) it projects EVERY position of prompt + completion through the vocabulary-wide head (prompt labels are
  masked after the projection), and the policy's head also computes the entropy; lopti projects the C + 1
  positions it needs (logits_to_keep) and takes a chunked fp32 log-softmax. On a Triton GPU TRL projects only the
  completion: CPU ratios do not carry over to GPUs.
- Rows without a gradient: with beta = 0, lopti skips the rows whose advantage is 0 (every row of a group with
  equal rewards: no pi_old, no forward or backward), a row with no token of a Lopti pass, and the optimiser step of
  an empty pass; TRL computes every row and steps anyway. With random weights every reward is equal, so at beta = 0
  the native update does nothing at all: compare at beta > 0 there, or on real weights.
- stop_at_answer (the cpu preset's): lopti ends completions at "</answer>"; TRL 1.16 passes no tokenizer to
  generate and ends them at EOS only (train_trl warns), so real-weight completions can be longer on the TRL side
  (and their rewards differ). The tables show each side's mean completion length.
- --split median with beta = 0 (real weights; use --split eta there): lopti's pi_old of a skipped row is 0 (prob 1),
  which enters the median; TRL has pi_old for every row.
- Bookkeeping: TRL's timed step includes its metrics (reward stats, entropy, clip ratios, gathers); the Trainer's
  log call after the last pass is not timed. The TRL child's peak RSS includes importing trl, accelerate, datasets.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # lopti.py; bench_step.py
# the native side's names and step accounting; bench_step imports no torch at the top, so --help stays fast
from bench_step import PRESETS, VARIANTS, _table, cpu_pressure_s, cpu_time_s  # noqa: E402

SHARED = ("steps", "prompts", "generations", "completion", "micro_batch_size", "threads", "max_cpu_wait",
          "max_extra_steps", "seed", "people", "split")  # options both children take, under the same names


def bench_config(args):
    """The lopti.Config of bench_step.bench_child for the same options (the native side's settings)."""
    import lopti

    P, G = args.prompts, args.generations
    preset = lopti.PRESETS[args.preset] if args.preset else {}
    return lopti.Config(**{**preset, **VARIANTS[args.variant], "model": str(args.model_dir), "beta": args.beta,
                           "prompts_per_step": P, "num_generations": G, "max_completion_length": args.completion,
                           "mini_batch_size": P * G, "micro_batch_size": args.micro_batch_size,
                           "num_people": str(args.people), "seed": args.seed})


def bench_child(args) -> dict:
    """One (trainer, variant, beta) measurement in this process: warm-up + args.steps RL steps of TRL's trainer."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback

    import lopti

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config(args)
    P, G, C = args.prompts, args.generations, args.completion
    n_steps = 1 + args.steps + args.max_extra_steps
    rows = lopti.kk_generate(P * n_steps, args.people, seed=args.seed)  # bench_step's rows, in the same order
    tokenizer = lopti.load_tokenizer(str(args.model_dir))
    prompts = [lopti.kk_prompt(tokenizer, q) for q in rows["quiz"]]
    lopti_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]  # as lopti.rollout tokenises them
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "solution_text_format": rows["solution_text_format"]})
    if args.split == "median":  # as bench_step.bench_child; LoptiGRPOTrainer looks lopti_masks up in lopti's globals
        lopti_masks = lopti.lopti_masks
        lopti.lopti_masks = lambda old, mask, eta: lopti_masks(old, mask, float(old[mask].exp().median().clamp(max=1)))

    def kk_reward(prompts, completions, solution_text_format, **kwargs):  # train_step's training reward
        texts = [lopti.THINK_PREFIX + c for c in completions]
        return [lopti.kk_reward(t, s) + (cfg.format_reward * lopti.kk_format_credit(t, s) if cfg.format_reward else 0)
                for t, s in zip(texts, solution_text_format)]

    per_step = 2 if cfg.lopti else 1  # optimiser steps per RL step (one mini-batch per pass, cfg.num_iterations 1)
    assert cfg.num_iterations == 1 and P * G % args.micro_batch_size == 0, (cfg.num_iterations, P * G)
    trl_cfg = trl.GRPOConfig(
        output_dir=str(args.out_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=P * G // args.micro_batch_size,
        num_generations=G, max_completion_length=C, temperature=cfg.temperature, top_k=0, top_p=1.0, min_p=None,
        repetition_penalty=1.0, mask_truncated_completions=cfg.mask_truncated, beta=cfg.beta, epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high, num_iterations=cfg.num_iterations, loss_type="dapo",
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=cfg.max_grad_norm, optim="adamw_torch", disable_dropout=True,
        max_steps=n_steps * per_step, shuffle_dataset=False, seed=args.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        # how GRPOTrainer loads the policy from the folder (grpo); a policy passed as a model (lopti) is not loaded
        # by TRL, and TRL builds the reference like it (fp32, SDPA)
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"} if args.trainer == "grpo" else None,
    )
    t0 = time.perf_counter()
    common = dict(reward_funcs=kk_reward, args=trl_cfg, train_dataset=dataset, processing_class=tokenizer)
    if args.trainer == "grpo":
        trainer = trl.GRPOTrainer(model=str(args.model_dir), **common)
    else:  # as lopti.train_trl builds it
        model = lopti.load_model(cfg.model, torch.device("cpu"))
        trainer = lopti.LoptiGRPOTrainer(
            model, alpha=cfg.alpha, lopti=cfg.lopti, eta=cfg.eta, lopti_order=cfg.lopti_order,
            dual_clip=cfg.dual_clip, optimizers=(lopti.make_optimizer(model, cfg), None), **common)
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

    gen, generations = trainer._generate_single_turn, [0]

    def generate_checked(prompt_ids, *a, **kw):
        k = generations[0]  # the k-th generation batch = RL step k = lopti's rows k*P .. (k+1)*P - 1, G times each
        generations[0] += 1
        want = [ids for ids in lopti_ids[k * P:(k + 1) * P] for _ in range(G)]
        assert [list(ids) for ids in prompt_ids] == want, f"RL step {k}: TRL's prompt tokens differ from lopti's"
        completion_ids, logprobs = gen(prompt_ids, *a, **kw)
        lengths.extend(len(c) for c in completion_ids)  # up to and including EOS, as lopti's completion_length
        return completion_ids, logprobs

    trainer._generate_single_turn = timed("rollout", generate_checked)
    trainer._get_per_token_logps_and_entropies = timed(  # bench_step's names: logprobs_old = pi_old
        "logprobs", trainer._get_per_token_logps_and_entropies,
        key_fn=lambda model, *a: "policy_forward" if torch.is_grad_enabled() else
        "logprobs_ref" if model is trainer.ref_model else "logprobs_old")
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)

    # the update passes in order, named as update_policy names them (time/update_all, or _low and _high)
    stages = ["all"] if not cfg.lopti else ["low", "high"][::1 if cfg.lopti_order == "low_first" else -1]
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        """Times RL steps: per_step optimiser steps, the first of which generates."""

        def on_step_begin(self, a, state, control, **kw):
            self.pass_t = time.perf_counter()
            if state.global_step % per_step == 0:  # an RL step's first pass
                acc.clear()
                lengths.clear()
                self.passes = []
                self.t, self.c, self.psi = self.pass_t, cpu_time_s(), cpu_pressure_s()

        def on_step_end(self, a, state, control, **kw):
            self.passes.append(time.perf_counter() - self.pass_t)
            if state.global_step % per_step:  # Lopti's second pass is next
                return
            m = {"time/step": time.perf_counter() - self.t, "cpu/step": cpu_time_s() - self.c,
                 "cpu_wait_s": cpu_pressure_s() - self.psi, **acc}
            assert len(lengths) == P * G, f"{len(lengths)} completions in an RL step, not P*G = {P * G}"
            m["cpu_util"] = m["cpu/step"] / m["time/step"]
            for j, (name, t) in enumerate(zip(stages, self.passes)):  # the first pass also generated and scored
                m[f"time/update_{name}"] = t - (m["wall/generate_and_score"] if j == 0 else 0.0)
            m["completion_length"] = sum(lengths) / len(lengths)
            m["completion_lengths"] = list(lengths)
            m["clean"] = m["cpu_wait_s"] <= args.max_cpu_wait
            i = state.global_step // per_step - 1
            print(f"  [trl {args.trainer} {args.variant} beta={args.beta}] step {i}{' (warm-up)' if i == 0 else ''}: "
                  f"{m['time/step']:.2f} s (cpu {m['cpu/step']:.2f} s, cpu_wait {m['cpu_wait_s']:.1f} s), "
                  f"completion length {m['completion_length']:.1f}{'' if m['clean'] or i == 0 else ' CONTENDED'}",
                  file=sys.stderr, flush=True)
            if i > 0:
                steps.append(m)
            if sum(s["clean"] for s in steps) >= args.steps:
                control.should_training_stop = True

    trainer.add_callback(StepTimer())
    trainer.remove_callback(transformers.PrinterCallback)  # its print of every log dict; the logs are still made
    trainer.train()
    clean = [s for s in steps if s["clean"]]
    used = clean or steps  # all contended: report them anyway, flagged by cpu_wait
    keys = [k for k in used[0] if isinstance(used[0][k], float)]
    mean = {k: sum(s.get(k, 0.0) for s in used) / len(used) for k in keys}
    mean.update(step_times=[s["time/step"] for s in steps], cpu_wait_per_step=[s["cpu_wait_s"] for s in steps],
                completion_lengths=[s["completion_lengths"] for s in steps], clean_steps=len(clean),
                peak_memory_gb=lopti.peak_memory_gb(torch.device("cpu")), rss_after_load_gb=rss_after_load,
                load_s=load_s, trainer=args.trainer, variant=args.variant, beta=args.beta,
                threads=torch.get_num_threads(), prompts=P, generations=G, max_completion_length=C,
                micro_batch_size=args.micro_batch_size, loss_type=trl_cfg.loss_type,
                optimizer=type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                               else trainer.optimizer).__name__, stop_at_answer=cfg.stop_at_answer,
                prompt_tokens_mean=sum(len(v) for v in lopti_ids) / len(lopti_ids),
                versions={m.__name__: m.__version__ for m in (torch, transformers, trl, datasets)})
    return mean


def phases(r: dict) -> dict:
    """One side's result in the common columns (both children use bench_step's key names). `other` is what the
    named phases leave of the step, so each row adds up to its step time."""
    updates = [r[f"time/update_{s}"] for s in ("all", "low", "high") if f"time/update_{s}" in r]
    named = [r["wall/rollout"], r.get("wall/logprobs_old", 0.0), r.get("wall/logprobs_ref", 0.0), *updates]
    return dict(rollout=named[0], old=named[1], ref=named[2], update=updates, other=r["time/step"] - sum(named),
                step=r["time/step"], cpu_step=r["cpu/step"], peak=r["peak_memory_gb"], load=r["rss_after_load_gb"],
                length=r["completion_length"], prompt_len=r["prompt_tokens_mean"], cpu_wait=r["cpu_wait_s"],
                clean=f"{r['clean_steps']}/{len(r['step_times'])}")


def print_phases(rows: list[tuple[str, dict]]) -> None:
    """Wall seconds per phase of the RL step, one row per (side, result)."""
    cols = ["side", "variant", "beta", "rollout", "pi_old", "ref", "update", "other", "step_s", "cpu_s", "peak_GB",
            "load_GB", "compl_len", "prompt_len", "cpu_wait", "clean"]
    cells = []
    for side, r in rows:
        p = phases(r)
        cells.append([side, r["variant"], f"{r['beta']:g}"] + [f"{p[k]:.2f}" for k in ("rollout", "old", "ref")] +
                     [" + ".join(f"{u:.2f}" for u in p["update"])] +
                     [f"{p[k]:.2f}" for k in ("other", "step", "cpu_step", "peak", "load")] +
                     [f"{p['length']:.1f}", f"{p['prompt_len']:.0f}", f"{p['cpu_wait']:.1f}", p["clean"]])
    _table(cols, cells)


def print_comparison(pairs: list[tuple[dict, dict]]) -> None:
    """Step time and peak RSS of the two sides, and TRL / native."""
    cols = ["variant", "beta", "native step_s", "TRL step_s", "ratio (time)", "native peak_GB", "TRL peak_GB",
            "ratio (memory)", "native compl_len", "TRL compl_len"]
    cells = []
    for native, trl in pairs:
        n, t = phases(native), phases(trl)
        cells.append([native["variant"], f"{native['beta']:g}", f"{n['step']:.2f}", f"{t['step']:.2f}",
                      f"{t['step'] / n['step']:.2f}", f"{n['peak']:.2f}", f"{t['peak']:.2f}",
                      f"{t['peak'] / n['peak']:.2f}", f"{n['length']:.1f}", f"{t['length']:.1f}"])
    _table(cols, cells)


def run_child(cmd: list[str], out: Path) -> dict:
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="model folder (bench_step.py --build-only, or "
                   "real weights written by save_pretrained)")
    p.add_argument("--trainer", choices=("grpo", "lopti"), default="grpo", help="grpo: plain trl.GRPOTrainer; "
                   "lopti: lopti.LoptiGRPOTrainer with lopti's AdamW (what `lopti.py train --engine trl` runs)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="grpo", help="lopti's knobs, as bench_step.py's "
                   "variants (--trainer grpo: grpo only)")
    p.add_argument("--compare-native", action="store_true", help="also run bench_step.py's native step, same "
                   "settings, before each TRL child, and print both sides and their ratios")
    p.add_argument("--no-prefix-sharing", action="store_true", help="with --compare-native: the native side runs "
                   "each row's prompt, as TRL does (bench_step.py's option)")
    p.add_argument("--betas", default="0.001,0", help="comma list of KL weights (0 loads no reference model)")
    p.add_argument("--steps", type=int, default=2, help="measured RL steps after 1 warm-up step")
    p.add_argument("--prompts", type=int, default=2, help="prompts per RL step P")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt G")
    p.add_argument("--completion", type=int, default=64, help="max_completion_length C")
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per forward/backward; one mini-batch = P*G")
    p.add_argument("--preset", choices=sorted(PRESETS), help="start from this lopti preset (learning rate, reward "
                   "shaping, stop_at_answer, ...), then apply the variant and the shape options, as bench_step.py")
    p.add_argument("--people", type=int, default=3, help="people per K&K puzzle")
    p.add_argument("--split", choices=("median", "eta"), default="median", help="Lopti's split: at each step's "
                   "median pi_old (random weights) or at the config's eta (real weights)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--max-cpu-wait", type=float, default=2.0, help="a step whose machine-wide CPU wait (PSI) exceeds "
                   "this many seconds counts as contended and is re-measured")
    p.add_argument("--max-extra-steps", type=int, default=2, help="most re-measured steps per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--beta", type=float, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trainer == "grpo" and args.variant != "grpo":
        p.error("--trainer grpo is plain GRPOTrainer: --variant grpo only (AR and Lopti need --trainer lopti)")
    if args.no_prefix_sharing and not args.compare_native:
        p.error("--no-prefix-sharing applies to the native side: use it with --compare-native")
    if args.child:
        args.child_out.write_text(json.dumps(bench_child(args)))
        return

    shared = [a for k in SHARED for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    shared += ["--model-dir", str(args.model_dir), "--variant", args.variant]
    shared += ["--preset", args.preset] * bool(args.preset)
    pairs, results = [], []
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        for beta in (float(b) for b in args.betas.split(",")):
            if args.compare_native:  # bench_step's child, mini-batch P*G (--mini-batch-size 0)
                out = Path(tmp) / f"native_{beta}.json"
                native = run_child([sys.executable, str(HERE / "bench_step.py"), "--child", "--beta", str(beta),
                                    "--child-out", str(out), "--mini-batch-size", "0", *shared]
                                   + ["--no-prefix-sharing"] * args.no_prefix_sharing, out)
            out = Path(tmp) / f"trl_{beta}.json"
            trl = run_child([sys.executable, __file__, "--child", "--beta", str(beta), "--child-out", str(out),
                             "--out-dir", str(Path(tmp) / "out"), "--trainer", args.trainer, *shared], out)
            results.append(trl)
            if args.compare_native:
                pairs.append((native, trl))
    r0 = results[0]
    split = ""
    if VARIANTS[args.variant]["lopti"]:
        split = f", Lopti split at {'the median' if args.split == 'median' else 'eta'}"
    print(f"\nTRL {'GRPOTrainer' if args.trainer == 'grpo' else 'LoptiGRPOTrainer'} ({r0['optimizer']}), "
          f"{r0['versions']}, {r0['threads']} threads; {args.model_dir}, P={args.prompts} x G={args.generations}, "
          f"max_completion_length={args.completion}, micro-batch {args.micro_batch_size}, one mini-batch per pass, "
          f"{args.people}-person puzzles{f', preset {args.preset}' if args.preset else ''}{split}; mean of up to "
          f"{args.steps} clean RL step(s) after 1 warm-up (clean = CPU wait <= {args.max_cpu_wait:g} s)")
    if r0["stop_at_answer"] and args.compare_native:
        print("stop_at_answer: the native side ends completions at </answer>, TRL at EOS (see compl_len)")
    print("\nwall seconds per RL step and phase (update: one number per pass; other: the step minus the named "
          "phases)\n")
    print_phases([row for pair in pairs for row in zip(("native", "TRL"), pair)] if pairs
                 else [("TRL", r) for r in results])
    if pairs:
        print("\nTRL / native\n")
        print_comparison(pairs)
    if args.json:
        args.json.write_text(json.dumps([{"native": n, "trl": t} for n, t in pairs] if pairs else results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
