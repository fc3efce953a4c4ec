"""LoptiGRPOTrainer (lopti.py's TRL section) against update_policy: on the batch TRL generated, one RL step gives
update_policy's weights for GRPO, AR, Lopti and AR+Lopti (Algorithm 1's two passes as two optimiser steps); with
alpha = 0 and Lopti off it is trl.GRPOTrainer itself; `import lopti` never imports TRL; bad knobs are refused."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
import datasets  # noqa: E402

import lopti  # noqa: E402
from conftest import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
P, G, MICRO, T, TEMP = 2, 4, 2, 12, 0.7  # 8 completions, 4 micro-batches of 2 per optimiser step, <= 12 tokens


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory) -> Path:
    """conftest's tiny model, its (tied) embeddings x3.5 so that pi_old spreads over (0, 1) and Lopti's split has
    tokens on both sides, and a tenth of the vocabulary as extra EOS ids so that completions differ in length."""
    path = make_tiny_model(tmp_path_factory.mktemp("sharp"))
    model, tokenizer = lopti.load_model(str(path), CPU), lopti.load_tokenizer(str(path))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.5)
    model.generation_config.eos_token_id += list(range(3, len(tokenizer), 10))  # lengths vary
    model.save_pretrained(path)
    return path


def vowel_share(completions, **_):
    """A reward with variance inside every group of a random model."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def grpo_args(out: Path, **kw):
    """A GRPOConfig with lopti's update settings: AdamW 0.9/0.999/1e-8, constant LR, token-mean ("dapo"), plain
    sampling at TEMP (no top-k/top-p/penalty: pi_old is what the tokens were drawn from)."""
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
    """Trains `args.max_steps` optimiser steps on one generation batch; returns the trainer and that batch as TRL
    made it (before LoptiGRPOTrainer's AR), with pi_old and the reference log-probs if TRL computed them."""
    data = datasets.Dataset.from_dict({"prompt": ["Hello there", "A very special island"]})
    trainer = cls(str(model_dir), vowel_share, args=args, train_dataset=data,
                  processing_class=lopti.load_tokenizer(str(model_dir)), **knobs)
    seen, parent = [], trl.GRPOTrainer._generate_and_score_completions

    def capture(self, inputs):
        raw = parent(self, inputs)
        seen.append(dict(raw))  # TRL's own fields, before LoptiGRPOTrainer replaces the advantages
        return raw

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trl.GRPOTrainer, "_generate_and_score_completions", capture)
        trainer.train()
    assert len(seen) == 1, "one generation batch per RL step"
    return trainer, seen[0]


def update_policy_step(model_dir: Path, trainer, raw: dict, cfg: lopti.Config, optim: str) -> dict:
    """lopti.update_policy on the trainer's batch, from the initial weights, with the trainer's optimiser groups
    (no weight decay on biases and norms, as the HF Trainer). Returns the parameters after it."""
    model = lopti.load_model(str(model_dir), CPU)
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
    if "old_per_token_logps" in raw:  # TRL's pi_old is lopti's: the same temperature, the same tokens
        m = batch["mask"]
        torch.testing.assert_close(raw["old_per_token_logps"][m], batch["old_logprobs"][m], atol=1e-5, rtol=0)
        batch["old_logprobs"] = raw["old_per_token_logps"]
    if "ref_per_token_logps" in raw:
        batch["ref_logprobs"] = raw["ref_per_token_logps"]
    lopti.update_policy(cfg, logprob_fn, optimizer, batch)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def distance(a: dict, b: dict, initial: dict) -> float:
    """|a - b| / |a - initial| over all parameters. AdamW's first steps divide each gradient by its own size, which
    turns float rounding in a near-zero gradient into a visible difference of that one weight: compare norms."""
    return (sum(float((a[n] - b[n]).detach().square().sum()) for n in b) / sum(
        float((a[n] - initial[n]).detach().square().sum()) for n in b)) ** 0.5


METHODS = {"grpo": dict(alpha=0.0, lopti=False), "ar": dict(alpha=0.3, lopti=False),
           "lopti": dict(alpha=0.0, lopti=True), "ar_lopti": dict(alpha=0.3, lopti=True, beta=0.05)}  # + the KL


