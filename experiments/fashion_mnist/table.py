"""The results table of `experiments/fashion_mnist/run.sh OUT_DIR`, as markdown rows.

Accuracy after the last step on the validation split and the test images, seconds per
epoch of training (Keras' own epoch time for the reference; for ours, 429 steps at the
logged steps/s, which counts training only): the first (it includes tracing) and the median of
the others (a median, so that an epoch slowed by other work on the machine does not carry the
figure), and each run's wall time from run.sh.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

STEPS_PER_EPOCH = 55000 // 128
RUNS = {
    "reference": "tutorial's Keras fit (`tutorial_fit.py`)",
    "single": "ours, one device (`train.strategy='default'`)",
    "mirrored": "ours, MirroredStrategy, 2 logical CPUs",
    "mwms": "ours, MultiWorkerMirrored, 2 workers (`trainer.launch`)",
}


def reference(out: str) -> tuple[float, float, list[float]]:
    with open(os.path.join(out, "reference.json")) as f:
        result = json.load(f)
    return result["validation"]["accuracy"], result["test"]["accuracy"], result["epoch_seconds"]


def ours(model_dir: str) -> tuple[float, float, list[float]]:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    last = max(r["step"] for r in records)
    final = {r["split"]: r for r in records if r["step"] == last}
    epochs = [STEPS_PER_EPOCH / r["steps_per_sec"] for r in records if r["split"] == "train"]
    return final["validation"]["accuracy"], final["eval"]["accuracy"], epochs


def main(out: str) -> None:
    with open(os.path.join(out, "times.txt")) as f:
        wall = {line.split()[0]: line.split()[3] for line in f if line.strip()}
    print("| run | validation accuracy | test accuracy | s per epoch (first, median of the others) | wall time |")
    print("|---|---:|---:|---:|---:|")
    for name, what in RUNS.items():
        try:
            validation, test, epochs = reference(out) if name == "reference" else ours(os.path.join(out, name))
        except (OSError, KeyError, ValueError) as e:
            print(f"| {what} | did not finish ({type(e).__name__}: {e}) | | | |")
            continue
        rest = epochs[1:] or epochs
        print(
            f"| {what} | {validation:.4f} | {test:.4f} | {epochs[0]:.0f}, {statistics.median(rest):.0f} | "
            f"{wall.get(name, '?')} s |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
