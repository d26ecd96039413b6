#!/usr/bin/env bash
# Every GPU measurement of this project in one run, for a machine with one H200 (or another GPU:
# set PEAK_TFLOPS to its dense peak at bf16): installs the project, then
#   1. benchmarks/gpu_check.py: OLMo-1B shape, FSDP2, bf16, activation checkpointing, a batch
#      change: tokens/s, MFU, peak memory beside what `plan=true` estimates for the same run;
#   2. the same compiled (each transformer block, torch.compile): compiled against eager MFU;
#   3. the same with a CBS probe (k = 1, 2): the probe's cost, and k = 1 against the main run;
#   4. benchmarks/table1.py --gpu: Table 1 on a 25M-parameter model in bf16, one seed;
#   5. benchmarks/time_to_loss.py --gpu: the same runs' wall time to a held-out loss, and compiled
#      against eager tokens/s per batch phase.
# Results go to $OUT (default gpu_results/): the JSON files, table1.md, table1.png,
# time_to_loss.md, time_to_loss.png, nvidia-smi.txt.
# Put the figures in docs/RESULTS.md. Each step has its own time limit, so one that hangs does not
# take the others with it.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_run.sh
#   OUT=/tmp/gpu PEAK_TFLOPS=312 bash benchmarks/gpu_run.sh   # an A100
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
PEAK_TFLOPS="${PEAK_TFLOPS:-989}"  # dense bf16 of an H100/H200 SXM; Lightning's table has no entry torch's H200 name matches
mkdir -p "$OUT"
status=0
step() {  # step SECONDS NAME COMMAND...: run one measurement, keep going if it fails
    local seconds=$1 name=$2
    shift 2
    echo "== $name"
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1 || { echo "   failed (exit $?), see $OUT/$name.log"; status=1; }
    tail -n 3 "$OUT/$name.log"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || { echo "no nvidia-smi: is this the GPU machine?"; exit 1; }
pip install --quiet -e . || exit 1
step 240 gpu_check python -m benchmarks.gpu_check --peak-tflops "$PEAK_TFLOPS" --output "$OUT/gpu_check.json"
step 300 gpu_check_compiled python -m benchmarks.gpu_check --peak-tflops "$PEAK_TFLOPS" --compile --output "$OUT/gpu_check_compiled.json"
step 300 gpu_check_probe python -m benchmarks.gpu_check --peak-tflops "$PEAK_TFLOPS" --probe --steps-after-change 16 \
    --output "$OUT/gpu_check_probe.json"
step 900 table1_gpu python -m benchmarks.table1 --gpu --out "$OUT/table1" --markdown "$OUT/table1.md" --plot "$OUT/table1.png"
step 1200 time_to_loss_gpu python -m benchmarks.time_to_loss --gpu --out "$OUT/time_to_loss" --markdown "$OUT/time_to_loss.md" \
    --plot "$OUT/time_to_loss.png"
exit $status
