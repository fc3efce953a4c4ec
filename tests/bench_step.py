"""Benchmark one RL step of lopti.py by phase, on CPU (or whatever pick_device() finds).

    python tests/bench_step.py                     # SmolLM2-135M-shaped, GRPO and AR+Lopti, beta 0.001 (~2-3 min)
    python tests/bench_step.py --model tiny --betas 0.001,0 --json /tmp/bench_tiny.json     # ~1 min
    python tests/bench_step.py --variants grpo --betas 0.001,0 --steps 2 --model-dir /tmp/smol135  # reuse a folder

Not a test (pytest collects test_*.py only). Each (variant, beta) runs in its own child process, so the
peak resident memory it reports (ru_maxrss, lopti's `peak_memory_gb`) is that configuration's alone. A child
loads the model folder the way lopti.train does (load_model, load_tokenizer, a reference model when beta > 0,
AdamW), runs 1 warm-up step and then --steps steps of lopti.train_step on 3-person K&K prompts, and reports
the mean seconds per phase. The models have random weights (no hub): `tiny` is conftest.make_tiny_model;
`smollm2-135m` has the shape of HuggingFaceTB/SmolLM2-135M-Instruct with a BPE tokenizer trained here on K&K
text. A random model almost never samples EOS, so completions run to --completion tokens (see the
completion_length column). A random model's pi_old is ~1/V for every token, so with the paper's eta = 0.5
every token would be "low" and Lopti would skip its empty high pass; to time both passes, as on a trained
model, the ar_lopti variant splits at the median pi_old of each step instead (about half the tokens each).

On a shared machine, wall times are only meaningful when nothing else runs: each step records the machine-wide
CPU wait (Linux PSI) and the CPU seconds it used; a step that waited more than --max-cpu-wait seconds is
flagged CONTENDED and re-measured (up to --max-extra-steps times). CPU seconds per phase are printed as well:
with --threads 1 they stay close to the uncontended wall time even when other processes run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # lopti.py; conftest (make_tiny_model, CHATML, _corpus)

PRESETS = ("cpu", "colab", "gpu")  # lopti.PRESETS, named here so that --help works without importing torch
VARIANTS = {  # name -> Config overrides
    "grpo": dict(alpha=0.0, lopti=False),
    "ar_lopti": dict(alpha=0.3, lopti=True),
}
# HuggingFaceTB/SmolLM2-135M-Instruct's config.json, shape only (weights are random here)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu",
                    initializer_range=0.041666666666666664)
DEFAULTS = {  # per model: prompts, generations, completion length, measured steps after the warm-up
    "tiny": dict(prompts=2, generations=4, completion=64, steps=3),
    "smollm2-135m": dict(prompts=2, generations=4, completion=64, steps=1),
}


def build_model(kind: str, path: Path) -> Path:
    """Write a random model + tokenizer folder with save_pretrained; returns `path`."""
    import conftest  # here, not at the top: bench_trl.py imports this module where pytest is not installed

    if kind == "tiny":
        return conftest.make_tiny_model(path)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import lopti

    # SmolLM2-Instruct's special tokens: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2 (EOS of the chat turn)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = conftest._corpus() + [lopti.KK_SYSTEM_PROMPT] * 20
    puzzles = lopti.kk_generate(2000, (3, 8), seed=12345)  # a seed unlike the benchmark's prompts
    corpus += [q + "\n" + s for q, s in zip(puzzles["quiz"], puzzles["solution_text_format"])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)  # the corpus allows ~2-3k merges; the model keeps 49152 rows
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", chat_template=conftest.CHATML)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    assert len(tokenizer) <= SMOLLM2_135M["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_135M, bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"])
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cpu_pressure_s() -> float:
    """Seconds some task waited for a CPU, machine-wide, since boot (Linux PSI); 0 where unavailable.
    A step whose delta is well above 0 shared the CPUs with another process: its timing is suspect."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_time_s() -> float:
    t = os.times()
    return t.user + t.system


