#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: build vramkit in place with its CUDA backend and
# kernels, run every test marked `cuda` (allocator, expandable segments on the driver's VMM
# API, amp kernels, torch's pluggable allocator with a real training loop, `vramkit run` on a torch
# CUDA script, CuPy), then the GPU benchmarks: amp kernels (gpu/amp.py) and allocation latency
# against torch, CuPy and cudaMallocAsync (gpu/alloc.py), vramkit's meta predictions against the GPU's own
# max_memory_allocated/reserved (gpu/predict_vs_gpu.py), single-rank DDP/FSDP2 runs on NCCL with
# their allocator histories (gpu/sharded_gpu.py), and fit's largest batch against the real one
# (gpu/fit_boundary.py), and issue 35's costs in one table (loop_costs.py). Logs, tables and snapshots go to
# ${OUT:-gpu-results}; the last lines printed are the summary. Fits one 10-minute call of the device tool (the build takes about 2 minutes).
#
#     bash benchmarks/gpu/run_all.sh            # full
#     QUICK=1 bash benchmarks/gpu/run_all.sh    # benchmarks with --quick
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

echo "=== device ===" | tee "$out/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/summary.txt"

echo "=== build (VRAMKIT_CUDA=1) ===" | tee -a "$out/summary.txt"
if ! VRAMKIT_CUDA=1 VRAMKIT_CUDA_ARCHS="${VRAMKIT_CUDA_ARCHS:-90}" python setup.py build_ext --inplace \
        > "$out/build.log" 2>&1; then
    tail -30 "$out/build.log"
    echo "build failed (see $out/build.log)" | tee -a "$out/summary.txt"
    exit 1
fi
python -c "import vramkit; print('vramkit', vramkit.__version__, 'CUDA devices:', vramkit._C.cuda_device_count() \
    if hasattr(vramkit._C, 'cuda_device_count') else '?')" | tee -a "$out/summary.txt"

echo "=== cuda tests ===" | tee -a "$out/summary.txt"
timeout "${TESTS_TIMEOUT:-200}" python -m pytest -m cuda -p no:cacheprovider -rs -q tests > "$out/cuda_tests.log" 2>&1
tests_rc=$?
tail -25 "$out/cuda_tests.log"
tail -1 "$out/cuda_tests.log" >> "$out/summary.txt"

echo "=== predictions against the GPU ===" | tee -a "$out/summary.txt"
timeout "${PREDICT_TIMEOUT:-200}" python benchmarks/gpu/predict_vs_gpu.py --out "$out" > "$out/predict_vs_gpu.md" 2> "$out/predict_vs_gpu.log"
predict_rc=$?
cat "$out/predict_vs_gpu.md" >> "$out/summary.txt"
timeout "${SHARDED_TIMEOUT:-120}" python benchmarks/gpu/sharded_gpu.py --out "$out" > "$out/sharded_gpu.md" 2> "$out/sharded_gpu.log"
sharded_rc=$?
cat "$out/sharded_gpu.md" >> "$out/summary.txt"
# fit's largest batch against find_batch_size's on this GPU (issue 34): two models when QUICK
fit_quick=()
[ "${QUICK:-0}" = "1" ] && fit_quick=(--quick)
timeout "${FIT_TIMEOUT:-150}" python benchmarks/gpu/fit_boundary.py "${fit_quick[@]}" --out "$out" > "$out/fit_boundary.md" 2> "$out/fit_boundary.log"
fit_rc=$?
cat "$out/fit_boundary.md" >> "$out/summary.txt"

echo "=== GPU benchmarks ===" | tee -a "$out/summary.txt"
quick=()
[ "${QUICK:-0}" = "1" ] && quick=(--quick)
timeout 90 python benchmarks/gpu/amp.py "${quick[@]}" --json "$out/amp.json" > "$out/amp.md" 2>&1
bench_rc=$?
cat "$out/amp.md" >> "$out/summary.txt"
timeout 90 python benchmarks/gpu/alloc.py "${quick[@]}" --json "$out/alloc.json" > "$out/alloc.md" 2>&1
alloc_rc=$?
cat "$out/alloc.md" >> "$out/summary.txt"
# issue 35's figures side by side: host path (CPU and CUDA tensors), kernels, torch through vramkit
timeout 150 python benchmarks/loop_costs.py "${quick[@]}" --gpu-results "$out" > "$out/loop_costs.md" 2>&1
loop_rc=$?
cat "$out/loop_costs.md" >> "$out/summary.txt"

echo "=== summary ==="
cat "$out/summary.txt"
exit $(( tests_rc != 0 || bench_rc != 0 || alloc_rc != 0 || loop_rc != 0 || predict_rc != 0 || sharded_rc != 0 || fit_rc != 0 ))
