"""lopti.py stays a single file one can read: at most 1,400 lines and 75,000 characters (the "minimal" issue)."""
from pathlib import Path

LOPTI = Path(__file__).resolve().parent.parent / "lopti.py"
MAX_LINES, MAX_CHARS = 1_400, 75_000


def test_lopti_py_stays_within_its_size_budget():
    """Both numbers are reported, so a failure says how far over each limit the file is."""
    text = LOPTI.read_text(encoding="utf-8")
    lines, chars = len(text.splitlines()), len(text)
    assert lines <= MAX_LINES and chars <= MAX_CHARS, (
        f"lopti.py has {lines:,} lines (limit {MAX_LINES:,}) and {chars:,} characters (limit {MAX_CHARS:,})")
