"""The example of docs/guides/probe_jobs.md runs as written: a LightningModule of one's own trained with
checkpoints, then the CBS measured at one of them (lit_cbs.probe.probe_checkpoint)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import subprocess_env

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "probe_jobs.md"


@pytest.mark.slow
def test_the_guides_own_module_example_runs_and_writes_a_reading(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    (example,) = [block for block in blocks if "probe_checkpoint(" in block and "__main__" in block]
    (tmp_path / "example.py").write_text(example)
    result = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^step 20: CBS in \[\d+, (\d+|beyond the grid)\]", result.stdout, flags=re.M), result.stdout
    (reading,) = [json.loads(line) for line in (tmp_path / "probes" / "cbs_probe.jsonl").read_text().splitlines()]
    assert (reading["mode"], reading["step"], reading["batch_size"], reading["seq_len"]) == ("checkpoint", 20, 16, 64)
    assert set(reading["losses"]) >= {"1", "2"} and len(reading["batch_losses"]["1"]) == 4
