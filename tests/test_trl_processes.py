"""LoptiGRPOTrainer on two CPU processes (torchrun, gloo): the weights of one process with the same global batch, for
AR+Lopti and for GRPO; toy/README's TRL script under `accelerate launch` on two processes; use_liger_kernel refused.

TRL 1.16.0 generates per process: RepeatSampler deals the generation batch's prompts (each repeated num_generations
times, the same shuffle on every process) to the processes, each samples its share with its own seed (seed +
process index), rewards are gathered, advantages normalised over whole groups and sliced back. So one process and
two sample different completions; the driver below makes sampling layout-free (each completion from a seed of its
prompt and its index among that prompt's copies, one row at a time, unpadded), and the test checks that the two
layouts saw the same completions before it compares weights.

LOPTI_PY=/path/to/lopti.py runs the launched processes on another copy (e.g. one whose `/ num_processes` is gone:
the parity test then fails, as it should)."""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("accelerate")

import lopti  # noqa: E402
from conftest import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOPTI_PY = Path(os.environ.get("LOPTI_PY", ROOT / "lopti.py")).resolve()
P, G, MICRO = 2, 4, 2  # global batch: 2 prompts x 4 completions = 8, micro-batches of 2 on every process
# Compared: fp32 weights after SGD (lr 0.3, no clipping: linear in the gradient, so a wrong scale shows in full; AdamW's
# first step, ~sign(g), would hide a 2x gradient). The two layouts add the same per-token terms in another order (4
# micro-batches vs 2 x 2 summed by gloo's all-reduce, prompts padded to another width), so they agree to float
# rounding only: measured max |difference| 1.2e-7 (AR+Lopti, 2 steps and the KL) and 1.5e-8 (GRPO), of weights
# ~0.07 that the step moves by up to 3-5e-2. Dividing the denominator by nothing instead of the process count
# (a 2x gradient on 2 processes): 1.6e-2 and 2.3e-2. TOL lies between, 80x above the rounding.
TOL = 1e-5
METHODS = {"ar_lopti": dict(alpha=0.3, lopti=True, beta=0.05), "grpo": dict(alpha=0.0, lopti=False, beta=0.0)}


