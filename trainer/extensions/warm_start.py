"""`train.warm_start`: start a fresh run from another run's weights (fine-tuning, a bigger head).

The path is a `model_dir` (its newest checkpoint), a checkpoint prefix or a `*.weights.h5` file.
Only the model(s) are taken, and only on a fresh run (a run with a checkpoint of its own resumes).
A dict `{key: path}` warm-starts those models of a dict, each from its source's model `key` if
that is a dict with the key, else from its whole model.

Variables are matched by their place in the model (checkpoint object path, or the weights file's
`layers/dense/vars/0`), not by auto-generated layer names; what matched, what the source lacks and
what it has in excess are printed. A shape mismatch, or nothing matching, is one UserError before
anything is written. The model's own keys come from a checkpoint in `ram://` (or a temp weights
file): nothing on disk.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any, Callable, Mapping

import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension

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
    raise UserError(
        f"train.warm_start {path} is neither a model_dir with checkpoints, a checkpoint prefix "
        f"(its .index file) nor a {WEIGHTS_SUFFIX} file"
    )


def _object_graph(prefix: str):
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    )
    return reader, graph


def _node(graph, path: tuple[str, ...]) -> int | None:
    """The id of the object at `path` from the checkpoint's root, None if there is none."""
    node_id = 0
    for name in path:
        node_id = next((c.node_id for c in graph.nodes[node_id].children if c.local_name == name), None)
        if node_id is None:
            return None
    return node_id


def _checkpoint_shapes(prefix: str, root: tuple[str, ...] = ("model",), label: str = "model") -> dict[str, list[int]]:
    """`{path below the object at root, led by label: shape}` of every variable, breadth first: the
    checkpoint's own keys are shortest paths from the root, which may pass through the optimizer."""
    reader, graph = _object_graph(prefix)
    shapes = reader.get_variable_to_shape_map()
    start = _node(graph, root)
    found: dict[str, list[int]] = {}
    seen, queue = {start}, [] if start is None else [(start, label)]
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
        f.visititems(
            lambda name, obj: shapes.__setitem__(name, list(obj.shape)) if isinstance(obj, h5py.Dataset) else None
        )
    return shapes


def compare(source: Mapping[str, list[int]], own: Mapping[str, list[int]], path: str, hint: str = "") -> list[str]:
    """The keys to restore; a shape mismatch or no match at all is a UserError."""
    matched = sorted(set(source) & set(own))
    for key in matched:
        if source[key] != own[key]:
            raise UserError(
                f"train.warm_start {path}: {key} has shape {source[key]} there but {own[key]} in the "
                "model; change the model or warm-start from a matching run"
            )
    if not matched:
        raise UserError(
            f"train.warm_start {path}: none of its {len(source)} variables matches the model's "
            f"{len(own)}; is it a run of this model?{hint}"
        )
    return matched


def report(
    path: str,
    matched: list[str],
    source: Mapping,
    own: Mapping,
    print_fn: Callable[[str], None],
    key: str | None = None,
) -> None:
    whose = "the model's" if key is None else f"model {key!r}'s"
    print_fn(
        f"warm start {'' if key is None else f'of model {key!r} '}from {path}: restored {len(matched)} of "
        f"{whose} {len(own)} variables: {', '.join(matched)}"
    )
    missing = sorted(set(own) - set(source))
    unused = sorted(set(source) - set(own))
    print_fn(f"warm start: not in the source, left as initialised ({len(missing)}): {', '.join(missing) or '-'}")
    print_fn(f"warm start: in the source, not in the model, ignored ({len(unused)}): {', '.join(unused) or '-'}")


def _from_checkpoint(models: Any, prefix: str, print_fn: Callable[[str], None], key: str | None = None) -> None:
    """`models` from the checkpoint's model(s); with `key`, from its model `key` if it has one."""
    own_checkpoint = tf.train.Checkpoint(model=models)
    probe = own_checkpoint.write(f"ram://trainer-warm-start-{uuid.uuid4().hex}/ckpt")
    if key is None:
        root, label, checkpoint = ("model",), "model", own_checkpoint
    else:
        keyed = _node(_object_graph(prefix)[1], ("model", key)) is not None
        root, label = (("model", key) if keyed else ("model",)), f"model/{key}"
        checkpoint = tf.train.Checkpoint(model={key: models} if keyed else models)
    source, own = _checkpoint_shapes(prefix, root, label), _checkpoint_shapes(probe, ("model",), label)
    hint = (
        f" To start one model of this run's dict from it, name that model: train.warm_start = {{'<key>': '{prefix}'}}"
        if key is None and isinstance(models, Mapping)
        else ""
    )
    matched = compare(source, own, prefix, hint)
    checkpoint.read(prefix).expect_partial()
    report(prefix, matched, source, own, print_fn, key)


