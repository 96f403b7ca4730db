"""AutoGraph for the user's functions only, not for the framework's own graph code.

A step or eval step may branch or loop on tensors in Python (`if loss > 0:`, `for x in
tf.range(n):`), as in any `tf.function`: AutoGraph rewrites such code into graph control
flow. Converting the framework's own compiled code as well (the loops, the per-call sums,
the output checks, the built-in steps, the input pipeline's map functions) rewrites about 20
functions at every start for nothing: they are plain TF ops. Measured with experiments.bench's
MLP on 2 cores, that took 1.65 s of the 2.9 s from the end of imports to the first step;
Keras' `fit` pays none of it (AutoGraph never converts Keras). So the loops compile with
`autograph=False`, call the user's functions through `call_user` (which converts them, and
what they call, as `tf.function` would), and mark their own functions that `tf.data` or a
user's step may reach with `tf.autograph.experimental.do_not_convert`, the same public
marker a user can put on a step written in plain TF ops to skip its conversion too.

What the user's code raises is theirs to fix, and a traceback through TensorFlow, Keras, gin and
the loop buries it: `user_function` turns it into one UserCodeError line naming the function and
its gin binding, with only the user's own frames (`user_frames`) printed above it. A model built
when a user's module is imported (`built_at_import`) is found the same way, by where it lives.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import sysconfig
import traceback
from typing import Any, Callable, Iterator, Mapping

import tensorflow as tf

from trainer.errors import RunFailure, UserCodeError, UserError
from trainer.task import contract

# Whose frames are not the user's: ours (also where we are not installed), and, through the
# installation directories, TensorFlow's, Keras', gin's, every other installed library's and Python's own.
_NOT_USER_PACKAGES = ("trainer", "tensorflow", "keras", "gin")


def _call(fn: Callable, *args, **kwargs) -> Any:
    return fn(*args, **kwargs)


@functools.cache
def _converting_call() -> Callable:
    """`_call` converted by AutoGraph (once per process): its call of `fn` converts `fn`, recursively."""
    return tf.autograph.to_graph(_call)


def call_user(fn: Callable, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` with `fn` converted by AutoGraph, as a `tf.function` would convert it.

    Works in a function traced with `autograph=False` (the conversion turns AutoGraph on for
    `fn` and what it calls) and eagerly alike. A function marked with
    `tf.autograph.experimental.do_not_convert`, a `tf.function` and Keras code are called
    as they are, by AutoGraph's own rules.
    """
    return _converting_call()(fn, *args, **kwargs)


def placed(batch: Any) -> Any:
    """`batch` with each tensor passed through `tf.identity` in replica context, so that it is placed
    on this replica's device: a tensor that enters `strategy.run` from outside carries no device
    under MultiWorkerMirroredStrategy, and a cross-replica call on it in a step
    (`get_replica_context().all_gather(labels)`) then fails with "destinations can not be empty"."""
    return tf.nest.map_structure(tf.identity, batch)


def call_step(step_fn: Callable, model: Any, optimizer: Any, batch: Any, global_batch_size: int) -> Any:
    """The user's train step on `batch` (`placed`), in replica context, through `call_user`; each
    value goes to the parameter of its name, else of its position (trainer/task/contract.py)."""
    return call_user(contract.adapt(step_fn, contract.STEP), model, optimizer, placed(batch), global_batch_size)


def built_at_import() -> list[str]:
    """`module.NAME` of every model, layer or variable that a module of the user's holds at its
    top level: built when the module was imported, so outside any strategy's scope, and (its
    first op) before the run could set up its devices."""
    import keras

    keras_variable = getattr(keras, "Variable", tf.Variable)  # tf_keras (the parity tool's fit) has none
    kinds = (keras.layers.Layer, keras_variable, tf.Variable, tf.Module)
    found = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or not is_user_frame(path):
            continue
        found += [
            f"{name}.{attribute}"
            for attribute, value in list(vars(module).items())
            if not attribute.startswith("__") and isinstance(value, kinds)
        ]
    return sorted(found)


