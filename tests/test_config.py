"""Config (lopti.py's "Config" section): the paper's K&K defaults, valid presets, and every bad value refused with
a ValueError that names its field, before anything loads."""
import dataclasses
import math
import re

import pytest

import lopti
from lopti import Config


def test_defaults_are_the_papers_kk_run():
    """The paper's K&K run (official scripts/train_kklogic_*.sh): AR alpha 0.3, Lopti eta 0.5, low first."""
    cfg = Config()
    assert (cfg.alpha, cfg.lopti, cfg.eta, cfg.lopti_order) == (0.3, True, 0.5, "low_first")
    assert (cfg.epsilon, cfg.epsilon_high, cfg.dual_clip, cfg.beta) == (0.2, 0.24, 10.0, 0.001)
    assert (cfg.learning_rate, cfg.optimizer, cfg.weight_decay, cfg.max_grad_norm) == (1e-6, "adamw", 0.01, 1.0)
    assert (cfg.prompts_per_step, cfg.num_generations, cfg.mini_batch_size, cfg.num_iterations) == (64, 8, 256, 1)
    assert (cfg.temperature, cfg.max_completion_length, cfg.num_people, cfg.steps) == (0.7, 4096, "3-7", 350)
    assert (cfg.model, cfg.warmup_steps, cfg.stop_at_answer, cfg.reward) == (
        "Qwen/Qwen2.5-3B-Instruct", 0, False, "kk")  # the paper's model, no warm-up; generation to EOS; Logic-RL's reward


@pytest.mark.parametrize("name", sorted(lopti.PRESETS))
def test_presets_are_valid_configs_whose_batches_divide(name):
    """Every preset passes Config's checks; its mini-batches tile the batch and its micro-batches the mini-batch."""
    cfg = Config(**lopti.PRESETS[name])
    B = cfg.prompts_per_step * cfg.num_generations
    assert B % cfg.mini_batch_size == 0 and cfg.mini_batch_size % cfg.micro_batch_size == 0


def test_only_the_small_model_presets_warm_up():
    """'cpu' and 'colab' (135M and 0.5B models, where pure RL on K&K stalls) warm up; 'gpu', the paper's 3B, not."""
    assert Config(**lopti.PRESETS["cpu"]).warmup_steps > 0 and Config(**lopti.PRESETS["colab"]).warmup_steps > 0
    assert Config(**lopti.PRESETS["gpu"]).warmup_steps == 0


@pytest.mark.parametrize("field,value", [
    ("alpha", 1.5), ("alpha", math.nan), ("learning_rate", math.inf), ("beta", math.inf), ("temperature", math.inf),
    ("warmup_learning_rate", -math.inf), ("eta", 0.0), ("eta", 1.01), ("lopti_order", "sideways"),
    ("epsilon", -0.1), ("dual_clip", 1.0), ("beta", -1e-3), ("learning_rate", 0.0),
    ("temperature", math.nan), ("max_grad_norm", -1.0), ("steps", 0), ("save_every", -1),
    ("generation_batch_size", -2), ("num_people", "1-3"), ("num_people", "3-9"), ("num_people", "5-3"),
    ("num_people", "three"), ("optimizer", "adam"), ("mini_batch_size", 100), ("mini_batch_size", 0),
    ("warmup_steps", -1), ("seed", -3), ("reward", "logic_rl")])
def test_bad_values_are_refused_with_the_fields_name(field, value):
    """nan, infinity, out of range, a bad name: one ValueError naming the field (a flag's type is argparse's check)."""
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


def test_a_mini_batch_that_micro_batches_do_not_tile_is_refused():
    """mini_batch_size must divide prompts_per_step * num_generations and be a multiple of micro_batch_size."""
    with pytest.raises(ValueError, match="mini_batch_size"):
        Config(prompts_per_step=4, num_generations=8, mini_batch_size=16, micro_batch_size=3)
    assert Config(prompts_per_step=4, num_generations=8, mini_batch_size=16, micro_batch_size=4).mini_batch_size == 16


def test_micro_batch_size_zero_is_a_value_error():
    """micro_batch_size = 0 is a bad value like any other: a ValueError naming it (main turns it into one line)."""
    with pytest.raises(ValueError, match="micro_batch_size"):
        Config(micro_batch_size=0)


def test_read_config_gives_every_field_and_refuses_a_file_without_settings(tmp_path):
    """A config.json of an older run (fewer fields) reads with the defaults for the rest, and "method" and "version"
    are left out; a file that is not JSON, JSON but not an object, or a model's config.json (no "lopti" field) is one
    ValueError naming the file."""
    path = tmp_path / "config.json"
    path.write_text('{"seed": 5, "alpha": 0.1, "lopti": true, "method": "ar_lopti", "version": "x"}')
    assert lopti.read_config(path) == {**dataclasses.asdict(Config()), "seed": 5, "alpha": 0.1}
    for text in ("{not json", "[1, 2]", '"text"', '{"model_type": "qwen2", "vocab_size": 512}'):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(str(path))) as err:
            lopti.read_config(path)
        assert "\n" not in str(err.value)
