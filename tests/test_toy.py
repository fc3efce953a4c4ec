"""Tests of the toy experiment (`python lopti.py toy`): it runs, it is deterministic, and it measures
what it says (the bound, a partition of tokens into bins, the update of each method)."""
import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import lopti
from lopti import (TOY_METHODS, ToySettings, bin_masks, bound_check, make_optimizer, toy_config,
                   toy_logprobs, toy_rollout, toy_warm_start, update_policy)

def toy_main(argv):
    return lopti.toy_main(lopti.build_parser().parse_args(["toy", *argv]))


SECTIONS = ("settings", "bound", "warm_start", "figures", "learning", "checks")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    results = toy_main(["--quick", "--out", str(out)])
    return results, out


def test_quick_run_writes_every_section(quick_run):
    results, out = quick_run
    saved = json.loads((out / "results.json").read_text())
    assert all(k in saved for k in SECTIONS)
    assert saved == json.loads(json.dumps(results))
    assert not (out / "results.json.tmp").exists()
    for m, v in saved["learning"]["methods"].items():  # Figure 3 on every method's own updates, every seed
        assert set(v["fig3"]) == {*lopti.UPDATE_KEYS, "seeds"} and len(v["fig3"]["seeds"]) == saved["settings"]["seeds"]
        assert sum(v["fig3"]["pos_tokens"]) > 0, m
    assert len(saved["learning"]["methods"]["grpo"]["curve"]["mean"]) == saved["settings"]["steps"]


def test_bound_has_no_violation(quick_run):
    for name, b in quick_run[0]["bound"].items():
        assert b["violations"] == 0, name
        assert b["bound_lo"] - 1e-9 <= b["ratio_min"] <= b["ratio_max"] <= b["bound_hi"] + 1e-9


def test_bound_tight_cases():
    N = 16
    uniform_rest = torch.zeros(1, N).index_fill(1, torch.tensor([0]), 2.0)  # rest uniform: lower bound exact
    one_rival = torch.full((1, N), -80.0).index_fill(1, torch.tensor([0, 1]), 0.0)  # one rival: upper exact
    lo = bound_check(uniform_rest, torch.tensor([0]))
    hi = bound_check(one_rival, torch.tensor([0]))
    assert lo["ratio_min"] == pytest.approx(math.sqrt(N / (N - 1)), rel=1e-12)
    assert hi["ratio_max"] == pytest.approx(math.sqrt(2), rel=1e-12)
    assert bound_check(torch.tensor([[60.0, 0.0, 0.0]]), torch.tensor([0]))["unresolved"] == 1


def test_bins_partition_the_tokens(quick_run):
    share = quick_run[0]["figures"]["token_share"]
    assert sum(share["all"]["mean"]) == pytest.approx(1.0, abs=1e-5)  # (rounded to 6 digits)
    assert sum(share["nonzero_advantage"]["mean"]) == pytest.approx(1.0, abs=1e-5)
    logp = torch.tensor([[1.0, 0.25, 0.2500001, 0.5, 0.75, 0.9, 1e-9, 0.3]]).clamp_min(1e-12).log()
    masks = bin_masks(logp, torch.tensor([[True] * 7 + [False]]))
    assert masks.sum(0).tolist() == [[1] * 7 + [0]]  # each token in one bin; padding in none
    assert masks.int().argmax(0)[:, :7].tolist() == [[3, 0, 1, 1, 2, 3, 0]]


def _updated_params(net, s, method, batch):
    net2 = copy.deepcopy(net)
    cfg = toy_config(s, method)
    update_policy(cfg, lambda micro: toy_logprobs(net2, micro), make_optimizer(net2, cfg), batch)
    return torch.cat([p.detach().flatten() for p in net2.parameters()])