def bench_child(args) -> dict:
    """One (variant, beta) measurement in this process: warm-up + args.steps steps of lopti.train_step."""
    import torch

    import lopti

    if args.threads:
        torch.set_num_threads(args.threads)
    P, G, C = args.prompts, args.generations, args.completion
    preset = lopti.PRESETS[args.preset] if args.preset else {}
    overrides = {k: type(getattr(lopti.Config, k))(v) if not isinstance(getattr(lopti.Config, k), bool)
                 else lopti._parse_bool(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    cfg = lopti.Config(**{**preset, **VARIANTS[args.variant], "model": str(args.model_dir), "beta": args.beta,
                          "prompts_per_step": P, "num_generations": G, "max_completion_length": C,
                          "mini_batch_size": args.mini_batch_size or P * G, "micro_batch_size": args.micro_batch_size,
                          "num_people": str(args.people), "seed": args.seed, **overrides})
    device = lopti.pick_device()
    torch.manual_seed(cfg.seed)
    data = lopti.kk_generate(P * (args.steps + 1 + args.max_extra_steps), args.people, seed=args.seed)
    if args.no_prefix_sharing:  # the lever off: every row runs its own prompt, in rollout, pi_old and the update
        lopti._distinct_rows = len
    if args.no_row_skip:  # the lever off: a zero advantage becomes 1e-30, so every row gets pi_old, forward, backward
        advantages = lopti.group_advantages
        lopti.group_advantages = lambda r, g: (a := advantages(r, g)).masked_fill(a == 0, 1e-30)
    t0 = time.perf_counter()
    model = lopti.load_model(cfg.model, device)  # exactly as lopti.train sets them up
    tokenizer = lopti.load_tokenizer(cfg.model)
    ref_model = lopti.load_model(cfg.model, device).eval().requires_grad_(False) if cfg.beta > 0 else None
    optimizer = lopti.make_optimizer(model, cfg)
    load_s = time.perf_counter() - t0
    rss_after_load = lopti.peak_memory_gb(device)
    prompt_tokens = [len(tokenizer(lopti.kk_prompt(tokenizer, q), add_special_tokens=False)["input_ids"])
                     for q in data["quiz"][:P * (args.steps + 1)]]
    # Wrap the module-level functions train_step calls, to split time/logprobs into pi_old and reference and to
    # measure each phase's CPU time (user + system, all threads): CPU seconds barely change when another process
    # competes for the cores, so they compare implementations on a shared machine where wall time cannot.
    acc: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            key = name if name != "logprobs" else ("logprobs_ref" if a[0] is ref_model else "logprobs_old")
            t, c = time.perf_counter(), cpu_time_s()
            out = fn(*a, **kw)
            acc[f"wall/{key}"] = acc.get(f"wall/{key}", 0.0) + time.perf_counter() - t
            acc[f"cpu/{key}"] = acc.get(f"cpu/{key}", 0.0) + cpu_time_s() - c
            return out
        return wrapper

    lopti.rollout = timed("rollout", lopti.rollout)
    lopti.batched_logprobs = timed("logprobs", lopti.batched_logprobs)
    lopti.update_policy = timed("update", lopti.update_policy)
    if args.split == "median":  # split at the median pi_old (see the module docstring)
        lopti_masks = lopti.lopti_masks
        lopti.lopti_masks = lambda old, mask, eta: lopti_masks(old, mask, float(old[mask].exp().median().clamp(max=1)))
    steps, i = [], 0
    # On a shared machine a step that waited for a CPU is re-measured: run until `steps` clean steps (cpu_wait
    # below --max-cpu-wait) or until --max-extra-steps more steps have been run; the mean is over clean steps.
    while i <= args.steps + args.max_extra_steps and sum(s["clean"] for s in steps) < args.steps:
        acc.clear()
        rows = data[i * P:(i + 1) * P]
        psi, cpu = cpu_pressure_s(), cpu_time_s()
        t = time.perf_counter()
        m = lopti.train_step(cfg, model, ref_model, tokenizer, optimizer, rows, device)
        m["time/step"] = time.perf_counter() - t
        m["cpu_wait_s"] = cpu_pressure_s() - psi  # > ~1 s: another process competed for the CPUs
        m["cpu/step"] = cpu_time_s() - cpu
        m["cpu_util"] = m["cpu/step"] / m["time/step"]  # busy cores, on average
        m.update({f"{u}/logprobs_{w}": 0.0 for u in ("cpu", "wall") for w in ("old", "ref")}, **acc)
        phases = sum(v for k, v in m.items() if k.startswith("time/") and k != "time/step")
        m["time/other"] = m["time/step"] - phases  # reward, advantages, stats, bookkeeping
        m["logprobs_old_s"], m["logprobs_ref_s"] = m["wall/logprobs_old"], m["wall/logprobs_ref"]
        m["clean"] = m["cpu_wait_s"] <= args.max_cpu_wait
        if i > 0:  # step 0 is the warm-up
            steps.append(m)
        print(f"  [{args.variant} beta={args.beta}] step {i}{' (warm-up)' if i == 0 else ''}: {m['time/step']:.2f} s "
              f"(cpu_wait {m['cpu_wait_s']:.1f} s, {m['cpu_util']:.2f} cores busy)"
              f"{'' if m['clean'] or i == 0 else ' CONTENDED'}", file=sys.stderr, flush=True)
        i += 1
    clean = [s for s in steps if s["clean"]]
    used = clean or steps  # all contended: report them anyway, flagged by cpu_wait
    keys = [k for k in used[0] if isinstance(used[0][k], (int, float)) and not isinstance(used[0][k], bool)]
    mean = {k: sum(s[k] for s in used) / len(used) for k in keys}
    mean["step_times"] = [s["time/step"] for s in steps]
    mean["cpu_wait_per_step"] = [s["cpu_wait_s"] for s in steps]
    mean["clean_steps"] = len(clean)
    mean["min_step_s"] = min(mean["step_times"])
    mean["peak_memory_gb"] = lopti.peak_memory_gb(device)  # the process's high-water mark, after all steps
    mean.update(variant=args.variant, beta=args.beta, model=args.model, prompts=P, generations=G,
                max_completion_length=C, micro_batch_size=cfg.micro_batch_size,
                mini_batch_size=cfg.mini_batch_size, steps=len(steps), threads=torch.get_num_threads(),
                device=str(device), load_s=load_s, rss_after_load_gb=rss_after_load,
                prompt_tokens_mean=sum(prompt_tokens) / len(prompt_tokens),
                params_m=sum(p.numel() for p in model.parameters()) / 1e6)
    return mean


PHASES = ["time/rollout", "time/logprobs", "time/update_all", "time/update_low", "time/update_high", "time/other"]


def _table(cols: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(cols))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def print_table(results: list[dict]) -> None:
    """Wall seconds per phase (lopti's own time/* metrics), then CPU seconds per phase."""
    cols = (["variant", "beta"] + [p.split("/")[1] for p in PHASES[:2]] + ["(old", "ref)"] +
            [p.split("/")[1] for p in PHASES[2:]] +
            ["step_s", "min_step", "gen_tok/s", "peak_GB", "compl_len", "prompt_len", "cpu_wait", "clean"])
    rows = []
    for r in results:
        cells = [r["variant"], f"{r['beta']:g}"]
        cells += [f"{r[p]:.2f}" if p in r else "-" for p in PHASES[:2]]
        cells += [f"{r['logprobs_old_s']:.2f}", f"{r['logprobs_ref_s']:.2f}"]
        cells += [f"{r[p]:.2f}" if p in r else "-" for p in PHASES[2:]]
        cells += [f"{r['time/step']:.2f}", f"{r['min_step_s']:.2f}", f"{r['gen_tokens_per_s']:.1f}",
                  f"{r['peak_memory_gb']:.2f}", f"{r['completion_length']:.1f}", f"{r['prompt_tokens_mean']:.0f}",
                  f"{r['cpu_wait_s']:.1f}", f"{r['clean_steps']}/{len(r['step_times'])}"]
        rows.append(cells)
    print("wall seconds per step and phase")
    _table(cols, rows)
    keys = ["rollout", "logprobs_old", "logprobs_ref", "update", "step"]
    print("\nCPU seconds (user + system, all threads) per step and phase")
    _table(["variant", "beta"] + keys + ["cores_busy"],
           [[r["variant"], f"{r['beta']:g}"] + [f"{r.get('cpu/' + k, 0.0):.2f}" for k in keys] +
            [f"{r['cpu_util']:.2f}"] for r in results])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(DEFAULTS), default="smollm2-135m")
    p.add_argument("--steps", type=int, help="measured steps after 1 warm-up step (default per model)")
    p.add_argument("--prompts", type=int, help="prompts per step P (default per model)")
    p.add_argument("--generations", type=int, help="completions per prompt G")
    p.add_argument("--completion", type=int, help="max_completion_length C")
    p.add_argument("--preset", choices=sorted(PRESETS), help="start from this lopti preset (e.g. cpu: its reward "
                   "shaping, stop at </answer>, learning rate), then apply the shape options")
    p.add_argument("--people", type=int, default=3, help="people per K&K puzzle")
    p.add_argument("--split", choices=("median", "eta"), default="median", help="Lopti's split: at the median "
                   "pi_old (random weights) or at the config's eta (real weights)")
    p.add_argument("--no-prefix-sharing", action="store_true", help="run each row's prompt itself (the lever off)")
    p.add_argument("--no-row-skip", action="store_true", help="compute rows with a zero advantage too (the lever off)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other Config field, e.g. --set stop_at_answer=false (repeatable)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--mini-batch-size", type=int, default=0, help="0 = P * G (one optimiser step per pass)")
    p.add_argument("--variants", default="grpo,ar_lopti", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--betas", default="0.001", help="comma list of KL weights, e.g. 0.001,0 (0 loads no reference "
                   "model)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--max-cpu-wait", type=float, default=2.0, help="a step whose machine-wide CPU wait (PSI) "
                   "exceeds this many seconds counts as contended and is re-measured")
    p.add_argument("--max-extra-steps", type=int, default=2, help="most re-measured steps per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, help="model folder to reuse, or to build into if absent")
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--build-only", action="store_true", help="only write the model folder to --model-dir")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--beta", type=float, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for k, v in DEFAULTS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    if args.child:
        args.child_out.write_text(json.dumps(bench_child(args)))
        return

    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        model_dir = args.model_dir or Path(tmp) / args.model
        if not (model_dir / "config.json").exists():
            t = time.perf_counter()
            # in a child process, so that building the model does not count in the measured peak memory
            code = (f"import sys, pathlib; sys.path.insert(0, {str(HERE)!r}); import bench_step; "
                    f"bench_step.build_model({args.model!r}, pathlib.Path({str(model_dir)!r}))")
            subprocess.run([sys.executable, "-c", code], check=True)
            print(f"built {args.model} in {model_dir} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
        if args.build_only:
            return
        results = []
        for variant in args.variants.split(","):
            for beta in (float(b) for b in args.betas.split(",")):
                out = Path(tmp) / f"{variant}_{beta}.json"
                cmd = [sys.executable, __file__, "--child", "--model", args.model, "--model-dir", str(model_dir),
                       "--variant", variant, "--beta", str(beta), "--child-out", str(out),
                       "--steps", str(args.steps), "--prompts", str(args.prompts),
                       "--generations", str(args.generations), "--completion", str(args.completion),
                       "--micro-batch-size", str(args.micro_batch_size),
                       "--mini-batch-size", str(args.mini_batch_size), "--threads", str(args.threads),
                       "--max-cpu-wait", str(args.max_cpu_wait), "--max-extra-steps", str(args.max_extra_steps),
                       "--seed", str(args.seed), "--people", str(args.people), "--split", args.split]
                cmd += ["--preset", args.preset] * bool(args.preset) + ["--no-prefix-sharing"] * args.no_prefix_sharing
                cmd += ["--no-row-skip"] * args.no_row_skip + [f"--set={kv}" for kv in args.set]
                subprocess.run(cmd, check=True)
                results.append(json.loads(out.read_text()))
    r0 = results[0]
    print(f"\nmodel {args.model} ({r0['params_m']:.1f}M params), device {r0['device']}, {r0['threads']} threads; "
          f"P={args.prompts} prompts x G={args.generations}, max_completion_length={args.completion}, "
          f"micro-batch {r0['micro_batch_size']}, mini-batch {r0['mini_batch_size']}; mean of up to {args.steps} "
          f"clean step(s) after 1 warm-up (clean = CPU wait <= {args.max_cpu_wait:g} s); seconds per phase "
          f"(logprobs = pi_old + reference; other = reward, advantages, bookkeeping); cpu_wait = mean seconds "
          f"per step that some process waited for a CPU (machine-wide PSI; well above 0 means another process "
          f"competed and the timing is suspect)\n")
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
