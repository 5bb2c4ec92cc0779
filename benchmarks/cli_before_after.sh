#!/usr/bin/env bash
# The same `vramkit fit` and `vramkit replay` commands run with two source trees (each with its
# extension built in place), their stdout compared and their wall time and peak RSS printed:
# a restructuring must give the same answers at the same speed.
#
#   bash benchmarks/cli_before_after.sh OLD_TREE NEW_TREE [OUT_DIR]
#
# OLD_TREE, NEW_TREE: checkouts (e.g. a `git worktree` of the commit before); OUT_DIR defaults
# to a new temporary directory. Prints, per command, "old time, RSS -> new time, RSS" and the
# lines of stdout that differ (the timeline's path always does).
set -u
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); out=${3:-$(mktemp -d)}
run() {  # tree tag name args...
    local tree=$1 tag=$2 name=$3; shift 3
    local dir=$out/$tag; mkdir -p "$dir"
    (cd "$dir" && /usr/bin/time -f "%e s, %M KB" -o "$dir/$name.time" env PYTHONPATH="$tree/python" \
        python -m vramkit "$@" --html "$dir/$name.html" > "$dir/$name.out" 2> "$dir/$name.err"
     echo "exit status $?" >> "$dir/$name.out")
}
for pair in "old:$old" "new:$new"; do
    tag=${pair%%:*}; tree=${pair#*:}
    run "$tree" "$tag" gpt_h100 fit "$tree/examples/gpt_fit.py" --gpu H100-80GB --trace gpt.vktrace
    run "$tree" "$tag" gpt_24 fit "$tree/examples/gpt_fit.py" --device-memory 24GiB --batch-size 32
    run "$tree" "$tag" fsdp8 fit "$tree/examples/llama_fsdp.py" --world-size 8 --gpu H100-80GB --batch-size 1 --no-search
    run "$tree" "$tag" ddp8 fit "$tree/examples/llama_ddp.py" --world-size 8 --gpu L4 --batch-size 1
    run "$tree" "$tag" replay replay "$out/$tag/gpt.vktrace" --gpu A100-40GB
done
for f in "$out"/old/*.out; do
    name=$(basename "$f" .out)
    echo "== $name: $(tail -1 "$out/old/$name.time") -> $(tail -1 "$out/new/$name.time")"
    diff "$f" "$out/new/$name.out" | grep '^[<>]' | grep -v 'Timeline' || true
done