def cannot_start_two_processes() -> str:
    """Why this platform cannot run two gloo processes on localhost ('' when it can)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no torch.distributed with gloo: two CPU processes cannot be started"
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"no localhost socket for the processes' rendezvous ({e})"
    return ""


WHY_NOT = cannot_start_two_processes()
two_processes = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)

DRIVER = r'''
"""One generation batch through LoptiGRPOTrainer per method, on however many processes launched this; rank 0 saves
the final weights, every rank the completions it trained on."""
import json, os, sys, zlib
sys.path.insert(0, os.environ["LOPTI_DIR"])
import datasets, torch, trl
import lopti

model_dir, out = sys.argv[1], sys.argv[2]
methods = json.loads(sys.argv[3])
P, G, MICRO = 2, 4, 2


def vowel_share(completions, **_):
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def layout_free_generate(model):
    """model.generate one row at a time, unpadded, seeded by its prompt and its index among that prompt's copies
    in this call: the completions do not depend on which process samples them, nor on their neighbours."""
    real = model.generate

    def generate(input_ids, attention_mask, **kwargs):
        copies, rows = {}, []
        for ids, mask in zip(input_ids, attention_mask):
            prompt = ids[mask.bool()]
            key = tuple(prompt.tolist())
            copies[key] = copies.get(key, -1) + 1
            torch.manual_seed(zlib.crc32(repr(key).encode()) + copies[key])
            row = real(input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None], **kwargs)[0]
            rows.append(row[len(prompt):])
        width = max(len(r) for r in rows)
        pad = model.config.pad_token_id
        rows = [torch.cat([r, r.new_full((width - len(r),), pad)]) for r in rows]
        return torch.cat([input_ids, torch.stack(rows)], 1)
    model.generate = generate
    return model


seen, parent = [], trl.GRPOTrainer._generate_and_score_completions


def capture(self, inputs):
    raw = parent(self, inputs)
    seen.append([(p[pm.bool()].tolist(), c[cm.bool()].tolist()) for p, pm, c, cm in
                 zip(raw["prompt_ids"], raw["prompt_mask"], raw["completion_ids"], raw["completion_mask"])])
    return raw


trl.GRPOTrainer._generate_and_score_completions = capture
world = int(os.environ.get("WORLD_SIZE", "1"))
data = datasets.Dataset.from_dict({"prompt": ["Hello there", "A very special island"]})
for name, knobs in methods.items():
    knobs = dict(knobs)
    beta = knobs.pop("beta")
    args = trl.GRPOConfig(
        output_dir=os.path.join(out, name), use_cpu=True, bf16=False, seed=0, max_steps=2 if knobs["lopti"] else 1,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=P * G // (MICRO * world), num_generations=G,
        max_completion_length=12, temperature=0.7, top_k=0, top_p=1.0, repetition_penalty=1.0, loss_type="dapo",
        epsilon=0.2, epsilon_high=0.24, beta=beta, optim="sgd", learning_rate=0.3, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, model_init_kwargs={"dtype": torch.float32})
    model = layout_free_generate(lopti.load_model(model_dir, torch.device("cpu")))
    seen.clear()
    trainer = lopti.LoptiGRPOTrainer(model, vowel_share, args, train_dataset=data,
                                     processing_class=lopti.load_tokenizer(model_dir), eta=0.3, **knobs)
    trainer.train()
    rank = trainer.accelerator.process_index
    info = dict(world=trainer.accelerator.num_processes, type=str(trainer.accelerator.distributed_type),
                steps=trainer.state.global_step, accumulation=args.gradient_accumulation_steps, batches=seen)
    with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(info, f)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                   os.path.join(out, f"{name}.pt"))
'''


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory) -> Path:
    """test_trl's model: conftest's tiny model, embeddings x3.5 (pi_old spread over (0, 1): Lopti's stages both hold
    tokens) and a tenth of the vocabulary as extra EOS ids (completions of varied lengths)."""
    path = make_tiny_model(tmp_path_factory.mktemp("sharp"))
    model, tokenizer = lopti.load_model(str(path), torch.device("cpu")), lopti.load_tokenizer(str(path))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.5)
    model.generation_config.eos_token_id += list(range(3, len(tokenizer), 10))
    model.save_pretrained(path)
    return path


def start(command: list[str], cwd: Path, **extra_env) -> subprocess.Popen:
    """`command` in `cwd`, offline, one thread per process, importing lopti from LOPTI_PY's folder."""
    path = os.pathsep.join(filter(None, [str(LOPTI_PY.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **extra_env, "LOPTI_DIR": str(LOPTI_PY.parent), "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: int = 300) -> None:
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        output = process.communicate()[0]
    assert process.returncode == 0, f"{' '.join(process.args)} exited {process.returncode}:\n{output[-4000:]}"


def start_layout(model_dir: Path, out: Path, processes: int) -> subprocess.Popen:
    out.mkdir(parents=True)
    (out / "driver.py").write_text(DRIVER)
    python = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    return start([*python, "driver.py", str(model_dir), str(out), json.dumps(METHODS)], out)


@pytest.fixture(scope="module")
def layouts(sharp_model_dir, tmp_path_factory):
    """The driver on one process (gradient accumulation 4) and on two (2 each), at once: the same global batch of
    8. Returns their folders."""
    base = tmp_path_factory.mktemp("layouts")
    running = {n: start_layout(sharp_model_dir, base / f"p{n}", n) for n in (1, 2)}
    for process in running.values():
        finish(process)
    return {n: base / f"p{n}" for n in running}


def completions(out: Path, name: str) -> tuple[dict, list]:
    """The driver's records for one method: per rank, and all (prompt, completion) pairs trained on, sorted."""
    ranks = {int(m.group(1)): json.loads(f.read_text()) for f in out.glob(f"{name}.rank*.json")
             if (m := re.search(r"rank(\d+)", f.name))}
    pairs = sorted((tuple(p), tuple(c)) for info in ranks.values() for batch in info["batches"] for p, c in batch)
    return ranks, pairs


@two_processes
@pytest.mark.parametrize("name", list(METHODS))
def test_two_processes_give_one_process_weights(name, layouts, sharp_model_dir):
    one, two = (completions(layouts[n], name) for n in (1, 2))
    assert sorted(one[0]) == [0] and sorted(two[0]) == [0, 1]
    assert two[0][0]["type"] == "DistributedType.MULTI_CPU" and two[0][0]["world"] == 2
    steps = 2 if METHODS[name]["lopti"] else 1  # Lopti: a step per stage, on the one generation batch
    for ranks, accumulation in ((one[0], 4), (two[0], 2)):
        for info in ranks.values():
            assert info["steps"] == steps and info["accumulation"] == accumulation
            assert len(info["batches"]) == 1 and len(info["batches"][0]) == P * G // len(ranks)  # its share
    assert one[1] == two[1], "the two layouts trained on different completions"
    assert len({c for _, c in one[1]}) > P and len({len(c) for _, c in one[1]}) > 1  # varied, of varied lengths
    initial = dict(lopti.load_model(str(sharp_model_dir), torch.device("cpu")).named_parameters())
    w1, w2 = (torch.load(layouts[n] / f"{name}.pt") for n in (1, 2))
    moved = max(float((w1[n] - initial[n]).abs().max()) for n in initial)
    diff = max(float((w1[n] - w2[n]).abs().max()) for n in initial)
    print(f"{name}: max |w - w0| {moved:.3g}, max |w(1 process) - w(2 processes)| {diff:.3g} ({LOPTI_PY})")
    assert moved > 100 * TOL, moved  # the step is far larger than the tolerance
    assert diff < TOL, f"{name}: two processes' weights differ from one's by {diff:.3g} (tolerance {TOL})"


def readme_trl_script() -> str:
    """toy/README's ```python block that trains with LoptiGRPOTrainer (its "TRL" section)."""
    text = (ROOT / "toy" / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "LoptiGRPOTrainer" in b)


SMOKE = r'''
"""toy/README's TRL script as written, but: the tiny model for the hub's, and 2 RL steps (4 optimiser steps, Lopti's
stages) of 2 prompts x 4 completions of <= 8 tokens (one prompt per process), on CPU."""
import json, os
import lopti, trl

tiny = os.environ["TINY_MODEL"]
real_model, real_tokenizer, real_config = lopti.load_model, lopti.load_tokenizer, trl.GRPOConfig
lopti.load_model = lambda name, *a, **k: real_model(tiny, *a, **k)
lopti.load_tokenizer = lambda name: real_tokenizer(tiny)
small = dict(max_steps=4, max_completion_length=8, num_generations=4, per_device_train_batch_size=4, use_cpu=True,
             disable_tqdm=True)
trl.GRPOConfig = lambda *a, **k: real_config(*a, **{**k, **small})
script = {"__name__": "__main__"}
exec(compile(open("readme_block.py").read(), "toy/README TRL script", "exec"), script)
accelerator = script["trainer"].accelerator
with open(f"rank{accelerator.process_index}.json", "w") as f:
    json.dump({"world": accelerator.num_processes, "type": str(accelerator.distributed_type)}, f)
'''


@two_processes
def test_readme_trl_script_runs_on_two_processes(tiny_model_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 kk_trl.py`: two processes (on a machine without a GPU,
    accelerate 1.16's `--cpu` runs one: multi-CPU goes through mpirun), each training on its share; the checkpoint
    lands in runs/trl as the script says."""
    (tmp_path / "readme_block.py").write_text(readme_trl_script())
    (tmp_path / "kk_trl.py").write_text(SMOKE)
    cli = Path(sys.executable).parent / "accelerate"  # (this Python's, else the same command as a module)
    accelerate = [str(cli), "launch"] if cli.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
    command = [*accelerate, "--multi_gpu", "--num_processes", "2", "kk_trl.py"]
    finish(start(command, tmp_path, TINY_MODEL=str(tiny_model_dir)))
    checkpoints = sorted((tmp_path / "runs" / "trl").glob("checkpoint-*"))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"world": 2, "type": "DistributedType.MULTI_CPU"}] * 2
    assert [c.name for c in checkpoints] == ["checkpoint-4"]
    assert (checkpoints[0] / "model.safetensors").is_file() and (checkpoints[0] / "trainer_state.json").is_file()
    state = json.loads((checkpoints[0] / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["train_batch_size"] == 4


def test_use_liger_kernel_is_refused_before_the_model_loads(tmp_path):
    """Liger's fused loss goes around _compute_loss (AR, Lopti's stages): refused, naming the setting, before TRL
    loads a model (here: a folder that does not exist)."""
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="dapo", use_liger_kernel=True,
                          report_to="none")
    with pytest.raises((ValueError, AssertionError), match="use_liger_kernel"):
        lopti.LoptiGRPOTrainer(str(tmp_path / "no-model"), lambda completions, **_: [0.0] * len(completions), args)
