"""Tests of the toy (`python lopti.py toy`): Figure 3's mechanism on a linear softmax policy. The rollout and its
reward, the policy's designed biases, the trajectories with paired probes (Figure 3 paired), run_toy's results and
the command line. Tiny settings keep the file to a few seconds."""
import dataclasses
import importlib.util
import itertools
import math
import json
import shutil
from pathlib import Path

import pytest
import torch

import lopti
from lopti import (TOY_OWN_RUNS, TOY_PAIRED, ToyPolicy, ToySettings, run_toy, toy_logprobs, toy_rollout,
                   toy_trajectory)

S = ToySettings(seeds=1, steps=2)  # the toy's default policy and task
SMALL = ToySettings(**lopti.TOY_QUICK, vocab=64)  # --quick with a smaller vocabulary: fast, and every method's
# update shows in the counts


def updates(traj):
    """A trajectory's rewards and own update counts."""
    return traj["reward"], traj["counts"]


# --- the policy and the rollout ---
def test_only_the_weight_is_trained():
    """W is the only parameter: contexts, token features, biases and targets stay fixed."""
    net = ToyPolicy(S, 0)
    assert [name for name, _ in net.named_parameters()] == ["weight"]


def test_reward_is_one_iff_the_decision_tokens_equal_the_target():
    """Outcome reward: 1 iff the first `decisions` tokens are the prompt's target, whatever the format tokens."""
    s = ToySettings(vocab=8, dim=4, prompts=2, group=3, length=3, decisions=2)
    net = ToyPolicy(s, 0)
    net.target = torch.tensor([[1, 2], [3, 4]])
    tokens = torch.tensor([[1, 2, 5], [1, 5, 2], [2, 1, 0],  # prompt 0: right, second wrong, swapped
                           [3, 4, 4], [3, 4, 0], [4, 4, 4]])  # prompt 1: right, right (other format), first wrong
    sample = net.sample
    net.sample = lambda prompts, gen: {**sample(prompts, gen), "tokens": tokens}
    batch = toy_rollout(net, torch.Generator().manual_seed(0))
    assert batch["rewards"].tolist() == [1, 0, 0, 1, 1, 0]
    # group advantages (r - mean) / std: group [1, 0, 0] -> (2/3, -1/3, -1/3) / 0.57735
    assert batch["advantages"].tolist() == pytest.approx([1.1547, -0.57735, -0.57735, 0.57735, 0.57735, -1.1547],
                                                         abs=1e-4)
    assert batch["mask"].all() and batch["mask"].shape == tokens.shape


def test_rollout_rewards_match_targets_on_sampled_batches():
    """On a sampled batch of the default task (some hits, some misses), reward = the decision tokens hit."""
    net = ToyPolicy(S, 0)
    batch = toy_rollout(net, torch.Generator().manual_seed(0))
    prompts = torch.arange(S.prompts).repeat_interleave(S.group)
    hit = [row[:S.decisions].tolist() == net.target[p].tolist() for row, p in zip(batch["tokens"], prompts)]
    assert batch["rewards"].tolist() == [float(h) for h in hit] and 0 < sum(hit) < len(hit)
    assert batch["tokens"].shape == (S.prompts * S.group, S.length)


def test_old_logprobs_are_the_policys_logprobs():
    """pi_old is the log-prob the update recomputes (ratio 1 at the first pass), and equals log softmax of
    W x + b built here by hand, in float64."""
    net = ToyPolicy(S, 0)
    batch = toy_rollout(net, torch.Generator().manual_seed(0))
    assert not batch["old_logprobs"].requires_grad
    assert torch.equal(toy_logprobs(net, batch), batch["old_logprobs"])
    bias = (torch.nn.functional.one_hot(batch["bias_at"], S.vocab).double() * batch["bias"][..., None].double()).sum(-2)
    logits = batch["x"].double() @ net.weight.detach().double().T + bias  # (B, T, V)
    reference = logits.log_softmax(-1).gather(-1, batch["tokens"][..., None]).squeeze(-1)
    assert torch.allclose(batch["old_logprobs"].double(), reference, atol=1e-5)


