"""The input bench (experiments/bench/input_only.py) and the pipeline options it set: real TensorFlow.

No rate is asserted beyond being measured: this machine is shared, its numbers vary.
"""

from __future__ import annotations

import numpy as np
import pytest

from experiments.bench import input_only
from tests.support import run_python
from trainer import data, write_tfrecords

BENCH = """
import json
from experiments.bench.input_only import run_input_bench
lines = []
result = run_input_bench(["gin/single.gin"], [], seconds=0.5, print_fn=lines.append)
print(json.dumps({"result": result, "table": "\\n".join(lines)}))
"""


@pytest.mark.slow
def test_input_bench_measures_memory_tfrecord_and_the_step():
    answer = run_python(BENCH, timeout=120)  # a fresh process: the bench sets up devices as train does
    result, table = answer["result"], answer["table"]
    memory, tfrecord, step = result["sources"]["memory"], result["sources"]["tfrecord"], result["step"]
    assert memory["in_memory"] is True  # digits: the loop's in-memory fast path
    for measured in (memory, tfrecord):
        assert measured["examples_per_sec"] > 0 and measured["batches"] >= result["settings"]["steps_per_loop"]
    assert tfrecord["shards"] == input_only.NUM_SHARDS and tfrecord["bytes"] > 0
    assert step["examples_per_sec"] > 0 and step["steps"] >= 50
    for name in ("memory", "tfrecord"):
        ratio = result["input_over_step"][name]
        assert abs(ratio - result["sources"][name]["examples_per_sec"] / step["examples_per_sec"]) < 1e-2 * ratio
    assert result["settings"]["strategy"] == "default" and result["settings"]["train_examples"] == 1438
    rows = table.splitlines()
    assert rows[2].startswith("memory (config's input, in memory)") and rows[3].startswith("tfrecord (4 shards")
    assert all(row.endswith(("keeps up", "input-bound")) for row in rows[2:4])
    assert rows[4].startswith("step (compiled, batch on device)")


def test_table_says_input_bound_and_why_a_source_was_skipped():
    assert input_only.verdict(0.5) == "input-bound" and input_only.verdict(1.0) == "keeps up"
    result = {
        "sources": {
            "memory": {"examples_per_sec": 500.0, "in_memory": False},
            "tfrecord": {"examples_per_sec": None, "skipped": "dict examples"},
        },
        "step": {"examples_per_sec": 1000.0},
        "input_over_step": {"memory": 0.5, "tfrecord": None},
        "settings": {
            "strategy": "mirrored",
            "num_replicas": 2,
            "global_batch_size": 64,
            "train_examples": 100,
            "seconds": 1.0,
            "prefetch": True,
        },
    }
    rows = input_only.text_table(result).splitlines()
    assert rows[2].startswith("config's input (streamed)") and rows[2].endswith("0.50x  input-bound")
    assert rows[3].endswith("not measured: dict examples")
    assert len(rows) == 5  # with an accelerator, no note on inline input


def test_batched_parsing_keeps_every_example_in_order(tmp_path):
    """Both schemas that parse a batch of records at a time give the written examples, in order."""
    built_in = write_tfrecords.write(data.Digits(), str(tmp_path), 3)
    by_features = data.TFRecordFiles(
        built_in.train_pattern,
        built_in.eval_pattern,
        features={"image": data.float_feature((8, 8, 1)), "label": data.int64_feature()},
    )
    images, labels = data.Digits().arrays("train")
    for source in (built_in, by_features):
        got = list(source.examples("train").as_numpy_iterator())
        assert len(got) == len(labels)
        np.testing.assert_array_equal(np.stack([x for x, _ in got]), images)
        np.testing.assert_array_equal([y for _, y in got], labels)
    shards = [[int(y) for _, y in built_in.examples("train", (4, i)).as_numpy_iterator()] for i in range(4)]
    assert [y for i in range(len(labels)) for y in [shards[i % 4][i // 4]]] == list(labels)  # by record


SERVICE_BENCH = """
import json
from trainer.distribution import netns
netns.isolate("the test's tf.data service")
from experiments.bench.service_input import run_service_bench
lines = []
result = run_service_bench(latency_ms=4, data_workers=2, seconds=0.4, rounds=2, print_fn=lines.append)
print(json.dumps({"result": result, "table": "\\n".join(lines)}))
"""


@pytest.mark.slow
def test_service_bench_reads_a_slow_source_faster_with_two_data_workers():
    """A source that waits 4 ms per example: one pipeline makes at most 250 examples/s, two data workers
    about twice that (sleeping needs no core, so a busy machine changes it little)."""
    answer = run_python(SERVICE_BENCH, timeout=240)
    result, rows = answer["result"], answer["table"].splitlines()
    assert result["service_over_per_worker"] > 1.3, result
    assert len(result["round_ratios"]) == 2 and result["settings"]["data_workers"] == 2
    assert rows[2].startswith("per-worker pipeline") and rows[3].startswith("data service (2 data workers)")
    assert rows[4].startswith(f"data service / per-worker: {result['service_over_per_worker']:.2f}x")
