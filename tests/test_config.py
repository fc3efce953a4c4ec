"""Config (lopti.py's "Config" section): the paper's defaults, the presets, and every bad value refused."""
import math

import pytest

import lopti
from lopti import Config


def test_defaults_are_the_papers_kk_run():
    cfg = Config()
    assert (cfg.alpha, cfg.lopti, cfg.eta, cfg.lopti_order) == (0.3, True, 0.5, "low_first")
    assert (cfg.epsilon, cfg.epsilon_high, cfg.dual_clip, cfg.beta) == (0.2, 0.24, 10.0, 0.001)
    assert (cfg.learning_rate, cfg.weight_decay, cfg.max_grad_norm, cfg.num_iterations) == (1e-6, 0.01, 1.0, 1)
    assert (cfg.prompts_per_step, cfg.num_generations, cfg.mini_batch_size) == (64, 8, 256)  # 2 steps per pass
    assert (cfg.temperature, cfg.max_completion_length, cfg.num_people) == (0.7, 4096, "3-7")
    assert (cfg.format_reward, cfg.stop_at_answer) == (0.0, False)  # the paper's reward, generation to EOS


@pytest.mark.parametrize("name", sorted(lopti.PRESETS))
def test_presets_are_valid_configs_whose_batches_divide(name):
    cfg = Config(**lopti.PRESETS[name])
    B = cfg.prompts_per_step * cfg.num_generations
    assert B % cfg.mini_batch_size == 0 and cfg.mini_batch_size % cfg.micro_batch_size == 0


def test_only_the_laptop_preset_changes_the_reward():
    assert Config(**lopti.PRESETS["cpu"]).format_reward > 0
    assert all(Config(**lopti.PRESETS[p]).format_reward == 0 for p in ("colab", "gpu"))


@pytest.mark.parametrize("field,value", [
    ("alpha", 1.5), ("alpha", math.nan), ("eta", 0.0), ("eta", 1.01), ("lopti_order", "sideways"),
    ("epsilon", -0.1), ("epsilon_high", math.inf), ("dual_clip", 1.0), ("beta", math.inf), ("beta", -1e-3),
    ("learning_rate", 0.0), ("learning_rate", math.inf), ("weight_decay", math.inf), ("max_grad_norm", -1.0),
    ("temperature", math.nan), ("format_reward", -1.0), ("micro_batch_size", 0), ("steps", 0), ("save_every", -1),
    ("generation_batch_size", -2), ("num_people", "1-3"), ("num_people", "3-9"), ("num_people", "5-3"),
    ("num_people", "three"), ("steps", 2.5), ("lopti", "yes"), ("num_generations", True), ("model", None),
    ("seed", -3), ("optimizer", "adam")])
def test_bad_values_are_refused_with_the_fields_name(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})
