"""The README's Python blocks run as written, from the repository root (offline)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), {"__name__": "readme"})
