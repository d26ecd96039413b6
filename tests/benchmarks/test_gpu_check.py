"""benchmarks/gpu_check.py, the one-GPU check, on the CPU: it trains through a batch change and
reports tokens/s and MFU, importing nothing the GPU machine lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_module(code_or_module: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_env(PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, *code_or_module], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_gpu_check_runs_on_cpu_compiled_and_imports_nothing_the_gpu_machine_lacks(tmp_path):
    # Compiled (as gpu_run.sh's second step), so the CPU runs every line the GPU's two runs do; then what the
    # whole run imported is listed, in the same process.
    output = tmp_path / "gpu_check.json"
    arguments = [
        "--output", str(output), "--peak-tflops", "989", "--accelerator", "cpu", "--precision", "32-true",
        "--preset", "tiny", "--seq-len", "128", "--micro-batch-size", "4", "--steps-before-change", "4",
        "--steps-after-change", "2", "--skip-steps", "1", "--compile",
    ]  # fmt: skip
    code = (
        f"import runpy, sys; sys.argv = ['gpu_check', *{arguments!r}];"
        "runpy.run_module('benchmarks.gpu_check', run_name='__main__');"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'litdata'}));"
        "print(sorted(m for m in sys.modules if m.startswith('lit_cbs')))"
    )
    done = run_module(["-c", code], cwd=tmp_path)
    forbidden, lit_cbs_modules = done.stdout.strip().splitlines()[-2:]
    assert forbidden == "[]"
    # RandomTokenData and the loader need torch and Lightning only; the datamodule (litdata) and the run report
    # are not loaded.
    loaded = lit_cbs_modules[1:-1].split(", ")
    assert "'lit_cbs.data.synthetic'" in loaded
    assert not any(name.startswith(("'lit_cbs.data.datamodule", "'lit_cbs.run.report")) for name in loaded)
    result = json.loads(output.read_text())
    # The micro-batch stays 4 through the batch change, so the blocks compile once or twice (dynamic shapes), no more.
    assert result["compile"] is True and 1 <= result["compiled_graphs"] <= 2 and result["fused_adamw"] is False
    assert [(c["step"], c["new_global_batch"]) for c in result["batch_changes"]] == [(4, 8)]
    assert result["optimizer_steps"] == 6 and result["tokens_trained"] == 4 * 512 + 2 * 1024
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1 and result["peak_flops_per_device"] == 989e12
    # The MFU CausalLM logs for the last step and the benchmark's over the timed steps use the same FLOPs and peak.
    assert result["last_logged_mfu"] == pytest.approx(
        result["flops_per_token"] * result["last_logged_tokens_per_s"] / 989e12
    )
