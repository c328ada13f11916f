"""The examples' scripts as a user reads them. They run through the sandbox in test_sandbox.py's run
(tests/lab/examples.py)."""

from __future__ import annotations

import difflib

from tests.lab.examples import EXAMPLES


def test_the_ddp_example_is_the_plain_script_and_ten_lines() -> None:
    """The guide's diff (docs/own-script.md) is this one: the elastic script is the plain one with about ten
    lines added."""

    def code(name: str) -> list[str]:  # from the first import on: the docstrings differ by design
        lines = (EXAMPLES["ddp"] / name).read_text().splitlines()
        return lines[next(i for i, line in enumerate(lines) if line.startswith("import")) :]

    diff = list(difflib.unified_diff(code("plain.py"), code("train.py")))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len([line for line in added if line.strip("+ ")]) <= 11, "\n".join(added)
    assert any("elastic.Manager(" in line for line in added)
