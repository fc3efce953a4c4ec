"""Figure 3 as the paper measured it: every training step's own update, counted per pi_old bin (update_counts in
train_step), and `python lopti.py fig3` pooling runs."""
import copy
import dataclasses
import json

import pytest
import torch
from conftest import tiny_config, varied_reward

import lopti

CPU = torch.device("cpu")
BATCHED_LOGPROBS = lopti.batched_logprobs


def _step(model_dir, monkeypatch, optimizer=None, **overrides):
    cfg = tiny_config(model_dir, "unused", beta=0.0, temperature=1.0, mini_batch_size=8, **overrides)
    model, tok = lopti.load_model(str(model_dir), CPU), lopti.load_tokenizer(str(model_dir))
    forwards, passes, real = [], [], BATCHED_LOGPROBS

    def spy(*args):  # the forwards of each no-grad pass
        n = len(forwards)
        out = real(*args)
        passes.append(len(forwards) - n)
        return out

    monkeypatch.setattr(lopti, "batched_logprobs", spy)
    decoder = lopti.decoder_and_head(model)[0]  # (the passes call the decoder and the head apart)
    decoder.register_forward_pre_hook(lambda *a: forwards.append(torch.is_grad_enabled()))
    torch.manual_seed(0)
    opt = optimizer(model) if optimizer else lopti.make_optimizer(model, cfg)
    return lopti.train_step(cfg, model, None, tok, opt, lopti.kk_generate(2, 3, seed=0), CPU), forwards, passes


@pytest.mark.parametrize("bf16", [False, True])
def test_a_token_whose_weights_did_not_move_compares_equal(tiny_model_dir, monkeypatch, bf16):
    """The measurement repeats pi_old's pass (precision, rows, micro-batches, trim): after an update that moves
    nothing (SGD at lr 0) no token rose or fell and every change is exactly 0, in fp32 and under bf16 autocast, where a
    forward of another path (fp32, or other micro-batches) differs from pi_old's by bf16's rounding."""
    monkeypatch.setenv("LOPTI_CPU_BF16", "1" if bf16 else "0")
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    m, *_ = _step(tiny_model_dir, monkeypatch, lambda model: torch.optim.SGD(model.parameters(), lr=0.0))
    assert sum(m["update/pos_tokens"]) > 0 and sum(m["update/neg_tokens"]) > 0
    assert m["update/pos_rose"] == m["update/neg_fell"] == [0] * 4
    assert {v for k in ("pos_change", "neg_change") for v in m[f"update/{k}"] if v is not None} == {0.0}
    m, *_ = _step(tiny_model_dir, monkeypatch)  # a real AdamW step moves them
    assert sum(m["update/pos_rose"]) > 0 and sum(m["update/neg_fell"]) > 0


def test_under_bf16_the_measurement_is_fp32_and_agrees_with_an_independent_one(tiny_model_dir, monkeypatch):
    """At the paper's lr 1e-6 an update moves a log-prob by far less than bf16's rounding, so a bf16 measurement is
    noise (pi_old's own bf16 pass against a bf16 pass after the step gets the sign of many changes wrong). Under bf16
    the measurement's before and after are fp32 passes: its counts equal an fp32 recomputation of the whole batch
    with the weights from before and after the step."""
    monkeypatch.setenv("LOPTI_CPU_BF16", "1")
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    cfg = tiny_config(tiny_model_dir, "unused", beta=0.0, temperature=1.0, mini_batch_size=8, learning_rate=1e-6)
    model, tok = lopti.load_model(str(tiny_model_dir), CPU), lopti.load_tokenizer(str(tiny_model_dir))
    start, seen = copy.deepcopy(model), {}
    monkeypatch.setattr(lopti, "batched_logprobs", lambda m, batch, *a: seen.setdefault("batch", batch) and
                        BATCHED_LOGPROBS(m, batch, *a))
    torch.manual_seed(0)
    m = lopti.train_step(cfg, model, None, tok, lopti.make_optimizer(model, cfg), lopti.kk_generate(2, 3, seed=0), CPU)
    b = seen["batch"]
    with torch.no_grad():
        old, new = (lopti.completion_logprobs(x, b, cfg.temperature) for x in (start, model))  # fp32: no autocast
    expected = lopti.update_counts(old, new, b["advantages"], b["mask"], b["old_logprobs"])  # binned by pi_old
    assert sum(m["update/pos_rose"]) > 0 and all(m[k] == expected[k] for k in expected if "change" not in k), (
        m, expected)
    bf16 = lopti.update_counts(b["old_logprobs"], lopti.batched_logprobs(model, b, cfg, CPU), b["advantages"],
                               b["mask"])  # what a bf16 measurement would log
    assert bf16["update/pos_rose"] != expected["update/pos_rose"]


