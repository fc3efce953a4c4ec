"""Seconds per phase and peak memory of one RL step of lopti.train_step (CPU, or whatever pick_device() finds).

    python tests/bench_step.py --model tiny --steps 1                 # seconds: a smoke run
    python tests/bench_step.py                                        # SmolLM2-135M-shaped, GRPO and AR+Lopti (~2 min)
    python tests/bench_step.py --variants grpo --betas 0.001,0 --model-dir /tmp/smol135 --json /tmp/bench.json

Not a test (pytest collects test_*.py only). Each (variant, beta) runs in its own child process, so the peak memory
it reports (peak_memory_gb: resident on CPU, reserved on CUDA) is that configuration's alone. A child sets up
as lopti.train does (load_model, load_tokenizer, a reference model when beta > 0, make_optimizer), runs 1 warm-up
step and --steps measured steps of train_step on 3-person K&K prompts, and prints the mean of lopti's own time/*
metrics. The weights are random (no hub): `tiny` is conftest.make_tiny_model; `smollm2-135m` has the shape of
HuggingFaceTB/SmolLM2-135M-Instruct with a BPE tokenizer trained here. A random model rarely samples EOS, so
completions run to --completion tokens; its pi_old is ~1/V everywhere, so with eta = 0.5 Lopti's high pass would be
empty: --split median (default) splits at each step's median pi_old instead, so that both passes are timed; and it
always scores -3 on K&K, so that no row would have an advantage: --reward varied (default) gives the completions of
a prompt the rewards 0, 1, ..., G-1 instead (every row is computed).
cpu_wait is the machine-wide time tasks waited for a CPU during a step (Linux PSI): well above 0, another process
competed and the timing is suspect.
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
sys.path[:0] = [str(HERE.parent), str(HERE)]  # lopti.py; conftest (make_tiny_model, CHATML, _corpus)

VARIANTS = {"grpo": dict(alpha=0.0, lopti=False), "ar": dict(alpha=0.3, lopti=False),
            "lopti": dict(alpha=0.0, lopti=True), "ar_lopti": dict(alpha=0.3, lopti=True)}
# HuggingFaceTB/SmolLM2-135M-Instruct's config.json, shape only (weights are random here)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu",
                    initializer_range=0.041666666666666664)
PHASES = ("rollout", "logprobs", "update_all", "update_low", "update_high", "measure", "other", "step")



def peak_memory_gb(device) -> float:
    """CUDA: the allocator's reserved peak; CPU: the process's peak resident size (ru_maxrss: KiB on Linux)."""
    import resource

    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build_model(kind: str, path: Path) -> Path:
    """Write a random model + tokenizer folder with save_pretrained; returns `path`."""
    import conftest

    if kind == "tiny":
        return conftest.make_tiny_model(path)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import lopti

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's ids 0, 1, 2
    puzzles = lopti.kk_generate(2000, (3, 8), seed=12345)  # a seed unlike the benchmark's prompts
    corpus = conftest._corpus() + [lopti.KK_SYSTEM_PROMPT] * 20 + [
        q + "\n" + s for q, s in zip(puzzles["quiz"], puzzles["solution_text_format"])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=8192, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", chat_template=conftest.CHATML)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, bos_token_id=ids["<|im_start|>"],
                                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cpu_wait_s() -> float:
    """Seconds some task waited for a CPU, machine-wide, since boot (Linux PSI); 0 where unavailable."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def config_overrides(lopti, pairs: list[str]) -> dict:
    """--set FIELD=VALUE pairs, typed as lopti's Config fields."""
    import dataclasses

    kinds = {"float": float, "int": int, "str": str, "bool": lopti._parse_bool}
    types = {f.name: f.type for f in dataclasses.fields(lopti.Config)}
    return {k: kinds[types[k]](v) for k, v in (kv.split("=", 1) for kv in pairs)}