@pytest.mark.parametrize("method,optim", [(m, "adamw_torch") for m in METHODS] + [("ar_lopti", "sgd")])
def test_one_rl_step_gives_update_policys_weights(method, optim, sharp_model_dir, tmp_path):
    """The same batch through LoptiGRPOTrainer and update_policy: the same weights (AdamW: to 3e-4 of the step, its
    first step is ~sign(g); SGD, linear in g: to 2e-6), while flipping AR or Lopti moves them > 1e-2 away."""
    knobs = {"eta": 0.3, "lopti_order": "low_first", "dual_clip": 10.0, **METHODS[method]}
    beta = knobs.pop("beta", 0.0)
    lr, steps = (1e-3 if optim == "adamw_torch" else 0.3), (2 if knobs["lopti"] else 1)  # Lopti: a step per stage
    args = grpo_args(tmp_path, beta=beta, max_steps=steps, optim=optim, learning_rate=lr)
    trainer, raw = run_trainer(lopti.LoptiGRPOTrainer, sharp_model_dir, args, **knobs)
    mask = raw["completion_mask"].bool()
    assert len(set(mask.sum(1).tolist())) > 1 and raw["advantages"].abs().min() > 0  # lengths vary, no zero row
    cfg = lopti.Config(**knobs, beta=beta, epsilon=0.2, epsilon_high=0.24, learning_rate=lr, weight_decay=0.1,
                       max_grad_norm=1.0, temperature=TEMP, mini_batch_size=P * G, micro_batch_size=MICRO,
                       prompts_per_step=P, num_generations=G, optimizer="sgd" if optim == "sgd" else "adamw")
    if cfg.lopti:  # both stages hold tokens: update_policy steps in each, as TRL does
        low, high = lopti.lopti_masks(raw["old_per_token_logps"], mask, cfg.eta)
        assert low.any() and high.any()
    initial = {n: p.detach().clone() for n, p in lopti.load_model(str(sharp_model_dir), CPU).named_parameters()}
    got = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert trainer.state.global_step == steps
    assert distance(got, update_policy_step(sharp_model_dir, trainer, raw, cfg, optim), initial) < (
        3e-4 if optim == "adamw_torch" else 2e-6)  # (measured: 1e-5 to 4e-5, and 2.4e-7)
    for flipped in (dict(alpha=0.3 - cfg.alpha), dict(lopti=not cfg.lopti)):  # the comparison discriminates
        other = update_policy_step(sharp_model_dir, trainer, raw, dataclasses.replace(cfg, **flipped), optim)
        assert distance(got, other, initial) > 1e-2, flipped


@pytest.mark.parametrize("batching", [{}, dict(gradient_accumulation_steps=2, steps_per_generation=4, max_steps=2)])
def test_alpha_zero_without_lopti_is_trls_grpo(batching, sharp_model_dir, tmp_path):
    """alpha = 0 and Lopti off: trl.GRPOTrainer's weights and losses, also with two optimiser steps per generation
    batch (TRL's "dapo" normaliser is then the mean mini-batch's token count: LoptiGRPOTrainer's must match)."""
    ours, raw_ours = run_trainer(lopti.LoptiGRPOTrainer, sharp_model_dir, grpo_args(tmp_path / "a", **batching),
                                 alpha=0.0, lopti=False)
    theirs, raw_theirs = run_trainer(trl.GRPOTrainer, sharp_model_dir, grpo_args(tmp_path / "b", **batching))
    assert torch.equal(raw_ours["completion_ids"], raw_theirs["completion_ids"])  # the same batch
    initial = {n: p.detach().clone() for n, p in lopti.load_model(str(sharp_model_dir), CPU).named_parameters()}
    params = [{n: p.detach() for n, p in t.model.named_parameters()} for t in (ours, theirs)]
    assert distance(*params, initial) < 1e-5  # (measured: 0 on CPU; both use TRL's forward)
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (ours, theirs)]  # scale-sensitive
    assert len(losses[0]) == batching.get("max_steps", 1) and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_import_lopti_does_not_import_trl():
    code = "import sys, lopti; sys.exit(3 if 'trl' in sys.modules else 0)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_trainer_class_is_made_once_and_subclasses_trl():
    assert lopti.LoptiGRPOTrainer is lopti.LoptiGRPOTrainer and issubclass(lopti.LoptiGRPOTrainer, trl.GRPOTrainer)
    with pytest.raises(AttributeError, match="NoSuchThing"):
        lopti.NoSuchThing  # noqa: B018  (the module __getattr__ serves only LoptiGRPOTrainer)


@pytest.mark.parametrize("knobs,args,match", [
    ({}, dict(loss_type="grpo"), "dapo"),  # the loss is the token-mean; another would be silently replaced
    ({"eta": 0.0}, {}, "eta"), ({"alpha": 1.5}, {}, "alpha"), ({"lopti_order": "sideways"}, {}, "lopti_order"),
    ({"dual_clip": 1.0}, {}, "dual_clip"),
    ({}, dict(steps_per_generation=6), "steps_per_generation"),  # an optimiser step would span both stages
    ({}, dict(use_vllm=True), "vllm_importance_sampling_correction")])  # TRL's loss applies it; this one would not
def test_bad_knobs_are_refused_before_the_model_loads(knobs, args, match, tmp_path):
    """Refused with a message naming the setting, before TRL loads a model (here: a folder that does not exist)."""
    config = grpo_args(tmp_path, **args)  # (TRL accepts it)
    with pytest.raises((ValueError, AssertionError), match=match):
        lopti.LoptiGRPOTrainer(str(tmp_path / "no-model"), vowel_share, config, **knobs)