def _from_weights_file(models: Any, path: str, print_fn: Callable[[str], None], key: str | None = None) -> None:
    """Merges the file's matching weights into a copy of the model's own file, then loads that."""
    import h5py

    if isinstance(models, Mapping) or not hasattr(models, "load_weights"):
        raise UserError(
            f"train.warm_start {path}: a {WEIGHTS_SUFFIX} file warm-starts one Keras model; "
            + (
                "this run's model_fn returned a dict of models: name the one it is for, "
                f"train.warm_start = {{'<key>': '{path}'}}"
                if isinstance(models, Mapping)
                else f"{'model ' + repr(key) if key else 'the model'} is a {type(models).__name__}; use a checkpoint"
            )
        )
    with tempfile.TemporaryDirectory(prefix="trainer-warm-start-", ignore_cleanup_errors=True) as temp:
        merged = os.path.join(temp, "merged" + WEIGHTS_SUFFIX)
        models.save_weights(merged)
        source, own = _h5_shapes(path), _h5_shapes(merged)
        matched = compare(source, own, path)
        with h5py.File(path, "r") as src, h5py.File(merged, "r+") as dst:
            for name in matched:
                dst[name][...] = src[name][...]
        models.load_weights(merged)
    report(path, matched, source, own, print_fn, key)


def warm_start(models: Any, source: str | Mapping[str, str], print_fn: Callable[[str], None] = print) -> None:
    """Initialises `models` from `source`, a path or `{model key: path}`; prints what matched."""
    if not isinstance(source, Mapping):
        return _warm_start_one(models, resolve(source), print_fn)
    if not isinstance(models, Mapping):
        raise UserError(
            f"train.warm_start {dict(source)!r} names models by key, but this run's model_fn returns one "
            "model; give a path: train.warm_start = '<path>'"
        )
    unknown = sorted(str(k) for k in source if k not in models)
    if unknown:
        raise UserError(
            f"train.warm_start names model(s) {', '.join(map(repr, unknown))}, but this run's model_fn "
            f"returns {', '.join(map(repr, sorted(models)))}; key each path like the model it is for"
        )
    for key, path in source.items():
        _warm_start_one(models[key], resolve(path), print_fn, key)


def _warm_start_one(models: Any, resolved: str, print_fn: Callable[[str], None], key: str | None = None) -> None:
    if resolved.endswith(WEIGHTS_SUFFIX):
        _from_weights_file(models, resolved, print_fn, key)
    else:
        _from_checkpoint(models, resolved, print_fn, key)


class WarmStart(Extension):
    """Initialises a fresh run's model(s) from `path` (see the module docstring)."""

    name = "warm_start"
    setting = "train.warm_start"
    supports = modes.SYNCHRONOUS
    unsupported_reason = "the model's probe checkpoint would be written by the ps tasks"
    unsupported_fix = "warm-start a synchronous run, or copy the source checkpoint into the model_dir to resume from it"

    def __init__(self, path: Any):
        paths = list(path.values()) if isinstance(path, Mapping) and path else [path]
        if isinstance(path, Mapping) and not all(isinstance(k, str) and k for k in path):
            paths = [None]
        if not all(isinstance(p, str) and p for p in paths):
            raise UserError(
                f"train.warm_start must be a path (a model_dir, a checkpoint prefix or a {WEIGHTS_SUFFIX} "
                "file), a dict {model key: path} for some models of a dict, or None, got " + repr(path)
            )
        for p in paths:
            resolve(p)  # a missing source is refused now, before anything is built
        self.path = dict(path) if isinstance(path, Mapping) else path

    def restored(self, context: Context, path: str | None) -> None:
        if path is None:  # a fresh run only; a shape mismatch stops here, nothing written
            warm_start(context.task.models, self.path, context.print if context.runtime.is_chief else lambda _: None)