def bench_child(args) -> dict:
    """One (variant, beta): 1 warm-up step, then args.steps steps of lopti.train_step; the mean of each phase."""
    import torch

    import lopti

    if args.threads:
        torch.set_num_threads(args.threads)
    P, G = args.prompts, args.generations
    cfg = lopti.Config(**{**VARIANTS[args.variant], "model": str(args.model_dir), "beta": args.beta,
                          "prompts_per_step": P, "num_generations": G, "max_completion_length": args.completion,
                          "mini_batch_size": P * G, "micro_batch_size": args.micro_batch_size, "num_people": "3",
                          **config_overrides(lopti, args.set)})
    device = lopti.pick_device()
    torch.manual_seed(cfg.seed)
    data = lopti.kk_generate(P * (args.steps + 1), 3, seed=cfg.seed)
    model, tokenizer = lopti.load_model(cfg.model, device), lopti.load_tokenizer(cfg.model)
    ref = lopti.load_model(cfg.model, device).eval().requires_grad_(False) if cfg.beta > 0 else None
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    optimizer = lopti.make_optimizer(model, cfg)
    if args.reward == "varied":  # see the module docstring
        def varied(texts, solutions):
            return torch.arange(len(texts), dtype=torch.float) % G

        lopti.kk_rewards = varied
    if args.split == "median":
        masks = lopti.lopti_masks
        lopti.lopti_masks = lambda old, mask, eta: masks(old, mask, float(old[mask].exp().median().clamp(max=1)))
    steps = []
    for i in range(args.steps + 1):
        wait, t = cpu_wait_s(), time.perf_counter()
        m = lopti.train_step(cfg, model, ref, tokenizer, optimizer, data[i * P:(i + 1) * P], device)
        m["time/step"] = time.perf_counter() - t
        m["time/other"] = m["time/step"] - sum(v for k, v in m.items() if k.startswith("time/") and k != "time/step")
        m["cpu_wait"] = cpu_wait_s() - wait
        print(f"  [{args.variant} beta={args.beta:g}] step {i}{' (warm-up)' if i == 0 else ''}: "
              f"{m['time/step']:.2f} s, cpu_wait {m['cpu_wait']:.1f} s", file=sys.stderr, flush=True)
        steps.append(m)
    steps = steps[1:]
    mean = {k: sum(s.get(f"time/{k}", 0.0) for s in steps) / len(steps) for k in PHASES}
    mean.update({k: sum(s[k] for s in steps) / len(steps) for k in ("completion_length", "cpu_wait")})
    return {**mean, "variant": args.variant, "beta": args.beta, "peak_memory_gb": peak_memory_gb(device),
            "device": str(device), "threads": torch.get_num_threads(),
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def print_table(results: list[dict]) -> None:
    cols = ["variant", "beta", *PHASES, "peak_GB", "compl_len", "cpu_wait"]
    rows = [[r["variant"], f"{r['beta']:g}", *(f"{r[p]:.2f}" for p in PHASES), f"{r['peak_memory_gb']:.2f}",
             f"{r['completion_length']:.1f}", f"{r['cpu_wait']:.1f}"] for r in results]
    _table(cols, rows)


def _table(cols: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print("\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2-135m"), default="smollm2-135m")
    p.add_argument("--model-dir", type=Path, help="model folder to reuse, or to build into if absent")
    p.add_argument("--variants", default="grpo,ar_lopti", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--betas", default="0.001", help="comma list of KL weights (0 loads no reference model)")
    p.add_argument("--steps", type=int, default=1, help="measured steps after 1 warm-up step")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step P")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt G")
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--split", choices=("median", "eta"), default="median",
                   help="Lopti's split: at each step's median pi_old (random weights) or at eta (real weights)")
    p.add_argument("--reward", choices=("varied", "kk"), default="varied",
                   help="rewards 0..G-1 in every group (random weights) or K&K's (real weights)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any other Config field")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--build-only", action="store_true", help="only write the model folder to --model-dir")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # a child: its settings' JSON, then its results
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child.read_text())
        args.child.write_text(json.dumps(bench_child(argparse.Namespace(**spec))))
        return
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        model_dir = args.model_dir or Path(tmp) / args.model
        if not (model_dir / "config.json").exists():  # in a child, so that it counts in no measured peak
            subprocess.run([sys.executable, "-c", f"import sys, pathlib; sys.path.insert(0, {str(HERE)!r}); import "
                            f"bench_step; bench_step.build_model({args.model!r}, pathlib.Path({str(model_dir)!r}))"],
                           check=True)
        if args.build_only:
            return
        results = []
        for variant in args.variants.split(","):
            for beta in map(float, args.betas.split(",")):
                spec = Path(tmp) / f"{variant}_{beta}.json"
                spec.write_text(json.dumps({**vars(args), "json": None, "child": None, "model_dir": str(model_dir),
                                            "variant": variant, "beta": beta}))
                subprocess.run([sys.executable, __file__, "--child", str(spec)], check=True)
                results.append(json.loads(spec.read_text()))
    r = results[0]
    print(f"\n{args.model} ({r['params_m']:.1f}M params), {r['device']}, {r['threads']} threads; P={args.prompts} x "
          f"G={args.generations}, <= {args.completion} tokens, micro-batch {args.micro_batch_size}; seconds per "
          f"phase, mean of {args.steps} step(s) after a warm-up (logprobs: pi_old + reference; measure: Figure 3)")
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