def test_samples_follow_the_policy():
    """The Gumbel-max draw samples softmax(W x + b): at the first position (one context per prompt) the tokens'
    frequencies over 4,000 samples match exp(pi_old) within 5 standard errors. (Biases of 1, not 4-11, so that
    every token is drawn often.)"""
    s = ToySettings(vocab=8, dim=4, prompts=1, group=4000, length=1, decisions=1)
    net = ToyPolicy(s, 0)
    net.strength = torch.ones(s.vocab)
    batch = toy_rollout(net, torch.Generator().manual_seed(0))
    probs = net(batch["x"][:1], batch["bias_at"][:1], batch["bias"][:1]).softmax(-1)[0, 0].detach()  # (V,)
    freq = torch.bincount(batch["tokens"][:, 0], minlength=s.vocab).float() / s.group
    assert ((freq - probs).abs() <= 5 * (probs * (1 - probs) / s.group).sqrt() + 1e-3).all(), (freq, probs)


def test_target_is_second_to_the_bigram_token_at_decisions_and_unbiased_at_format_positions():
    """The designed biases: at a decision position the target gets the bigram token's bias minus target_gap (so,
    with weight = 0, it is the second most likely token); at a format position it gets none."""
    net = ToyPolicy(S, 0)
    with torch.no_grad():
        net.weight.zero_()  # the logits are then the biases alone
    batch = toy_rollout(net, torch.Generator().manual_seed(0))
    d, prompts = S.decisions, torch.arange(S.prompts).repeat_interleave(S.group)
    target, bigram = net.target[prompts], batch["bias_at"][:, :, 0]  # (B, d), (B, T)
    assert torch.equal(batch["bias_at"][:, :d, 1], target)
    assert torch.allclose(batch["bias"][:, :d, 0] - batch["bias"][:, :d, 1], torch.tensor(S.target_gap))
    assert (batch["bias"][:, d:, 1] == 0).all()  # format positions: the target has no bias
    logits = net(batch["x"], batch["bias_at"], batch["bias"]).detach()  # (B, T, V)
    top2 = logits[:, :d].topk(2, -1).indices  # (B, d, 2)
    apart = target != bigram[:, :d]  # (a target that is also the bigram token gets both biases)
    assert apart.float().mean() > 0.9
    assert torch.equal(top2[..., 0][apart], bigram[:, :d][apart]) and torch.equal(top2[..., 1][apart], target[apart])
    at_target = logits[:, d:].gather(-1, net.target[prompts, -1:].expand(-1, S.length - d)[..., None]).squeeze(-1)
    assert (at_target[bigram[:, d:] != net.target[prompts, -1:]] == 0).all()  # as every other unbiased token


# --- trajectories and paired probes (Figure 3 paired) ---
def test_paired_probes_leave_the_trajectory_unchanged():
    """paired_counts restores weights and optimiser state: GRPO's rewards and counts are those of a run without
    probes, and each step's entry under the own method is the own update's counts."""
    alone = toy_trajectory(SMALL, "grpo", 0)
    probed = toy_trajectory(SMALL, "grpo", 0, TOY_PAIRED)
    assert updates(probed) == updates(alone)
    assert alone["paired"] == [{"grpo": c} for c in alone["counts"]]
    for step, counts in zip(probed["paired"], probed["counts"]):
        assert set(step) == {"grpo", *TOY_PAIRED} and step["grpo"] == counts


def test_a_probe_of_the_own_method_reproduces_the_own_update():
    """A probe of Lopti from the state of Lopti's own trajectory counts what Lopti's own update counts: the
    restored state (two passes, AdamW moments) is the state the own update starts from."""
    own = toy_trajectory(SMALL, "lopti", 0)
    probed = toy_trajectory(SMALL, "lopti", 0, ("lopti",))  # the probe's counts replace the own entry
    assert [step["lopti"] for step in probed["paired"]] == own["counts"]
    assert updates(probed) == updates(own)