def test_methods_differ_and_alpha_zero_is_grpo():
    s = ToySettings(warmup_steps=10)
    net, rule = toy_warm_start(s)
    batch = toy_rollout(net, rule, s, torch.Generator().manual_seed(0))
    after = {m: _updated_params(net, s, m, batch) for m in TOY_METHODS}
    names = list(after)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.equal(after[a], after[b]), (a, b)
    assert torch.equal(_updated_params(net, dataclasses.replace(s, alpha=0.0), "ar", batch), after["grpo"])


def test_same_seed_same_json(quick_run, tmp_path):
    toy_main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").read_bytes() == (quick_run[1] / "results.json").read_bytes()


def test_outcome_reward_is_all_or_nothing_and_dense_is_the_share():
    rule = torch.tensor([[1, 2, 0, 0], [2, 0, 1, 0]])  # rule[prompt, previous token]; BOS is id 3 (the last column)
    tokens = torch.tensor([[0, 1, 2], [0, 1, 0]])  # prompt 0 from BOS: 0 follows, then rule[0,0] = 1, rule[0,1] = 2
    prompts = torch.tensor([0, 0])
    assert lopti.toy_rewards(rule, prompts, tokens).tolist() == [1.0, 0.0]
    assert lopti.toy_rewards(rule, prompts, tokens, outcome=False).tolist() == pytest.approx([1.0, 2 / 3])
    wrong_first = torch.tensor([[2, 0, 1]])  # 2 breaks the rule (rule[0, BOS] = 0); then 0 and 1 follow it
    assert lopti.toy_rewards(rule, prompts[:1], wrong_first).item() == 0.0
    assert lopti.toy_rewards(rule, prompts[:1], wrong_first, answer_len=2).item() == 1.0  # only the answer counts


@pytest.mark.parametrize("bad", [["--seeds", "0"], ["--reward", "sparse"], ["--answer_len", "13"],
                                 ["--eta", "2"], ["--eta", "0"], ["--steps", "-1"],
                                 ["--alpha", "-0.1"], ["--alpha", "1.5"], ["--seed", "-3"], ["--steps", "x"]])
def test_bad_options_are_one_line_and_exit_2(bad, tmp_path, capsys):
    try:  # argparse (a value that is not a number) or Config's range checks, as train's: one line, exit 2
        code = lopti.main(["toy", *bad, "--quick", "--out", str(tmp_path)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and bad[0].lstrip("-") in err, err


def test_only_the_default_run_writes_toy_folder(monkeypatch, tmp_path):
    """Only the run with no setting given goes to toy/ (the README's committed figure), with ToySettings' defaults;
    any setting given, even at its default value, sends it to runs/toy/ unless --out says otherwise."""
    monkeypatch.chdir(tmp_path)
    parse = lambda *argv: lopti.build_parser().parse_args(["toy", *argv])  # noqa: E731
    written = []
    monkeypatch.setattr(lopti, "run_toy", lambda s: written.append(s) or {"settings": {}})
    monkeypatch.setattr(lopti, "toy_checks", lambda r: [])
    monkeypatch.setattr(lopti, "plot_toy", lambda r, path: written.append(path))
    lopti.toy_main(parse("--quick"))
    lopti.toy_main(parse("--seed", "3"))
    lopti.toy_main(parse())
    lopti.toy_main(parse("--quick", "--out", "mine"))
    lopti.toy_main(parse("--steps", str(ToySettings.steps)))
    folders = [w.parent for w in written if isinstance(w, Path)]
    assert folders == [Path("runs/toy"), Path("runs/toy"), Path("toy"), Path("mine"), Path("runs/toy")]
    settings = [w for w in written if isinstance(w, ToySettings)]
    assert settings[2] == ToySettings() and settings[1] == ToySettings(seed=3)
    assert settings[0] == ToySettings(**lopti.TOY_QUICK)


def test_one_seed_is_never_clear_evidence():
    """A paired difference over n = 1 has no spread to compare with: it is reported, never called clear."""
    assert lopti.toy_paired({"mean": 0.001, "std": 0.0}, 1)["clear"] is False
    assert lopti.toy_paired({"mean": 0.1, "std": 0.01}, 4)["clear"] is True