def test_switched_off_it_runs_no_forward(tiny_model_dir, monkeypatch):
    """measure_update true costs one no-grad forward per pi_old micro-batch; false none, and logs no update/ key."""
    monkeypatch.setattr(lopti, "kk_reward", varied_reward)
    on, f_on, p_on = _step(tiny_model_dir, monkeypatch)
    off, f_off, p_off = _step(tiny_model_dir, monkeypatch, measure_update=False)
    assert len(p_on) == 2 and p_on[0] == p_on[1] > 0 and p_off == p_on[:1]  # pi_old's pass, then the measurement's
    assert len(f_on) - len(f_off) == p_on[0] and f_off[-1]  # (off: the update's forward is the last)
    assert f_on[-p_on[0]:] == [False] * p_on[0]  # the measurement: after the update, without grad
    assert not [k for k in off if k.startswith("update/")] and "time/measure" not in off
    assert on["low/loss"] == off["low/loss"]


def test_a_step_with_nothing_to_measure_logs_zeros_and_null(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lopti, "kk_reward", lambda text, sol: -1.0)  # every group alike: no advantage
    lopti.train(tiny_config(tiny_model_dir, tmp_path / "run", beta=0.0, steps=1))
    line = lopti.read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert line["update/pos_tokens"] == line["update/pos_rose"] == line["update/neg_tokens"] == [0] * 4
    assert line["update/pos_change"] == line["update/neg_change"] == [None] * 4
    json.dumps(line, allow_nan=False)


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fig3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lopti, "kk_reward", varied_reward)
        for seed in (0, 1):
            lopti.train(tiny_config(tiny_model_dir, out / f"s{seed}", seed=seed, steps=3, mini_batch_size=8,
                                    alpha=0.0, lopti=False, save_every=0))
    return out / "s0", out / "s1"


