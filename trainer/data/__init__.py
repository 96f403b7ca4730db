"""Input: input functions (the user's and the built-in sources) and the pipelines that batch,
shard and distribute any of them (see trainer.data.inputs for the input function contract)."""

from trainer.data.augment import ImageAugmentation
from trainer.data.distribute import (
    distribute_eval,
    distribute_train,
    held,
    num_workers,
    replica_slices,
    served_train,
    shards_by_file,
)
from trainer.data.indexed import IndexedBatches, indexed_batches, replica_slice
from trainer.data.inputs import (
    MAX_IN_MEMORY_BYTES,
    SPLITS,
    DataSource,
    Input,
    InputFunction,
    Shard,
    as_input,
    check_sizes,
)
from trainer.data.order import batch_indices, example_indices, example_seeds
from trainer.data.pipeline import (
    MAX_SHUFFLE_BUFFER,
    SHARD_POLICIES,
    eval_dataset,
    prefetch_for_accelerators,
    shuffled_index_batches,
    train_dataset,
)
from trainer.data.sequences import SequenceBatching
from trainer.data.sources import FASHION_MNIST_FILES, Digits, FashionMnist, Synthetic
from trainer.data.tfrecord import (
    FEATURE_KINDS,
    Feature,
    TFRecordFiles,
    bytes_feature,
    float_feature,
    int64_feature,
    int64_sequence_feature,
    jpeg_feature,
    png_feature,
)
