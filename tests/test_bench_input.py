"""The input bench (experiments/bench/input_only.py) and the pipeline options it set: real TensorFlow.

No rate is asserted beyond being measured: this machine is shared, its numbers vary.
"""

from __future__ import annotations

import numpy as np
import pytest

from experiments.bench import input_only, service_input
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
    assert memory["in_memory"] is True and tfrecord["in_memory"] is True  # digits: the loop's in-memory paths
    for measured in (memory, tfrecord, result["sources"]["tfrecord_stream"]):
        assert measured["examples_per_sec"] > 0 and measured["batches"] >= result["settings"]["steps_per_loop"]
    assert tfrecord["shards"] == input_only.NUM_SHARDS and tfrecord["bytes"] > 0
    assert step["examples_per_sec"] > 0 and step["steps"] >= 50
    for name in ("memory", "tfrecord", "tfrecord_stream"):
        ratio = result["input_over_step"][name]
        assert abs(ratio - result["sources"][name]["examples_per_sec"] / step["examples_per_sec"]) < 1e-2 * ratio
    assert result["settings"]["strategy"] == "default" and result["settings"]["train_examples"] == 1438
    rows = table.splitlines()
    assert rows[2].startswith("memory (config's input, in memory)") and rows[3].startswith("tfrecord (4 shards")
    assert "MiB, held)" in rows[3] and rows[4].startswith("tfrecord, the same streamed")
    assert all(row.endswith(("keeps up", "input-bound")) for row in rows[2:5])
    assert rows[5].startswith("step (compiled, batch on device)")


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


def test_service_bench_table_shows_both_readers_and_their_ratio():
    """experiments/bench/service_input.py's table (its real run, three servers and six rounds, is the
    one in docs/speed.md; the sleep it reads through is tried in tests/test_internals.py)."""
    settings = {"latency_ms": 2, "data_workers": 2, "batch_size": 16, "seconds": 3, "rounds": 2, "cores": 2}
    result = {
        "per_worker_examples_per_sec": 480.8,
        "service_examples_per_sec": 930.9,
        "service_over_per_worker": 1.936,
        "round_ratios": [2.04, 1.84],
        "settings": settings,
    }
    rows = service_input.text_table(result).splitlines()
    assert rows[0].startswith("input bench, slow source: 2 ms per example") and "2 interleaved rounds of 3 s" in rows[0]
    assert rows[2].startswith("per-worker pipeline") and rows[2].endswith("480.8")
    assert rows[3].startswith("data service (2 data workers)") and rows[3].endswith("930.9")
    assert rows[4] == "data service / per-worker: 1.94x (rounds: 2.04, 1.84)"
