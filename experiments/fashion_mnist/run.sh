#!/usr/bin/env bash
# The comparison in experiments/fashion_mnist/README.md: the tutorial's Keras fit (tutorial_fit.py),
# then fashion_mnist.gin on one device, on MirroredStrategy (2 logical CPUs) and on 2
# MultiWorkerMirrored worker processes (trainer.launch), one after another, 10 epochs each, all
# on the same Fashion-MNIST files (DATA_DIR if set, else Keras' cache, else Debian's package).
#
#   experiments/fashion_mnist/run.sh OUT_DIR      # with the project's Python on PATH
#   PYTHON=/path/to/python DATA_DIR=/path/to/files experiments/fashion_mnist/run.sh OUT_DIR
#
# Logs, model_dirs and reference.json go to OUT_DIR (which must not hold earlier runs: ours
# would resume); the table is printed at the end (table.py). About 50 minutes on 2 otherwise idle CPU cores.
set -uo pipefail
out=$(realpath -m "${1:?usage: run.sh OUT_DIR}")
cd "$(dirname "$0")/../.."
python=${PYTHON:-python}
gin=experiments/fashion_mnist/fashion_mnist.gin
reference_data=() ours_data=()
if [ -n "${DATA_DIR:-}" ]; then
    reference_data=("--data_dir=$DATA_DIR") ours_data=("--gin_bindings=fashion_mnist.data_dir='$DATA_DIR'")
fi
mkdir -p "$out"
status=0

timed() {  # timed <name> <command...>: output to OUT_DIR/<name>.log, wall time to OUT_DIR/times.txt
    local name=$1 started=$SECONDS code
    shift
    echo "+ $*" > "$out/$name.log"
    "$@" >> "$out/$name.log" 2>&1
    code=$?
    [ "$code" -eq 0 ] || status=1
    echo "$name exit $code $((SECONDS - started)) s" | tee -a "$out/times.txt"
}

timed reference "$python" experiments/fashion_mnist/tutorial_fit.py --json="$out/reference.json" "${reference_data[@]}"
timed single "$python" -m trainer.main --gin_file=$gin --model_dir="$out/single" \
    "--gin_bindings=train.strategy='default'" "${ours_data[@]}"
timed mirrored "$python" -m trainer.main --gin_file=$gin --model_dir="$out/mirrored" "${ours_data[@]}"
timed mwms "$python" -m trainer.launch --num_workers=2 -- --gin_file=$gin --model_dir="$out/mwms" \
    "--gin_bindings=train.strategy='multi_worker_mirrored'" "${ours_data[@]}"
"$python" experiments/fashion_mnist/table.py "$out" || status=1
exit $status
