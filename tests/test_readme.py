"""README.md's Python snippets run as pasted, one after the other, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_the_readme_snippets_run_as_pasted(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README.md has no python snippet"
    monkeypatch.chdir(tmp_path)  # Lightning's default folders (lightning_logs) land here
    namespace: dict = {"__name__": "__readme__"}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    # The snippets print what the README says they print: the batch changes and the probe's readings.
    assert "BatchChange(" in printed and "ProbeReading(" in printed
    assert namespace["warmup"].history and namespace["probe"].history
