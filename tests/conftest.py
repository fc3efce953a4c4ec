"""Test setup: import lopti.py from the repository root, and never reach for a model hub."""
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a stray hub call fails at once instead of retrying
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import json  # noqa: E402

import pytest  # noqa: E402

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DATA = Path(__file__).parent / "data" / "kk"


def _corpus() -> list[str]:
    rows = [json.loads(line) for f in sorted(DATA.glob("*.jsonl")) for line in f.read_text().splitlines()]
    return [r["quiz"] + "\n" + r["solution_text_format"] for r in rows] + [
        "<think> Let me think. </think><answer> (1) Zoey is a knight\n(2) Oliver is a knave </answer>"]


def make_tiny_model(path: Path, arch: str = "qwen2") -> Path:
    """A random 2-layer causal LM, hidden 64, with a byte-level BPE tokenizer trained here and a ChatML
    template; saved with save_pretrained so tests load it by path, as users load a hub model."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=CHATML)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    torch.manual_seed(0)
    if arch == "qwen2":
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"],
                             pad_token_id=ids["<|endoftext|>"])
        model = Qwen2ForCausalLM(config)
    else:  # absolute position embeddings: wrong log-probs for left-padded rows without position_ids
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=4096,
                            eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
        model = GPT2LMHeadModel(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]  # two EOS ids, like Qwen
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), arch="gpt2")


def tiny_config(model_dir, out_dir, **overrides):
    """A Config for two quick RL steps of a tiny model (2 prompts x 4 samples, 12 tokens)."""
    from lopti import Config

    base = dict(model=str(model_dir), output_dir=str(out_dir), prompts_per_step=2, num_generations=4,
                max_completion_length=12, mini_batch_size=4, micro_batch_size=2, steps=2, num_train=16,
                num_people="3", eval_size=2, eval_every=0, eval_batch_size=4, save_every=1, learning_rate=1e-3,
                weight_decay=0.0)
    return Config(**{**base, **overrides})


def varied_reward(text: str, solution: str) -> float:
    """A stand-in reward with variance inside groups (a random tiny model always scores -3 on K&K)."""
    return float(sum(map(ord, text)) % 5)


def fixed_rewards(monkeypatch, values) -> None:
    """Make lopti.kk_rewards return `values` (B,), whatever was sampled: advantages chosen by the test."""
    import torch

    import lopti

    r = torch.tensor(values, dtype=torch.float)
    monkeypatch.setattr(lopti, "kk_rewards", lambda texts, solutions: r.clone())


def exit_code(argv) -> int:
    """`python lopti.py ARGV`'s exit code, run through main (argparse's exit included)."""
    import lopti

    try:
        return lopti.main([str(a) for a in argv])
    except SystemExit as e:
        return e.code