def name_of(fn: Any) -> str:
    """How a gin file names `fn` (`@load` binds a function `load`; `@Cls()` an instance of `Cls`)."""
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = [os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    for package in _NOT_USER_PACKAGES:
        module = sys.modules.get(package)
        for path in getattr(module, "__path__", ()) or ():
            dirs.append(os.path.realpath(path))
    return tuple(os.path.join(d, "") for d in dirs)


def is_user_frame(filename: str) -> bool:
    """Whether a frame's file is the user's: not ours, not an installed library's or Python's own,
    nor a file AutoGraph generated."""
    if filename.startswith("<") or "__autograph_generated_file" in filename:
        return False
    path = os.path.realpath(filename)
    return not any(path.startswith(d) for d in _library_dirs())


def user_frames(error: BaseException) -> str:
    """The frames of `error`'s traceback that are the user's own, formatted as a traceback shows them."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if is_user_frame(f.filename)]
    if not frames:
        return ""
    return "the user code's frames (most recent call last):\n" + "".join(traceback.format_list(frames))


def own_frame_names(error: BaseException) -> list[str]:
    """The qualified names of the functions of the user's own in `error`'s traceback, outermost first."""
    return [
        getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        for frame, _ in traceback.walk_tb(error.__traceback__)
        if is_user_frame(frame.f_code.co_filename)
    ]


def raised_by(error: Exception, name: str, where: str, doing: str = "") -> UserCodeError:
    """The UserCodeError saying that the user's `name` (called as `where`, e.g. 'train.input_fn =
    @load') raised `error` (while `doing`, e.g. "for split 'eval'"), with the user's frames as details."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras bolds the message of a layer's error
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Exception encountered when calling"):
        lines = lines[1:]  # Keras' wrapper of an error in a layer's call: the error's own message follows
    text = lines[0][:300] if lines else ""
    what = f"{type(error).__name__}: {text}" if text else type(error).__name__
    doing = f" {doing}" if doing else ""
    return UserCodeError(f"{where} raised {what}{doing}; fix {name} (its frames are printed above)", user_frames(error))


@contextlib.contextmanager
def user_function(fn: Any, binding: str, doing: str = "") -> Iterator[None]:
    """Turns an exception raised in the block (a call of the user's `fn`, bound as `binding`) into
    one UserCodeError line with the user's own frames; the framework's refusals pass unchanged."""
    try:
        yield
    except (UserError, RunFailure):
        raise
    except Exception as e:  # noqa: BLE001  (whatever the user's code raises is theirs to fix)
        name = name_of(fn)
        raise raised_by(e, name, f"{binding} = @{name}", doing) from e


def _code(fn: Any) -> Any:
    """The code object a call of `fn` runs (through gin's and functools' wrappers), None if none."""
    fn = inspect.unwrap(getattr(fn, "func", fn))
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        fn = getattr(type(fn), "__call__", None)  # noqa: B004  (the method whose code a call runs)
    return getattr(fn, "__code__", None)


@contextlib.contextmanager
def user_functions(functions: Mapping[str, Any]) -> Iterator[None]:
    """Like `user_function`, for a block that calls several of the user's functions among its own
    code (`functions`: binding -> function, e.g. {'train.model_fn': cnn}): an exception raised
    inside one of them names the outermost one it passed through; any other goes on unchanged."""
    try:
        yield
    except (UserError, RunFailure):
        raise
    except Exception as e:  # noqa: BLE001  (re-raised unchanged unless it came from the user's code)
        codes = {code: (binding, fn) for binding, fn in functions.items() if (code := _code(fn)) is not None}
        for frame, _ in traceback.walk_tb(e.__traceback__):
            if frame.f_code in codes:
                binding, fn = codes[frame.f_code]
                name = name_of(fn)
                raise raised_by(e, name, f"{binding} = @{name}") from e
        # Not in a bound function itself but in code of the user's it reached (a model's `call`,
        # a layer's `build`, a loss the model adds): the last such frame is the one to fix.
        if own := own_frame_names(e):
            name = own[-1]
            raise raised_by(
                e, name, f"{name} (run while the loop built and traced the functions of {', '.join(functions)})"
            ) from e
        raise
