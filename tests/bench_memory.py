"""Peak memory of each phase of one RL step at a preset's real shapes, and the FLOPs and GPU time of a whole step.

    python tests/bench_memory.py --preset cpu       # SmolLM2-135M-shaped, ~1 min on 2 CPU cores
    python tests/bench_memory.py --preset colab     # Qwen2.5-0.5B-shaped, fp32, ~5-10 min
    python tests/bench_memory.py --preset gpu       # Qwen2.5-3B-shaped: estimates only
    python tests/bench_memory.py --preset cpu --set max_completion_length=16 --set micro_batch_size=2   # seconds

Not a test. The model is built from the hub model's config.json, kept here (no hub), with random fp32 weights, held
as lopti.train holds it: the policy (gradient checkpointing as the preset says), a frozen reference model when
beta > 0, and AdamW with its state allocated (as from the second step on). One micro-batch of each phase then runs
through lopti's functions, every completion at max_completion_length (the worst case):
  rollout    the KV cache of one generation batch at prompt + max_completion_length tokens, and one decoding step
             on it (filling it token by token on a CPU would take hours; its size is the same);
  pi_old     lopti.batched_logprobs on one micro-batch (no grad); reference: the same on the reference model;
  update     lopti.update_policy on one micro-batch: forward, backward, gradient clip and the optimiser step.
A phase's peak is the process's peak resident memory (Linux VmHWM, reset before it): weights, AdamW state and
PyTorch's libraries included. A CPU cannot show the CUDA context (~0.3-0.6 GB), the caching allocator's slack, or
the GPU's attention kernels (SDPA's math kernel here materialises (b, heads, L, L) scores for left-padded rows); a
bf16 GPU runs under autocast (activations about half, plus a bf16 copy of the weights: memory_estimate).
Time is an ESTIMATE from a FLOP count (matmuls at --util of the dense peak; decoding at the larger of its FLOPs and
its memory traffic, plus --decode-overhead-ms per layer per token), an upper bound by default: generate and the
scoring passes taken to run to max_completion_length (--mean-completion to change the latter).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import bench_step  # noqa: E402  (SMOLLM2_135M, _table)

QWEN = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
            vocab_size=151936, hidden_act="silu", attention_dropout=0.0)
MODELS = {  # each hub model's config.json, shape only: (transformers config class, fields)
    "Qwen/Qwen2.5-0.5B-Instruct": ("Qwen2Config", dict(QWEN, hidden_size=896, intermediate_size=4864,
                                                       num_hidden_layers=24, num_attention_heads=14,
                                                       num_key_value_heads=2)),
    "Qwen/Qwen2.5-3B-Instruct": ("Qwen2Config", dict(QWEN, hidden_size=2048, intermediate_size=11008,
                                                     num_hidden_layers=36, num_attention_heads=16,
                                                     num_key_value_heads=2)),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("LlamaConfig", bench_step.SMOLLM2_135M),
}
# The longest K&K prompt of 64 puzzles of the preset's sizes (the batch pads to it), counted with SmolLM2's
# tokenizer (Qwen's is not available offline; both are byte-level BPEs of English), rounded up.
PROMPT_LEN = {"cpu": 250, "colab": 310, "gpu": 360}
RUNTIME_GB = 0.4  # PyTorch's libraries here (measured: the resident size before the models load); a CUDA context
GPUS = {  # name: (dense peak TFLOP/s of the dtype lopti uses there, memory bandwidth GB/s, compute dtype bytes)
    "T4 fp32": (8.1, 320, 4), "T4 fp16": (65, 320, 2), "L4 bf16": (121, 300, 2), "A100 bf16": (312, 2039, 2),
    "H100 bf16": (989, 3350, 2)}


def shape(model: str) -> dict:
    kind, cfg = MODELS[model]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    H, ff, n_layers, kv, a = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                             cfg["num_key_value_heads"], cfg["num_attention_heads"])
    block = n_layers * (2 * H * a * hd + 2 * H * kv * hd + 3 * H * ff)  # q, o, k, v, gate/up/down per layer
    return dict(H=H, I=ff, layers=n_layers, kv=kv, heads=a, hd=hd, V=cfg["vocab_size"], block=block,
                params=block + cfg["vocab_size"] * H * (1 if cfg["tie_word_embeddings"] else 2))


def flops(cfg, s: dict, prompt_len: int, mean_completion: int) -> dict:
    """FLOPs of one whole RL step by phase: generate runs every row to the longest completion of its batch (taken
    as max_completion_length), the scoring passes run each micro-batch to its longest (taken as mean_completion)."""
    B, C, P = cfg.prompts_per_step * cfg.num_generations, cfg.max_completion_length, cfg.prompts_per_step
    L, Cm = prompt_len + mean_completion, mean_completion
    attn = 4 * s["layers"] * s["heads"] * s["hd"]  # QK^T and AV per token per context position
    head = 2 * s["H"] * s["V"]
    forward = B * L * 2 * s["block"] + B * Cm * head + B * attn * L * L / 2  # one scoring forward of the batch
    passes = 2 if cfg.lopti else 1
    return {"prefill": P * prompt_len * (2 * s["block"] + attn * prompt_len / 2),
            "decode": B * C * (2 * s["block"] + head + attn * (prompt_len + C / 2)),
            "pi_old": forward, "reference": forward if cfg.beta > 0 else 0.0,
            # forward + backward (2x) [+ the recomputed forward] per pass, and the output layer recomputed in backward
            "update": passes * ((4 if cfg.gradient_checkpointing else 3) * forward + B * Cm * head)}


def step_time(cfg, s: dict, f: dict, gpu: str, util: float, overhead_ms: float, prompt_len: int) -> dict:
    peak, bw, nbytes = GPUS[gpu]
    B, C = cfg.prompts_per_step * cfg.num_generations, cfg.max_completion_length
    gb = cfg.generation_batch_size or B
    rate = peak * 1e12 * util
    # a decoding step reads the weights (fp32, plus the bf16 copy autocast makes) and the KV cache so far
    weight_bytes = s["params"] * (4 if nbytes == 4 else 8)
    kv_bytes = 2 * s["layers"] * s["kv"] * s["hd"] * nbytes * gb * (prompt_len + C / 2)
    per_token = max(f["decode"] / (B * C) * gb / rate, (weight_bytes + kv_bytes) / (bw * 1e9 * 0.7))
    decode = -(-B // gb) * C * (per_token + overhead_ms * 1e-3 * s["layers"])
    t = {"rollout": f["prefill"] / rate + decode, "pi_old+ref": (f["pi_old"] + f["reference"]) / rate,
         "update": f["update"] / rate}
    t["step"] = sum(t.values())
    t["run_h"] = t["step"] * cfg.steps / 3600
    return t


def memory_estimate(cfg, s: dict, prompt_len: int, nbytes: int) -> dict:
    """GB by phase from the sizes of the big tensors (fp32 weights and AdamW; activations, KV cache and logits
    chunks in `nbytes` per value; a bf16 reference model where nbytes is 2) and RUNTIME_GB; printed next to the
    measurement where there is one. Under bf16 autocast (nbytes 2) two more things, both checked on CPU autocast
    with transformers' Qwen2: the KV cache holds fp32 keys and bf16 values (RoPE multiplies the bf16 q and k by
    fp32 cos/sin, which promotes them), and autocast keeps a bf16 copy of the trained weights (2 bytes a parameter)
    while its context lasts: the whole generate call, each no-grad micro-batch, and the update's forward (freed
    before the backward under gradient checkpointing, which saves no weights; kept for it without)."""
    N, b, C = s["params"], cfg.micro_batch_size, cfg.max_completion_length
    B = cfg.prompts_per_step * cfg.num_generations
    groups = -(-b // cfg.num_generations)  # a micro-batch's distinct prompts: lopti runs each once ...
    tokens = b * C + prompt_len * groups  # ... except in the update's forward under gradient checkpointing
    tokens_ckpt = b * (prompt_len + C) if cfg.gradient_checkpointing else tokens
    base = RUNTIME_GB * 2**30 + 4 * N + 8 * N + (nbytes * N if cfg.beta > 0 else 0)  # policy, AdamW, reference
    cast = 2 * N if nbytes == 2 else 0  # autocast's bf16 copy of the policy's weights
    layer = (6 * s["H"] + 4 * s["I"]) * nbytes  # per token: what one decoder layer keeps for its backward
    chunk = 3 * 2**24 * 4  # a chunk of fp32 logits, its exp and its gradient
    key_bytes = 4  # fp32 keys: RoPE's fp32 cos/sin promote them, under autocast too
    kv = s["layers"] * s["kv"] * s["hd"] * (key_bytes + nbytes) * (cfg.generation_batch_size or B) * (prompt_len + C)
    stored = s["layers"] * tokens_ckpt * (s["H"] * nbytes if cfg.gradient_checkpointing else layer)
    gb = 2**30
    return {"rollout": (base + cast + kv) / gb, "pi_old": (base + cast + tokens * layer / 2 + chunk) / gb,
            "reference": (base + tokens * layer / 2 + chunk) / gb if cfg.beta > 0 else None,
            "update": (base + 4 * N + stored + 2 * tokens_ckpt * layer + chunk
                       + (0 if cfg.gradient_checkpointing else cast)) / gb}


def _hwm_gb() -> tuple[float, float]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(status[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM"))


def _reset_peak() -> None:
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def measure(cfg, prompt_len: int, lopti) -> dict:
    """Peak resident GB of each phase (see the module docstring), and CPU seconds (for scale only)."""
    import torch
    import transformers
    from transformers import DynamicCache

    kind, fields = MODELS[cfg.model]
    config = getattr(transformers, kind)(**fields)
    device, B, b = torch.device("cpu"), cfg.prompts_per_step * cfg.num_generations, cfg.micro_batch_size
    C, gb = cfg.max_completion_length, cfg.generation_batch_size or B
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().requires_grad_(
        False) if cfg.beta > 0 else None
    optimizer = lopti.make_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # allocates AdamW's state, as after the first RL step
    optimizer.zero_grad(set_to_none=True)
    out = {}

    def phase(name, fn):
        _reset_peak()
        before, t = _hwm_gb()[0], time.process_time()
        result = fn()
        out[name] = {"peak_gb": _hwm_gb()[1], "before_gb": before, "cpu_s": time.process_time() - t}
        print(f"  {name}: peak {out[name]['peak_gb']:.2f} GB (resident before {before:.2f} GB), "
              f"{out[name]['cpu_s']:.0f} CPU s", file=sys.stderr, flush=True)
        return result

    g = torch.Generator().manual_seed(0)
    V, L = config.vocab_size, prompt_len + C

    @torch.no_grad()
    def rollout():  # the KV cache of one generation batch, full, and one decoding step over it
        cache = DynamicCache()
        shape_kv = (gb, config.num_key_value_heads, L - 1, config.hidden_size // config.num_attention_heads)
        for i in range(config.num_hidden_layers):
            cache.update(torch.randn(shape_kv), torch.randn(shape_kv), i)
        model.eval()
        return model(input_ids=torch.randint(V, (gb, 1), generator=g),
                     attention_mask=torch.ones(gb, L, dtype=torch.long), position_ids=torch.full((gb, 1), L - 1),
                     cache=cache, logits_to_keep=1).logits

    phase("rollout", rollout)
    prompt = torch.randint(V, (1, prompt_len), generator=g).expand(b, -1)  # a micro-batch of one group
    batch = {"input_ids": torch.cat([prompt, torch.randint(V, (b, C), generator=g)], 1),
             "attention_mask": torch.ones(b, L, dtype=torch.long), "mask": torch.ones(b, C, dtype=torch.bool)}
    batch["old_logprobs"] = phase("pi_old", lambda: lopti.batched_logprobs(model, batch, cfg, device))
    if ref is not None:
        batch["ref_logprobs"] = phase("reference", lambda: lopti.batched_logprobs(ref, batch, cfg, device))
    batch["advantages"] = torch.randn(b, generator=g)
    one = dataclasses.replace(cfg, prompts_per_step=1, num_generations=b, mini_batch_size=b, lopti=False)  # 1 pass
    model.train()
    phase("update", lambda: lopti.update_policy(
        one, lambda mb: lopti.completion_logprobs(model, mb, cfg.temperature), optimizer, batch))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PROMPT_LEN), required=True)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a Config field")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default: the preset's, see PROMPT_LEN)")
    p.add_argument("--util", type=float, default=0.4, help="share of the dense peak that matmuls reach (0.4)")
    p.add_argument("--decode-overhead-ms", type=float, default=1.0, help="HF generate's Python and launch cost "
                   "per layer per decoding step, an assumption (default 1.0 ms: 24 ms a token for a 24-layer model)")
    p.add_argument("--mean-completion", type=int, help="tokens of a micro-batch's longest completion, for the "
                   "time of the scoring passes (default max_completion_length: an upper bound)")
    p.add_argument("--estimate-only", action="store_true", help="no measurement (automatic for --preset gpu)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    import torch

    import lopti

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = bench_step.config_overrides(lopti, args.set)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = lopti.Config(**{**lopti.PRESETS[args.preset], "output_dir": tmp, **overrides})
    s, prompt_len = shape(cfg.model), args.prompt_len or PROMPT_LEN[args.preset]
    B = cfg.prompts_per_step * cfg.num_generations
    print(f"preset {args.preset}: {cfg.model} ({s['params'] / 1e9:.2f} B params, random weights), B = "
          f"{cfg.prompts_per_step} x {cfg.num_generations} = {B} completions of <= {cfg.max_completion_length} "
          f"tokens after a {prompt_len}-token prompt, generation batch {cfg.generation_batch_size or B}, micro-batch "
          f"{cfg.micro_batch_size}, gradient checkpointing {cfg.gradient_checkpointing}, beta {cfg.beta:g} "
          f"({'a' if cfg.beta > 0 else 'no'} reference model), {'Lopti: 2' if cfg.lopti else '1'} update pass(es), "
          f"{cfg.steps} steps")
    measured = None if args.estimate_only or args.preset == "gpu" else measure(cfg, prompt_len, lopti)
    est32, est16 = memory_estimate(cfg, s, prompt_len, 4), memory_estimate(cfg, s, prompt_len, 2)
    rows = [[name, f"{measured[name]['peak_gb']:.2f}" if measured and name in measured else "-",
             f"{est32[name]:.2f}" if est32[name] else "-", f"{est16[name]:.2f}" if est16[name] else "-"]
            for name in ("rollout", "pi_old", "reference", "update")]
    print("\npeak memory per phase, GB (measured: fp32 on this CPU, resident; estimates: the big tensors' sizes)")
    bench_step._table(["phase", "measured CPU fp32", "estimate fp32 (T4)", "estimate bf16 GPU"], rows)
    mean = args.mean_completion or cfg.max_completion_length
    f = flops(cfg, s, prompt_len, mean)
    total = sum(f.values())
    print(f"\nFLOPs of one step (rollout to {cfg.max_completion_length} tokens, scoring to {mean}): "
          f"{total / 1e15:.2f} PFLOP = "
          + ", ".join(f"{k} {v / 1e15:.3f}" for k, v in f.items()))
    times = {gpu: step_time(cfg, s, f, gpu, args.util, args.decode_overhead_ms, prompt_len) for gpu in GPUS}
    print(f"\nESTIMATED time (not measured): matmuls at {args.util:.0%} of the dense peak, decoding at the larger of "
          f"FLOPs and memory traffic + {args.decode_overhead_ms:g} ms/layer/token; the T4 runs fp32 in lopti "
          "(no bf16), T4 fp16 is what the fp16 path would reach")
    cols = ["GPU", "peak TFLOP/s", "rollout s", "pi_old+ref s", "update s", "step s", f"{cfg.steps} steps h"]
    bench_step._table(cols, [[gpu, f"{GPUS[gpu][0]:g}"] + [f"{t[k]:.0f}" for k in ("rollout", "pi_old+ref", "update",
                             "step")] + [f"{t['run_h']:.1f}"] for gpu, t in times.items()])
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "config": vars(cfg), "prompt_len": prompt_len,
                                         "measured": measured, "estimate_fp32": est32, "estimate_bf16": est16,
                                         "flops": f, "times": times}, indent=2))


if __name__ == "__main__":
    main()
