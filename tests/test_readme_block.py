"""The README's "Use one function in your own trainer" block, the one people copy: both of Lopti's stages have
tokens and move the weights, each step's gradient is clipped, and a stage without tokens takes no optimiser step."""
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def copied_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use one function in your own trainer")[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


class SpyAdamW(torch.optim.AdamW):
    """AdamW that records, at each step, the gradient norm it was given and how far the weights moved."""
    steps: list = []

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
        out = super().step(closure)
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))
        SpyAdamW.steps.append({"grad_norm": float(grad_norm), "moved": moved})
        return out


def run_block(block: str) -> dict:
    SpyAdamW.steps = []
    namespace = {"__name__": "readme"}
    real = torch.optim.AdamW
    torch.optim.AdamW = SpyAdamW
    try:
        exec(compile(block, "README copied block", "exec"), namespace)
    finally:
        torch.optim.AdamW = real
    return namespace


def test_both_stages_have_tokens_and_move_the_weights_with_a_clipped_gradient():
    namespace = run_block(copied_block())
    assert namespace["low"].any() and namespace["high"].any(), "pi_old must reach both stages"
    assert len(SpyAdamW.steps) == 2
    for step in SpyAdamW.steps:
        assert step["moved"] > 0
        assert step["grad_norm"] <= 1.0 + 1e-6  # clipped to max_norm=1.0 before the step


def test_an_empty_stage_takes_no_step():
    """eta = 1.0 puts every token in the low stage: the high stage is empty, so one step in all."""
    block = copied_block()
    assert "eta=0.5" in block
    namespace = run_block(block.replace("eta=0.5", "eta=1.0"))
    assert namespace["low"].all() and not namespace["high"].any()
    assert len(SpyAdamW.steps) == 1