def test_grpo_ignores_alpha_and_ar_uses_it():
    """method_config: 'grpo' and 'lopti' run with alpha = 0 whatever the toy's alpha; 'ar' runs with it."""
    other = dataclasses.replace(SMALL, alpha=0.9)
    for method in ("grpo", "lopti"):
        assert updates(toy_trajectory(other, method, 0)) == updates(toy_trajectory(SMALL, method, 0))
    assert updates(toy_trajectory(other, "ar", 0)) != updates(toy_trajectory(SMALL, "ar", 0))


# --- run_toy ---
@pytest.fixture(scope="module")
def small_run():
    """run_toy(SMALL) on one thread, as toy_main runs it (the same float sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_toy(SMALL)
    finally:
        torch.set_num_threads(threads)


def test_run_toy_has_every_method(small_run):
    fig3 = small_run["figure3"]
    for key in ("rose", "rose_of_moved", "ties"):
        assert set(fig3[key]) == set(TOY_OWN_RUNS) and all(len(v) == 4 for v in fig3[key].values())
    assert set(fig3["paired"]) == set(TOY_PAIRED)
    for m, d in fig3["paired"].items():
        assert len(d["delta"]) == len(d["p"]) == len(d["resolved"]) == 4, m
    prop = small_run["prop_4_2"]  # Prop. 4.2 on the first batch's sampled tokens
    assert prop["tokens"] == SMALL.prompts * SMALL.group * SMALL.length and prop["within"] == prop["tokens"]
    assert math.sqrt(SMALL.vocab / (SMALL.vocab - 1)) <= prop["norm_over_rest"][0] <= prop["norm_over_rest"][1]
    assert prop["norm_over_rest"][1] <= math.sqrt(2)
    assert lopti.toy_checks(small_run)[0].startswith("[yes] Prop. 4.2")
    assert set(small_run["reward"]) == set(TOY_OWN_RUNS) == set(lopti.METHODS)
    assert all(len(seeds) == SMALL.seeds and all(len(steps) == SMALL.steps for steps in seeds)
               for seeds in small_run["reward"].values())  # each seed's reward per step
    pairs = {f"{m} - {ref}" for m, ref in lopti.TOY_REWARD_PAIRS}
    assert set(small_run["reward_paired"]) == pairs and {"lopti - grpo", "lopti - grpo_2_epochs",
                                                         "lopti_high_first - lopti"} <= pairs
    assert sum(small_run["figure1"]["token_share"]) == pytest.approx(1.0)
    assert small_run["settings"] == dataclasses.asdict(SMALL)


def test_run_toy_pools_the_trajectories(small_run):
    """Figure 3 of each method's own runs pools its seeds' steps; paired deltas pool GRPO's seeds: recomputed here
    from toy_trajectory by hand."""
    runs = {m: [toy_trajectory(SMALL, m, SMALL.seed + i, TOY_PAIRED if m == "grpo" else ())
                for i in range(SMALL.seeds)] for m in TOY_OWN_RUNS}
    total = lambda steps, key: [sum(c[f"update/{key}"][b] for c in steps) for b in range(4)]  # noqa: E731
    for m, trajs in runs.items():
        steps = [c for t in trajs for c in t["counts"]]
        rose, n = total(steps, "pos_rose"), total(steps, "pos_tokens")
        assert small_run["figure3"]["rose"][m] == pytest.approx([r / k if k else None for r, k in zip(rose, n)])
        assert small_run["reward"][m] == [t["reward"] for t in trajs]
        second_half = [sum(t["reward"][SMALL.steps // 2:]) / (SMALL.steps - SMALL.steps // 2) for t in trajs]
        assert small_run["reward_late"][m] == pytest.approx(sum(second_half) / SMALL.seeds)
    for m, ref in lopti.TOY_REWARD_PAIRS:  # paired by seed: the mean difference, and the exact test over seeds
        late = {x: [sum(t["reward"][SMALL.steps // 2:]) / (SMALL.steps - SMALL.steps // 2) for t in runs[x]]
                for x in (m, ref)}
        diffs = [a - b for a, b in zip(late[m], late[ref])]
        sums = [sum(s * d for s, d in zip(signs, diffs)) for signs in itertools.product((1, -1), repeat=len(diffs))]
        p = sum(abs(x) >= abs(sum(diffs)) - 1e-9 for x in sums) / len(sums)
        assert small_run["reward_paired"][f"{m} - {ref}"] == pytest.approx(
            {"delta": sum(diffs) / len(diffs), "p": p, "resolved": p < 0.05})
    probes = [p for t in runs["grpo"] for p in t["paired"]]
    n = total([p["grpo"] for p in probes], "pos_tokens")
    for m in TOY_PAIRED:
        diff = [a - b for a, b in zip(total([p[m] for p in probes], "pos_rose"),
                                      total([p["grpo"] for p in probes], "pos_rose"))]
        assert small_run["figure3"]["paired"][m]["delta"] == pytest.approx([x / k if k else None
                                                                             for x, k in zip(diff, n)])


# --- the command line ---
def test_cli_quick_writes_results(tmp_path, capsys, small_run):
    """`python lopti.py toy --quick --out DIR` writes results.json; the JSON holds the printed checks, the version
    (lopti_version) and exactly the results of a separate run_toy with the same settings (determinism). (--vocab 64
    keeps it under a second.)"""
    assert lopti.main(["toy", "--quick", "--vocab", "64", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["settings"] == dataclasses.asdict(SMALL) and saved["version"] == lopti.lopti_version()
    assert {k: v for k, v in saved.items() if k not in ("checks", "version")} == json.loads(json.dumps(small_run))
    printed = capsys.readouterr().out
    assert saved["checks"] and all(line in printed for line in saved["checks"])
    if importlib.util.find_spec("matplotlib"):  # the figures beside it, with matplotlib installed
        assert (tmp_path / "figures.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "pip install matplotlib" in printed


def test_the_toy_writes_runs_toy_unless_out_says_otherwise(monkeypatch, tmp_path):
    """Every run goes to runs/toy/, the default one too: only an explicit --out toy rewrites the committed
    toy/results.json."""
    monkeypatch.chdir(tmp_path)
    seen = []
    fake = {"figure3": {"rose": {"grpo": [0.5] * 4}, "paired": {}}, "settings": {"steps": 1}, "reward_paired": {},
            "prop_4_2": {"tokens": 1, "within": 1, "norm_over_rest": [1.0, 1.0]}}
    monkeypatch.setattr(lopti, "run_toy", lambda s, **k: seen.append(s) or json.loads(json.dumps(fake)))
    monkeypatch.setattr(lopti, "plot_toy", lambda result, out: out.write_bytes(b""))
    for argv, folder, settings in ((["--quick"], "runs/toy", ToySettings(**lopti.TOY_QUICK)),
                                   (["--seed", "3"], "runs/toy", ToySettings(seed=3)), ([], "runs/toy", ToySettings()),
                                   (["--out", "toy"], "toy", ToySettings()),
                                   (["--quick", "--out", "mine"], "mine", ToySettings(**lopti.TOY_QUICK)),
                                   (["--steps", str(ToySettings.steps)], "runs/toy", ToySettings())):
        for stale in ("toy", "runs", "mine"):
            shutil.rmtree(stale, ignore_errors=True)
        lopti.toy_main(lopti.build_parser().parse_args(["toy", *argv]))
        assert seen[-1] == settings, argv
        assert (Path(folder) / "results.json").exists(), argv
        assert [p.name for p in tmp_path.iterdir()] == [Path(folder).parts[0]], argv


BAD = [["--steps", "x"], ["--bogus", "1"], ["--alpha", "1.5"], ["--eta", "0"], ["--optimizer", "adam"],
       ["--learning_rate", "-1"], ["--seeds", "0"], ["--steps", "0"], ["--decisions", "9"], ["--vocab", "0"],
       ["--vocab", "7"]]  # (fewer token ids than prompts, whose ids are tokens)


@pytest.mark.parametrize("bad", BAD, ids=lambda v: " ".join(v))
def test_bad_option_is_one_line_and_exit_2(bad, tmp_path, capsys):
    try:  # argparse (not a number, unknown flag) or Config's range checks, as train's: one line, exit 2
        code = lopti.main(["toy", "--quick", "--vocab", "64", *bad, "--out", str(tmp_path / "out")])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and bad[0].lstrip("-") in err, err
    assert not (tmp_path / "out").exists()  # nothing written


def test_an_odd_batch_runs_with_one_optimiser_step_a_pass():
    """prompts x group odd (3 x 3) or not a power of two: the toy still runs, Figure 1 included."""
    r = lopti.run_toy(ToySettings(seeds=1, steps=1, vocab=16, prompts=3, group=3))
    assert len(r["figure1"]["token_share"]) == 4 and r["reward"]["grpo"]


def test_sign_flip_p_by_hand():
    """Differences 1, 2, 3: of the 8 sign patterns, +1+2+3 and -1-2-3 are as far from 0 as the observed sum: p 2/8;
    the second column, 1, -1, 0: every pattern's |sum| >= 0, p 1."""
    p = lopti.sign_flip_p(torch.tensor([[1.0, 1.0], [2.0, -1.0], [3.0, 0.0]], dtype=torch.float64))
    assert p.tolist() == [0.25, 1.0]


