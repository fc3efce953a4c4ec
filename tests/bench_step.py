"""Benchmark one RL step of lopti.py by phase, on CPU (or whatever pick_device() finds).

    python tests/bench_step.py                                   # tiny random Qwen2, GRPO and AR+Lopti
    python tests/bench_step.py --model smollm2-135m --json /tmp/bench.json
    python tests/bench_step.py --model smollm2-135m --variants grpo --betas 0.001 --model-dir /tmp/smol

Not a test (pytest collects test_*.py only). Each (variant, beta) runs in its own child process, so the
peak resident memory it reports (ru_maxrss, lopti's `peak_memory_gb`) is that configuration's alone. A child
loads the model folder the way lopti.train does (load_model, load_tokenizer, a reference model when beta > 0,
AdamW), runs 1 warm-up step and then --steps steps of lopti.train_step on 3-person K&K prompts, and reports
the mean seconds per phase. The models have random weights (no hub): `tiny` is conftest.make_tiny_model;
`smollm2-135m` has the shape of HuggingFaceTB/SmolLM2-135M-Instruct with a BPE tokenizer trained here on K&K
text. A random model almost never samples EOS, so completions run to --completion tokens (see the
completion_length column); a random model's pi_old is ~1/V for every token, so Lopti's high pass has no
tokens (token_share 0) but still costs a full pass, as it would with real tokens.
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
sys.path.insert(0, str(HERE))  # conftest (make_tiny_model, CHATML, _corpus); it also puts lopti.py on the path
import conftest  # noqa: E402

VARIANTS = {  # name -> Config overrides
    "grpo": dict(alpha=0.0, lopti=False),
    "ar_lopti": dict(alpha=0.3, lopti=True),
}
# HuggingFaceTB/SmolLM2-135M-Instruct's config.json, shape only (weights are random here)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu", initializer_range=0.041666666666666664)
DEFAULTS = {  # per model: prompts, generations, completion length
    "tiny": dict(prompts=2, generations=4, completion=64),
    "smollm2-135m": dict(prompts=2, generations=4, completion=64),
}


def build_model(kind: str, path: Path) -> Path:
    """Write a random model + tokenizer folder with save_pretrained; returns `path`."""
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


def bench_child(args) -> dict:
    """One (variant, beta) measurement in this process: warm-up + args.steps steps of lopti.train_step."""
    import torch

    import lopti

    if args.threads:
        torch.set_num_threads(args.threads)
    P, G, C = args.prompts, args.generations, args.completion
    cfg = lopti.Config(model=str(args.model_dir), **VARIANTS[args.variant], beta=args.beta, prompts_per_step=P,
                       num_generations=G, max_completion_length=C, mini_batch_size=args.mini_batch_size or P * G,
                       micro_batch_size=args.micro_batch_size, num_people="3", seed=args.seed)
    device = lopti.pick_device()
    torch.manual_seed(cfg.seed)
    data = lopti.kk_generate(P * (args.steps + 1), 3, seed=args.seed)
    t0 = time.perf_counter()
    model = lopti.load_model(cfg.model, device)  # exactly as lopti.train sets them up
    tokenizer = lopti.load_tokenizer(cfg.model)
    ref_model = lopti.load_model(cfg.model, device).eval().requires_grad_(False) if cfg.beta > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=cfg.weight_decay)
    load_s = time.perf_counter() - t0
    rss_after_load = lopti.peak_memory_gb(device)
    prompt_tokens = [len(tokenizer(lopti.kk_prompt(tokenizer, q), add_special_tokens=False)["input_ids"])
                     for q in data["quiz"]]
    # split time/logprobs into pi_old and reference: wrap the module-level function train_step calls
    split = {"old": 0.0, "ref": 0.0}
    batched_logprobs = lopti.batched_logprobs

    def timed_logprobs(m, *a, **kw):
        t = time.perf_counter()
        out = batched_logprobs(m, *a, **kw)
        split["ref" if m is ref_model else "old"] += time.perf_counter() - t
        return out

    lopti.batched_logprobs = timed_logprobs
    steps = []
    for i in range(args.steps + 1):
        split.update(old=0.0, ref=0.0)
        rows = data[i * P:(i + 1) * P]
        t = time.perf_counter()
        m = lopti.train_step(cfg, model, ref_model, tokenizer, optimizer, rows, device)
        m["time/step"] = time.perf_counter() - t
        phases = sum(v for k, v in m.items() if k.startswith("time/") and k != "time/step")
        m["time/other"] = m["time/step"] - phases  # reward, advantages, stats, bookkeeping
        m["logprobs_old_s"], m["logprobs_ref_s"] = split["old"], split["ref"]  # parts of time/logprobs
        if i > 0:  # step 0 is the warm-up
            steps.append(m)
        print(f"  [{args.variant} beta={args.beta}] step {i}{' (warm-up)' if i == 0 else ''}: "
              f"{m['time/step']:.2f} s", file=sys.stderr, flush=True)
    keys = [k for k in steps[0] if isinstance(steps[0][k], (int, float))]
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in keys}
    mean["step_times"] = [s["time/step"] for s in steps]
    mean["peak_memory_gb"] = lopti.peak_memory_gb(device)  # the process's high-water mark, after all steps
    mean.update(variant=args.variant, beta=args.beta, model=args.model, prompts=P, generations=G,
                max_completion_length=C, micro_batch_size=cfg.micro_batch_size,
                mini_batch_size=cfg.mini_batch_size, steps=len(steps), threads=torch.get_num_threads(),
                device=str(device), load_s=load_s, rss_after_load_gb=rss_after_load,
                prompt_tokens_mean=sum(prompt_tokens) / len(prompt_tokens),
                params_m=sum(p.numel() for p in model.parameters()) / 1e6)
    return mean


PHASES = ["time/rollout", "time/logprobs", "time/update_all", "time/update_low", "time/update_high", "time/other"]


def print_table(results: list[dict]) -> None:
    cols = (["variant", "beta"] + [p.split("/")[1] for p in PHASES[:2]] + ["(old", "ref)"] +
            [p.split("/")[1] for p in PHASES[2:]] +
            ["step_s", "gen_tok/s", "peak_GB", "compl_len", "prompt_len"])
    rows = []
    for r in results:
        cells = [r["variant"], f"{r['beta']:g}"]
        cells += [f"{r[p]:.2f}" if p in r else "-" for p in PHASES[:2]]
        cells += [f"{r['logprobs_old_s']:.2f}", f"{r['logprobs_ref_s']:.2f}"]
        cells += [f"{r[p]:.2f}" if p in r else "-" for p in PHASES[2:]]
        cells += [f"{r['time/step']:.2f}", f"{r['gen_tokens_per_s']:.1f}", f"{r['peak_memory_gb']:.2f}",
                  f"{r['completion_length']:.1f}", f"{r['prompt_tokens_mean']:.0f}"]
        rows.append(cells)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(cols))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(DEFAULTS), default="smollm2-135m")
    p.add_argument("--steps", type=int, default=2, help="measured steps after 1 warm-up step")
    p.add_argument("--prompts", type=int, help="prompts per step P (default per model)")
    p.add_argument("--generations", type=int, help="completions per prompt G")
    p.add_argument("--completion", type=int, help="max_completion_length C")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--mini-batch-size", type=int, default=0, help="0 = P * G (one optimiser step per pass)")
    p.add_argument("--variants", default="grpo,ar_lopti", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--betas", default="0.001,0", help="comma list of KL weights (0 loads no reference model)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
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
            subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_step; "
                            f"bench_step.build_model({args.model!r}, __import__('pathlib').Path({str(model_dir)!r}))"],
                           check=True)
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
                       "--seed", str(args.seed)]
                subprocess.run(cmd, check=True)
                results.append(json.loads(out.read_text()))
    r0 = results[0]
    print(f"\nmodel {args.model} ({r0['params_m']:.1f}M params), device {r0['device']}, {r0['threads']} threads; "
          f"P={args.prompts} prompts x G={args.generations}, max_completion_length={args.completion}, "
          f"micro-batch {r0['micro_batch_size']}, mini-batch {r0['mini_batch_size']}; mean of {args.steps} "
          f"step(s) after 1 warm-up; seconds per phase (logprobs = pi_old + reference)\n")
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