def test_pooling_two_runs_is_the_sum_of_their_counts(two_runs, tmp_path):
    table = lopti.figure_3(list(two_runs), tmp_path / "f.png")
    lines = [r for run in two_runs for r in lopti.read_jsonl(run / "metrics.jsonl")]
    t = table["GRPO"]  # both runs are GRPO: one pooled row
    for key in ("pos_tokens", "pos_rose", "neg_tokens", "neg_fell"):
        assert t[key] == [sum(r[f"update/{key}"][b] for r in lines) for b in range(4)], key
    assert t["steps"] == 6 and sum(t["pos_tokens"]) > 0
    for v, lo, hi in zip(t["ratio"], t["low"], t["high"]):
        assert v is None or lo <= v <= hi  # the pooled ratio inside its bootstrap interval
    per_run = lopti.figure_3(list(two_runs), tmp_path / "g.png", per_run=True)
    assert list(per_run) == ["GRPO, s0", "GRPO, s1"]  # labelled by run folder
    assert [a + b for a, b in zip(*(per_run[k]["pos_rose"] for k in per_run))] == t["pos_rose"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_fig3_of_a_folder_without_counts_is_one_line(two_runs, tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text((two_runs[0] / "config.json").read_text())
    lines = [{k: v for k, v in r.items() if not k.startswith("update/")} for r in lopti.read_jsonl(
        two_runs[0] / "metrics.jsonl")]
    (tmp_path / "old" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for folder, match in ((tmp_path / "old", "logged no update/ counts"), (tmp_path / "none", "holds no metrics")):
        assert lopti.main(["fig3", str(folder), "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err


def _synthetic_run(folder, steps, **settings):
    """A run folder with config.json and a metrics.jsonl line per step of (pos_tokens, pos_rose) per bin."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(lopti.Config(**settings))))
    lines = [{"step": i + 1, "update/pos_tokens": n, "update/pos_rose": r, "update/neg_tokens": [1, 0, 0, 0],
              "update/neg_fell": [1, 0, 0, 0], "update/pos_change": [0.0] * 4, "update/neg_change": [-0.1, None, None,
                                                                                                     None]}
             for i, (n, r) in enumerate(steps)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def test_fig3_intervals_labels_order_and_refusals(tmp_path, capsys):
    """Identical steps give an interval of width 0; unlike steps one that holds the pooled ratio and spans the
    steps' own ratios' range at most; methods come in the paper's order, SGD runs labelled; runs that differ in a
    setting other than the seed are not pooled (one line), unless --per_run."""
    same = [([4, 2, 0, 10], [2, 1, 0, 5])] * 3
    mixed = [([10, 0, 0, 10], [10, 0, 0, 2]), ([10, 0, 0, 10], [0, 0, 0, 8])]
    runs = [_synthetic_run(tmp_path / "a", mixed, alpha=0.3, lopti=True),
            _synthetic_run(tmp_path / "b", same, alpha=0.0, lopti=False, seed=1),
            _synthetic_run(tmp_path / "c", same, alpha=0.0, lopti=False, seed=2),
            _synthetic_run(tmp_path / "d", same, alpha=0.0, lopti=False, optimizer="sgd", learning_rate=1e-3)]
    table = lopti.figure_3(runs, tmp_path / "f.png")
    assert list(table) == ["GRPO", "GRPO, SGD lr 0.001", "AR+Lopti"]
    g = table["GRPO"]
    assert g["ratio"] == [0.5, 0.5, None, 0.5] and g["low"][0] == g["high"][0] == 0.5 and g["runs"] == 2
    a = table["AR+Lopti"]
    assert a["ratio"] == [0.5, None, None, 0.5] and 0 <= a["low"][0] < 0.5 < a["high"][0] <= 1
    assert a["low"][3] >= 0.2 and a["high"][3] <= 0.8  # no resample leaves the steps' own range
    out = capsys.readouterr().out
    assert "A<0 tokens that fell: 1.000 | - | - | -" in out and "paper (K&K" in out
    low_run = _synthetic_run(tmp_path / "x" / "s0", [([10, 0, 0, 10], [2, 0, 0, 2])] * 4, alpha=0.0)
    high_run = _synthetic_run(tmp_path / "y" / "s1", [([10, 0, 0, 10], [8, 0, 0, 8])] * 4, alpha=0.0)
    lopti_runs = lopti.figure_3([low_run, high_run], tmp_path / "h.png")["Lopti"]  # steps alike within a run:
    assert lopti_runs["ratio"][0] == 0.5 and lopti_runs["low"][0] <= 0.25 and lopti_runs["high"][0] >= 0.75  # runs vary
    with pytest.raises(ValueError, match="two runs are named s0"):
        lopti.figure_3([low_run, _synthetic_run(tmp_path / "z" / "s0", same, alpha=0.0)], tmp_path / "h.png", True)
    other = _synthetic_run(tmp_path / "e", same, alpha=0.0, lopti=False, num_iterations=2)
    assert lopti.main(["fig3", str(runs[1]), str(other), "--out", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the GRPO runs differ in num_iterations" in err, err
    assert lopti.main(["fig3", str(runs[1]), str(other), "--per_run", "--out", str(tmp_path / "g.png")]) == 0
