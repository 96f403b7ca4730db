#!/usr/bin/env bash
# Regenerates experiments/bench/results/*.json and experiments/bench/README.md: the tutorial
# CNN and an MLP under single (default strategy) and mirrored (2 logical CPUs when there is
# no GPU), each measured by `python -m experiments.bench` (ours against the bare step, Orbit and
# Keras fit, with a 95% interval and a verdict per peer); on a machine with a GPU also gpu.gin
# (one GPU, batch 1024, mixed_bfloat16, XLA) for both models. Orbit is not a dependency:
# `python -m experiments.bench --install_orbit` first, or its rows say that it is not installed.
#
#   experiments/bench/run.sh                        # everything (about 11 min per config on 2 cores)
#   RUNS=2 experiments/bench/run.sh                 # each config twice, back to back: do the verdicts hold?
#   CONFIGS="cnn28_mirrored" experiments/bench/run.sh  # the CNN at 28x28 (not in the default set)
#   CONFIGS="mlp_single" experiments/bench/run.sh   # rerun one config, rebuild the README from all results
#   CONFIGS=none experiments/bench/run.sh           # only rebuild the README from results/*.json
#   REPEATS=6 PYTHON=/path/to/python BENCH_ARGS="--steps=200" experiments/bench/run.sh
#
# Run k > 1 of a config goes to results/<config>.run<k>.json (those of an earlier, longer series are
# removed first). Timings mean something only on an otherwise idle machine: every table records the
# load average before and after its run, and how many cores other processes used during its chunks.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=experiments/bench
PYTHON=${PYTHON:-python}
REPEATS=${REPEATS:-12}
RUNS=${RUNS:-1}
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
HAVE_GPU=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; fi
DEFAULT_CONFIGS="cnn_single cnn_mirrored mlp_single mlp_mirrored"
if [ "$HAVE_GPU" = 1 ]; then DEFAULT_CONFIGS="$DEFAULT_CONFIGS cnn_gpu mlp_gpu"; fi
mkdir -p "$HERE/results"
if ! "$PYTHON" -c "import orbit" >/dev/null 2>&1; then
    echo "note: orbit is not importable: its rows will say so (install: $PYTHON -m experiments.bench --install_orbit)" >&2
fi

CONFIGS=${CONFIGS:-$DEFAULT_CONFIGS}
if [ "$CONFIGS" = none ]; then CONFIGS=""; fi
for name in $CONFIGS; do
    model=${name%_*}
    mode=${name#*_}
    if [ "$mode" = gpu ]; then
        gins=(gin/single.gin "$HERE/$model.gin" "$HERE/gpu.gin")
    else
        gins=("gin/$mode.gin" "$HERE/$model.gin")
    fi
    args=()
    for gin in "${gins[@]}"; do args+=("--gin_file=$gin"); done
    rm -f "$HERE/results/$name".run*.json
    for run in $(seq 1 "$RUNS"); do
        out="$HERE/results/$name.json"
        if [ "$run" -gt 1 ]; then out="$HERE/results/$name.run$run.json"; fi
        echo "== $name, run $run of $RUNS (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
        "$PYTHON" -m experiments.bench "${args[@]}" --repeats="$REPEATS" ${EXTRA[@]+"${EXTRA[@]}"} --json="$out"
    done
done

machine() {
    if command -v lscpu >/dev/null; then
        lscpu | grep -E '^(Architecture|CPU\(s\)|Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|L2 cache|L3 cache|Hypervisor vendor)' || true
        lscpu | grep -o -E '\b(avx512_bf16|amx_bf16|avx512f|avx2)\b' | sort -u | tr '\n' ' ' | sed 's/^/CPU features used by oneDNN: /'
        echo
    fi
    echo "cores (nproc): $(nproc)"
    if command -v free >/dev/null; then free -g | awk '/^Mem:/ {print "memory: " $2 " GiB"}'; fi
    if [ "$HAVE_GPU" = 1 ]; then nvidia-smi -L; else echo "GPU: none"; fi
}

MACHINE=$(machine) "$PYTHON" -m experiments.bench.readme "$HERE" > "$HERE/README.md.new"
mv "$HERE/README.md.new" "$HERE/README.md"  # a failed build leaves the old README
echo "wrote $HERE/README.md" >&2