def test_toy_prints_a_reward_verdict_per_pair():
    result = {"settings": {"steps": 10}, "reward_paired": {
        "lopti - grpo": {"delta": 0.027, "p": 0.008, "resolved": True},
        "lopti - grpo_2_epochs": {"delta": -0.027, "p": 0.008, "resolved": True},
        "ar - grpo": {"delta": 0.0, "p": 1.0, "resolved": False},
        "grpo_2_epochs - grpo": {"delta": 0.126, "p": 2 / 4096, "resolved": True}},
        "prop_4_2": {"tokens": 1, "within": 1, "norm_over_rest": [1.0, 1.0]},
        "figure3": {"rose": {"grpo": [0.9, 0.9, 0.9, 0.8]}, "paired": {}}}
    lines = [line for line in lopti.toy_checks(result) if line.startswith("[reward]")]
    assert lines == ["[reward] lopti - grpo, steps 6-10, paired by seed: +0.027, p 0.008: higher",
                     "[reward] lopti - grpo_2_epochs, steps 6-10, paired by seed: -0.027, p 0.008: lower",
                     "[reward] ar - grpo, steps 6-10, paired by seed: +0.000, p 1.000: not resolved",
                     "[reward] grpo_2_epochs - grpo, steps 6-10, paired by seed: +0.126, p < 0.001: higher"]


def test_a_setting_that_leaves_a_bin_empty_prints_and_draws_without_a_traceback(tmp_path, capsys):
    """A target 30 below the bigram token: no sample ever hits it, no group has spread, no token has an advantage;
    the checks say so and figures.png is still drawn."""
    assert lopti.main(["toy", "--quick", "--vocab", "64", "--target_gap", "30", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[NO ] GRPO's lowest or top bin has no A > 0 token" in out
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "figures.png").exists()


def test_two_worker_processes_give_the_results_of_one(small_run):
    """`lopti.py toy` shares the trajectories out to 2 processes: the results are those of one, to every digit."""
    assert json.dumps(run_toy(SMALL, workers=2)) == json.dumps(small_run)
