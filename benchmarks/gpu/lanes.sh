#!/usr/bin/env bash
# The device tool's calls are short and few: this runs the GPU checks that do not time anything
# side by side on one GPU, each in its own processes (torch's max_memory_* counters are per
# process, so the memory figures do not mix), and packs what comes back into few files (the tool
# returns at most 8). Timings (gpu/amp.py, gpu/alloc.py) run alone: use run_all.sh for them.
#
#     bash benchmarks/gpu/lanes.sh          # build, then in parallel:
#       A  gpu/predict_vs_gpu.py, every eager case
#       B  gpu/fit_boundary.py, every model
#       C  the `cuda`-marked tests (but test_cuda_expandable_differential, which compares the
#          device's free memory with its own reserved bytes: it runs alone, after the lanes)
#       D  gpu/attention_probe.py, then predict_vs_gpu's compiled cases (COMPILED_CASES, separated by semicolons)
#
# Each lane has its own time limit (LANE_TIMEOUT, default 330 s); the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-results}"
work="$(mktemp -d)"
mkdir -p "$out"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t0=$(date +%s)
lane_timeout="${LANE_TIMEOUT:-330}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$work/device.txt"
if ! VRAMKIT_CUDA=1 VRAMKIT_CUDA_ARCHS="${VRAMKIT_CUDA_ARCHS:-90}" python setup.py build_ext --inplace \
        > "$work/build.log" 2>&1; then
    tail -30 "$work/build.log"
    cp "$work/build.log" "$out/"
    exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"

mkdir -p "$work/A" "$work/B" "$work/C" "$work/D"
( timeout "$lane_timeout" python benchmarks/gpu/predict_vs_gpu.py --out "$work/A" > "$work/A/table.md" 2> "$work/A/log.txt";
  echo "rc=$?" >> "$work/A/table.md" ) &
sleep 15  # predict_vs_gpu reads what the CUDA context holds outside the allocator (free memory) first
( timeout "$lane_timeout" python benchmarks/gpu/fit_boundary.py --out "$work/B" > "$work/B/table.md" 2> "$work/B/log.txt";
  echo "rc=$?" >> "$work/B/table.md" ) &
alone=tests/unit/test_cuda.py::test_cuda_expandable_differential
( timeout "$lane_timeout" python -m pytest -m cuda -p no:cacheprovider -rs -q tests --deselect "$alone" \
      > "$work/C/tests.log" 2>&1;
  echo "rc=$?" >> "$work/C/tests.log" ) &
( timeout 90 python benchmarks/gpu/attention_probe.py --out "$work/D" > "$work/D/probe.txt" 2>&1
  echo "rc=$?" >> "$work/D/probe.txt"
  left=$(( lane_timeout - ($(date +%s) - t0) ))
  if [ -n "${COMPILED_CASES:-}" ] && [ "$left" -gt 30 ]; then
      timeout "$left" python benchmarks/gpu/predict_vs_gpu.py --cases "$COMPILED_CASES" --out "$work/D" \
          > "$work/D/table.md" 2> "$work/D/log.txt"
      echo "rc=$?" >> "$work/D/table.md"
  fi ) &
wait
timeout 120 python -m pytest -p no:cacheprovider -q "$alone" > "$work/C/alone.log" 2>&1
echo "rc=$?" >> "$work/C/alone.log"

# Everything but the snapshots in one archive; the snapshots, compressed, in up to 5 more.
summary="$out/summary.txt"
{ cat "$work/device.txt"; echo "=== A predict_vs_gpu ==="; cat "$work/A/table.md"
  echo "=== B fit_boundary ==="; cat "$work/B/table.md"
  echo "=== C cuda tests ==="; tail -15 "$work/C/tests.log"; tail -3 "$work/C/alone.log"
  echo "=== D attention probe, compiled cases ==="; cat "$work/D/probe.txt" "$work/D/table.md" 2>/dev/null
  echo "took $(( $(date +%s) - t0 )) s"; } > "$summary"
tar -czf "$out/results.tgz" -C "$work" --exclude='*.pickle' . 2>/dev/null
( cd "$work" && find . -name '*.pickle' -print0 | xargs -0 -r tar -czf "$work/snapshots.tgz" )
[ -f "$work/snapshots.tgz" ] && split -b 15M -d -a 1 "$work/snapshots.tgz" "$out/snapshots.tgz.part"
ls "$out"/snapshots.tgz.part* 2>/dev/null | tail -n +6 | xargs -r rm -f  # the tool returns 8 files at most
cat "$summary"
