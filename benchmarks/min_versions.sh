#!/usr/bin/env bash
# Install the lowest versions pyproject.toml allows in a throwaway virtual environment and run the
# test suite against them: the lower bounds are what this script last passed with (see
# docs/RESULTS.md, "Minimum versions"). Any bound can be overridden from the environment:
#
#   benchmarks/min_versions.sh                          # the bounds below, in /tmp/venv-min
#   LIGHTNING=2.5.0 benchmarks/min_versions.sh /tmp/v   # another Lightning, another folder
#   TORCH=system benchmarks/min_versions.sh             # reuse the torch already installed
#   benchmarks/min_versions.sh /tmp/venv-min tests/callbacks/test_warmup.py   # only some tests
#
# TORCH=system makes a venv that sees this Python's site-packages (torch from there, everything
# else pinned in the venv); otherwise torch comes from the package index too (a CUDA build from
# PyPI is about 3 GB with its libraries).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-/tmp/venv-min}"
shift || true
TESTS=("$@")
[ ${#TESTS[@]} -eq 0 ] && TESTS=(tests)

TORCH="${TORCH:-2.7.1}"
LIGHTNING="${LIGHTNING:-2.5.0}"
TORCHMETRICS="${TORCHMETRICS:-1.4.0}"
HYDRA="${HYDRA:-1.3.0}"
OMEGACONF="${OMEGACONF:-2.3.0}"
LITDATA="${LITDATA:-0.2.74}"
PYTHON="${PYTHON:-python3}"

packages=("lightning==$LIGHTNING" "torchmetrics==$TORCHMETRICS" "hydra-core==$HYDRA" "omegaconf==$OMEGACONF"
          "litdata==$LITDATA" scipy matplotlib pytest hypothesis tokenizers)
if [ "$TORCH" = system ]; then
    "$PYTHON" -m venv --clear --system-site-packages "$VENV"
else
    "$PYTHON" -m venv --clear "$VENV"
    packages=("torch==$TORCH" "${packages[@]}")
fi
# The system-wide pip constraints may cap torch; the pins above are what this run is about.
PIP_CONSTRAINT="" "$VENV/bin/pip" install --quiet --disable-pip-version-check "${packages[@]}"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("installed:", ", ".join(f"{n} {md.version(n)}" for n in
      ("torch", "lightning", "torchmetrics", "hydra-core", "omegaconf", "litdata", "numpy")))
PY
cd "$ROOT"
PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
