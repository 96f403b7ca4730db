"""`train.warm_start`: start a fresh run from another run's weights (fine-tuning, a bigger head).

The path is another run's `model_dir` (its newest checkpoint), a checkpoint prefix
(`.../ckpt-600`), or a Keras weights file (`*.weights.h5`). Only the model(s) are taken, not
the optimizer, the step or the EMA, and only when the run starts fresh: a run that has a
checkpoint of its own resumes from it and ignores `train.warm_start`.

The restore is partial and says so: variables are matched by their place in the model (the
checkpoint's object path, e.g. `model/_functional/_operations/5/_kernel`, or the weights
file's `layers/dense/vars/0`), which does not depend on the layers' auto-generated names. It
prints what was restored, what the model has that the source lacks (left as initialised) and
what the source has that the model lacks (ignored). A variable with another shape, or a source
that matches nothing, is one UserError line, raised before anything in model_dir is written.

To list the model's own keys it writes its checkpoint to TensorFlow's in-memory filesystem
(`ram://`), or its weights file to a temporary directory that is deleted: nothing on disk.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Mapping

import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions.protocol import Extension, Setup

WEIGHTS_SUFFIX = ".weights.h5"


def resolve(path: str) -> str:
    """The checkpoint prefix or weights file that `path` names."""
    if path.endswith(WEIGHTS_SUFFIX):
        if not os.path.isfile(path):
            raise UserError(f"train.warm_start: no weights file {path}")
        return path
    if os.path.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise UserError(f"train.warm_start: no checkpoint in {path}")
        return latest
    if tf.io.gfile.exists(path + ".index"):
        return path
    raise UserError(f"train.warm_start {path} is neither a model_dir with checkpoints, a checkpoint prefix "
                    f"(its .index file) nor a {WEIGHTS_SUFFIX} file")


def _checkpoint_shapes(prefix: str) -> dict[str, list[int]]:
    """`{path below the checkpoint's "model": shape}` of every variable of the model(s).

    Walks the checkpoint's object graph from its `model` node, breadth first (each variable
    under its shortest path there): the checkpoint's own keys cannot be compared, since a
    variable is keyed by its shortest path from the root, which may pass through the optimizer.
    """
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    shapes = reader.get_variable_to_shape_map()
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    roots = [c.node_id for c in graph.nodes[0].children if c.local_name == "model"]
    found: dict[str, list[int]] = {}
    seen = set(roots)
    queue = [(node_id, "model") for node_id in roots]
    while queue:
        node_id, path = queue.pop(0)
        for attribute in graph.nodes[node_id].attributes:
            if attribute.name == "VARIABLE_VALUE" and attribute.checkpoint_key in shapes:
                found[path] = list(shapes[attribute.checkpoint_key])
        for child in graph.nodes[node_id].children:
            if child.node_id not in seen:
                seen.add(child.node_id)
                queue.append((child.node_id, f"{path}/{child.local_name}"))
    return found


def _h5_shapes(path: str) -> dict[str, list[int]]:
    import h5py

    shapes: dict[str, list[int]] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: shapes.__setitem__(name, list(obj.shape))
                     if isinstance(obj, h5py.Dataset) else None)
    return shapes


def compare(source: Mapping[str, list[int]], own: Mapping[str, list[int]], path: str) -> list[str]:
    """The keys to restore; a shape mismatch or no match at all is a UserError."""
    for key in sorted(set(source) & set(own)):
        if source[key] != own[key]:
            raise UserError(f"train.warm_start {path}: {key} has shape {source[key]} there but {own[key]} in the "
                            "model; change the model or warm-start from a matching run")
    matched = sorted(set(source) & set(own))
    if not matched:
        raise UserError(f"train.warm_start {path}: none of its {len(source)} variables matches the model's "
                        f"{len(own)}; is it a run of this model?")
    return matched


def report(path: str, matched: list[str], source: Mapping, own: Mapping, print_fn: Callable[[str], None]) -> None:
    print_fn(f"warm start from {path}: restored {len(matched)} of the model's {len(own)} variables: "
             f"{', '.join(matched)}")
    missing = sorted(set(own) - set(source))
    unused = sorted(set(source) - set(own))
    print_fn(f"warm start: not in the source, left as initialised ({len(missing)}): {', '.join(missing) or '-'}")
    print_fn(f"warm start: in the source, not in the model, ignored ({len(unused)}): {', '.join(unused) or '-'}")


def _from_checkpoint(models: Any, prefix: str, print_fn: Callable[[str], None]) -> None:
    checkpoint = tf.train.Checkpoint(model=models)
    probe = checkpoint.write(f"ram://trainer-warm-start-{uuid.uuid4().hex}/ckpt")
    source, own = _checkpoint_shapes(prefix), _checkpoint_shapes(probe)
    matched = compare(source, own, prefix)
    checkpoint.read(prefix).expect_partial()
    report(prefix, matched, source, own, print_fn)


def _from_weights_file(models: Any, path: str, print_fn: Callable[[str], None]) -> None:
    """Merges the file's matching weights into a copy of the model's own file, then loads that."""
    import h5py

    if isinstance(models, Mapping) or not hasattr(models, "load_weights"):
        raise UserError(f"train.warm_start {path}: a {WEIGHTS_SUFFIX} file warm-starts one Keras model; "
                        "this run's model_fn returned " + ("a dict of models" if isinstance(models, Mapping)
                                                            else type(models).__name__) + "; use a checkpoint")
    temp_dir = tempfile.mkdtemp(prefix="trainer-warm-start-")
    try:
        merged = os.path.join(temp_dir, "merged" + WEIGHTS_SUFFIX)
        models.save_weights(merged)
        source, own = _h5_shapes(path), _h5_shapes(merged)
        matched = compare(source, own, path)
        with h5py.File(path, "r") as src, h5py.File(merged, "r+") as dst:
            for key in matched:
                dst[key][...] = src[key][...]
        models.load_weights(merged)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    report(path, matched, source, own, print_fn)


def warm_start(models: Any, path: str, print_fn: Callable[[str], None] = print) -> None:
    """Initialises `models` from `path` (see the module docstring); prints what matched."""
    resolved = resolve(path)
    if resolved.endswith(WEIGHTS_SUFFIX):
        _from_weights_file(models, resolved, print_fn)
    else:
        _from_checkpoint(models, resolved, print_fn)


class WarmStart(Extension):
    """Initialises a fresh run's model(s) from `path` (see the module docstring)."""

    name = "warm_start"
    setting = "train.warm_start"
    supports = modes.SYNCHRONOUS
    unsupported_reason = "the model's probe checkpoint would be written by the ps tasks"
    unsupported_fix = "warm-start a synchronous run, or copy the source checkpoint into the model_dir to resume from it"

    def __init__(self, path: Any):
        if not isinstance(path, str) or not path:
            raise UserError(f"train.warm_start must be a path (a model_dir, a checkpoint prefix or a {WEIGHTS_SUFFIX} "
                            f"file) or None, got {path!r}")
        resolve(path)  # a missing source is refused now, before anything is built
        self.path = path

    def restored(self, setup: Setup, path: str | None) -> None:
        if path is None:  # a fresh run only; a shape mismatch stops here, nothing written
            warm_start(setup.task.models, self.path, setup.print if setup.runtime.is_chief else lambda _: None)
