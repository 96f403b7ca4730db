"""`python -m experiments.bench --mode=input --input_latency_ms=MS`: a slow source read by one worker's own
pipeline against the same source made by a tf.data service of `--input_data_workers` data workers.

The source is what no pipeline option speeds up on one worker: examples that each take `MS` milliseconds to
read, one after the other (tf.data's sleep before each element, a remote read's latency without parallel
reads), then batched. "per-worker pipeline" is that pipeline in the reading process, as every worker of a
parameter-server run builds it without the service; "data service" is the same pipeline made by a local
dispatcher and its data workers (real servers, subprocesses, `distributed_epoch`) and read by this process.
Both are read in turns of `--input_seconds`, alternating which goes first, for `ROUNDS` rounds, after a
warm-up; the ratio is the geometric mean of the rounds' ratios (service over per-worker), so a drift of the
machine's speed cancels within a round. While one reader has its turn the other's buffers fill (tf.data
prefetches on its own, the service's data workers keep making batches), which short turns count as
speed: measure with turns of seconds.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

ROUNDS = 6
BATCH_SIZE = 16
NUM_EXAMPLES = 4096


def slow_batches(latency_ms: float):
    """Endless batches of examples that each wait `latency_ms` before they are read."""
    import tensorflow as tf

    from trainer import internals
    from trainer.data.pipeline import graph_code

    example = graph_code(lambda i: (tf.fill([8], tf.cast(i, tf.float32)), i))
    examples = tf.data.Dataset.range(NUM_EXAMPLES).map(example)
    return examples.apply(internals.sleep_each(int(latency_ms * 1000))).repeat().batch(BATCH_SIZE)


def run_service_bench(
    *,
    latency_ms: float,
    data_workers: int,
    seconds: float,
    rounds: int = ROUNDS,
    print_fn: Callable[[str], None] = print,
) -> dict:
    """Measures both readers in interleaved rounds; prints a table, returns the figures."""
    from trainer.data import service
    from trainer.distribution import local_cluster

    with local_cluster.embedded_cluster(None, data_workers=data_workers, print_fn=lambda _: None) as cluster:
        config = service.DataServiceConfig(address=cluster.service_address, job_name="input-bench")
        readers = {
            "per_worker": iter(slow_batches(latency_ms)),
            "service": iter(service.distribute(slow_batches(latency_ms), config, model_dir=None)),
        }
        for reader in readers.values():  # warm-up: the service's job starts, its workers fill their buffers
            _rate(reader, min(seconds, 1.0))
        rates = []
        for index in range(rounds):
            order = list(readers) if index % 2 == 0 else list(reversed(readers))
            rates.append({name: _rate(readers[name], seconds) for name in order})
    ratios = [r["service"] / r["per_worker"] for r in rates]
    result = {
        "per_worker_examples_per_sec": _mean(r["per_worker"] for r in rates),
        "service_examples_per_sec": _mean(r["service"] for r in rates),
        "service_over_per_worker": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3),
        "round_ratios": [round(r, 3) for r in ratios],
        "settings": {
            "latency_ms": latency_ms,
            "data_workers": data_workers,
            "batch_size": BATCH_SIZE,
            "seconds": seconds,
            "rounds": rounds,
            "cores": os.cpu_count(),
        },
    }
    print_fn(text_table(result))
    return result


def _rate(iterator, seconds: float) -> float:
    """Examples/s reading whole batches from `iterator` for at least `seconds`."""
    examples, started = 0, time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds or not examples:
        examples += int(next(iterator)[1].shape[0])
    return examples / elapsed


def _mean(values) -> float:
    values = list(values)
    return round(sum(values) / len(values), 1)


def text_table(result: dict) -> str:
    s = result["settings"]
    served = f"data service ({s['data_workers']} data workers)"
    return "\n".join(
        [
            f"input bench, slow source: {s['latency_ms']:g} ms per example read one after the other, batch "
            f"{s['batch_size']}, {s['rounds']} interleaved rounds of {s['seconds']:g} s, {s['cores']} cores",
            f"{'reader':<44}{'examples/s':>12}",
            f"{'per-worker pipeline (in this process)':<44}{result['per_worker_examples_per_sec']:>12,.1f}",
            f"{served:<44}{result['service_examples_per_sec']:>12,.1f}",
            f"data service / per-worker: {result['service_over_per_worker']:.2f}x "
            f"(rounds: {', '.join(f'{r:.2f}' for r in result['round_ratios'])})",
        ]
    )
