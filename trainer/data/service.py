"""TensorFlow's distributed input engine, the tf.data service, for the train input.

With `train.data_service` set, the train pipeline (batched, as the loop builds it) runs on the
service's data workers instead of in each trainer: every input pipeline of the run (a parameter-server
worker, a MultiWorkerMirrored worker, the one process) reads its per-replica batches from one shared
job. With `processing_mode='distributed_epoch'` the dispatcher hands each part of the source to one data
worker and each batch to one consumer, so an epoch visits every example once across the whole run;
with 'parallel_epochs' every data worker runs the whole pipeline and the consumers share what they make.

`'local'` starts a dispatcher and `num_workers` data workers beside the run (the entry point's local
cluster, trainer/distribution/local_cluster.py, which hands their address over in ADDRESS_ENV);
`'grpc://host:port'` names a dispatcher already running (`python -m trainer.server` with a
`dispatcher` task, docs/parameter-servers.md). The servers themselves are `serve`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from trainer.distribution import modes
from trainer.distribution.local_cluster import ADDRESS_ENV, DEFAULT_DATA_WORKERS
from trainer.errors import UserError
from trainer.validation import check_choice, check_int

PROCESSING_MODES = ("distributed_epoch", "parallel_epochs")
LOCAL = "local"
SUPPORT = modes.support(
    ("default", "one_device", "mirrored", "multi_worker_mirrored", "parameter_server"),
    "single-process strategies, multi_worker_mirrored and parameter_server",
)


@dataclasses.dataclass(frozen=True)
class DataServiceConfig:
    """Where the service is and how it hands out the data (gin: `train.data_service = 'local'`, and
    `data_service.num_workers = 2`, `data_service.processing_mode = 'parallel_epochs'`, ...).

    Attributes:
      address: 'local' (a dispatcher and `num_workers` data workers started beside the run and
        stopped with it) or 'grpc://host:port' of a running dispatcher.
      num_workers: data workers a 'local' service starts (>= 1).
      processing_mode: 'distributed_epoch' (each example once per epoch across all consumers; the
        source must be splittable: in-memory data, files, ranges) or 'parallel_epochs' (every data
        worker runs the whole pipeline).
      job_name: the job every input pipeline of the run reads from (default: one per model_dir, so
        a restarted run asks for the same job).
      shuffle_buffer: examples each data worker shuffles among. Every data worker fills its own
        buffer from the next parts of the source, so the buffers together hold the start of the
        next pass before this one is done: at a pass's end up to num_workers x shuffle_buffer
        examples of the two mix (smaller than the loop's own buffer for that reason).
    """

    address: str = LOCAL
    num_workers: int = DEFAULT_DATA_WORKERS
    processing_mode: str = "distributed_epoch"
    job_name: str | None = None
    shuffle_buffer: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not (self.address == LOCAL or self.address.startswith("grpc://")):
            raise UserError(
                f"train.data_service must be 'local' or 'grpc://host:port' (a running dispatcher), got {self.address!r}"
            )
        check_int("data_service.num_workers", self.num_workers)
        check_int("data_service.shuffle_buffer", self.shuffle_buffer)
        check_choice("data_service.processing_mode", self.processing_mode, PROCESSING_MODES)
        if self.job_name is not None and (not isinstance(self.job_name, str) or not self.job_name):
            raise UserError(f"data_service.job_name must be a non-empty string or None, got {self.job_name!r}")

    @property
    def local(self) -> bool:
        return self.address == LOCAL


def config_of(value: Any) -> DataServiceConfig | None:
    """`train.data_service` as a config: None, a DataServiceConfig, or an address with the defaults."""
    if value is None or isinstance(value, DataServiceConfig):
        return value
    return DataServiceConfig(address=value)


def dispatcher_address(config: DataServiceConfig) -> str:
    """The dispatcher's 'grpc://host:port': the given one, or for 'local' the one its local cluster started."""
    if not config.local:
        return config.address
    if address := os.environ.get(ADDRESS_ENV, "").strip():
        return address
    raise UserError(
        "train.data_service = 'local' starts its servers only where this program starts the cluster "
        "(no TF_CONFIG: the embedded parameter-server cluster or one process) or under `python -m "
        "trainer.launch`; on a cluster of your own run a dispatcher (`python -m trainer.server` with a "
        "'dispatcher' task) and set train.data_service = 'grpc://host:port'"
    )


def job_name(config: DataServiceConfig, model_dir: str | None) -> str:
    if config.job_name:
        return config.job_name
    return "trainer-" + hashlib.sha1((model_dir or "").encode()).hexdigest()[:12]


def distribute(batches, config: DataServiceConfig, *, model_dir: str | None):
    """`batches` read from the service, whose data workers make them: this reader's share of the run's
    one job. Never auto-sharded again by the strategy: the service already splits the data."""
    import tensorflow as tf

    served = batches.apply(
        tf.data.experimental.service.distribute(
            processing_mode=config.processing_mode,
            service=dispatcher_address(config),
            job_name=job_name(config, model_dir),
        )
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return served.with_options(options)


def serve(task_type: str, cluster: dict[str, list[str]], task_id: int):
    """Starts this task's server of a service cluster `{'dispatcher': [address], 'data_worker': [...]}`
    and returns it (it serves until the process ends)."""
    import tensorflow as tf

    address = cluster[task_type][task_id]
    port = int(address.rsplit(":", 1)[1])
    if task_type == "dispatcher":
        return tf.data.experimental.service.DispatchServer(tf.data.experimental.service.DispatcherConfig(port=port))
    return tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(
            dispatcher_address=cluster["dispatcher"][0], worker_address=address, port=port
        )
    )


PYTHON_OPS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")  # from_generator, py_function, numpy_function


def check_servable(inp: Any) -> None:
    """Refuses, in one line, a train pipeline that calls Python: the service's data workers are other
    processes, which have none of this process's Python functions (TensorFlow's own error there names a
    missing callback key)."""
    from trainer import internals
    from trainer.data.inputs import as_input

    inp = as_input(inp)
    if inp.train_arrays(None) is not None:
        return  # the service reads the arrays, not the user's dataset (train_batches)
    if found := sorted(set(PYTHON_OPS) & internals.dataset_ops(inp.examples("train", None))):
        raise UserError(
            f"train.data_service: the train dataset of train.input_fn {inp.name} calls Python ({found[0]}: "
            "tf.data.Dataset.from_generator, tf.py_function or tf.numpy_function), which the service's data "
            "workers, processes of their own, cannot run; build it from TensorFlow ops (from_tensor_slices, "
            "TFRecordDataset, map of graph code) or leave train.data_service unset"
        )


def train_batches(inp, batch_size: int, shuffle_buffer: int, seed: int):
    """Endless shuffled batches of the train split for the data workers to make. Unlike the loop's own
    pipeline, nothing carries state from one part of the source to the next, so the dispatcher can split
    it (by example, each pass in order) among the data workers: each shuffles what it gets in a buffer of
    `shuffle_buffer`, unseeded (which worker gets which part is the service's choice anyway), and
    batches it. Data held in memory is gathered by index from the arrays, which travel in the pipeline,
    in an order shuffled once by `seed` (the same every pass), so a pass is not in the arrays' order (often
    sorted by label) where the buffer is smaller than the data."""
    import tensorflow as tf

    from trainer.data import sequences
    from trainer.data.inputs import as_input
    from trainer.data.pipeline import graph_code

    inp = as_input(inp)
    held = inp.train_arrays(None)
    if held is not None:
        count = len(tf.nest.flatten(held[0])[0])
        order = tf.random.experimental.stateless_shuffle(tf.range(count, dtype=tf.int64), seed=[seed, 0])
        source = tf.data.Dataset.range(count).map(graph_code(lambda i: tf.gather(order, i)))
    else:
        source = inp.examples("train", None)
    if held is None:  # examples of any length padded per batch (bucketing is refused with the service)
        return sequences.stream_batches(source.shuffle(shuffle_buffer).repeat(), batch_size, seed, inp.sequences)
    batches = source.shuffle(shuffle_buffer).repeat().batch(batch_size, drop_remainder=True)
    tensors = tf.nest.map_structure(tf.constant, held[0])
    batches = batches.map(graph_code(lambda index: tf.nest.map_structure(lambda t: tf.gather(t, index), tensors)))
    return batches if inp.decode_batch is None else batches.map(inp.decode_batch)
