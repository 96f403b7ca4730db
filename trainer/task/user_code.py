"""AutoGraph for the user's functions only, and the user's errors shown with the user's frames only.

A step may branch or loop on tensors in Python, as in any `tf.function`. Converting the framework's own
graph code as well (plain TF ops, about 20 functions) took 1.65 s of the 2.9 s from imports to the first
step (measured, 2 cores; Keras' `fit` pays none of it). So the loops compile with `autograph=False`, call
the user's functions through `call_user` (which converts them as `tf.function` would), and mark their own
functions that `tf.data` or a user's step may reach with `tf.autograph.experimental.do_not_convert`.

What the user's code raises is theirs to fix: `user_function` turns it into one UserCodeError line naming
the function and its gin binding, with only the user's own frames (`user_frames`) printed above it.
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

from trainer.errors import RunFailure, UserCodeError, UserError, layer_call_cause
from trainer.task import contract

# Whose frames are not the user's: these packages' (also where not installed), any installed library's, Python's.
_NOT_USER_PACKAGES = ("trainer", "tensorflow", "keras", "gin")


def _call(fn: Callable, *args, **kwargs) -> Any:
    return fn(*args, **kwargs)


@functools.cache
def _converting_call() -> Callable:
    return tf.autograph.to_graph(_call)


def call_user(fn: Callable, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` with `fn` (and what it calls) converted by AutoGraph as a `tf.function` would,
    also inside a function traced with `autograph=False`."""
    return _converting_call()(fn, *args, **kwargs)


def placed(batch: Any) -> Any:
    """`batch` through `tf.identity` in replica context, placing it on this replica's device: under MWMS a
    tensor from outside `strategy.run` has none, and an `all_gather` of it fails ("destinations can not be
    empty")."""
    return tf.nest.map_structure(tf.identity, batch)


def call_step(step_fn: Callable, model: Any, optimizer: Any, batch: Any, global_batch_size: int) -> Any:
    """The user's train step on `batch` (`placed`), through `call_user` and trainer/task/contract.py."""
    return call_user(contract.adapt(step_fn, contract.STEP), model, optimizer, placed(batch), global_batch_size)


def built_at_import() -> list[str]:
    """`module.NAME` of every model, layer or variable a module of the user's holds at its top level: built at
    import, outside any strategy's scope and before the run could set up its devices."""
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
    """Whether a frame's file is the user's: not a library's, Python's, or AutoGraph's generated code."""
    if filename.startswith("<") or "__autograph_generated_file" in filename:
        return False
    path = os.path.realpath(filename)
    return not any(path.startswith(d) for d in _library_dirs())


def user_frames(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if is_user_frame(f.filename)]
    if not frames:
        return ""
    return "the user code's frames (most recent call last):\n" + "".join(traceback.format_list(frames))


def own_frame_names(error: BaseException) -> list[str]:
    return [
        getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        for frame, _ in traceback.walk_tb(error.__traceback__)
        if is_user_frame(frame.f_code.co_filename)
    ]


def raised_by(error: Exception, name: str, where: str, doing: str = "") -> UserCodeError:
    """The UserCodeError: the user's `name` (called as `where`) raised `error` (while `doing`)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras bolds the message of a layer's error
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    kind = type(error).__name__
    if layer := layer_call_cause(lines):  # Keras' wrapper: the cause, and the call unless `name` is that call
        call, cause = layer
        what = f"{kind}: {cause[:300]}" if call.startswith(f"{name}(") else f"{kind} in {call}: {cause[:300]}"
    else:
        what = f"{kind}: {lines[0][:300]}" if lines else kind
    doing = f" {doing}" if doing else ""
    return UserCodeError(f"{where} raised {what}{doing}; fix {name} (its frames are printed above)", user_frames(error))


@contextlib.contextmanager
def user_function(fn: Any, binding: str, doing: str = "") -> Iterator[None]:
    """An exception raised by the user's `fn` (bound as `binding`) in the block as one UserCodeError line."""
    try:
        yield
    except (UserError, RunFailure):
        raise
    except Exception as e:  # noqa: BLE001  (whatever the user's code raises is theirs to fix)
        name = name_of(fn)
        raise raised_by(e, name, f"{binding} = @{name}", doing) from e


def _code(fn: Any) -> Any:
    fn = inspect.unwrap(getattr(fn, "func", fn))
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        fn = getattr(type(fn), "__call__", None)  # noqa: B004  (the method whose code a call runs)
    return getattr(fn, "__code__", None)


@contextlib.contextmanager
def user_functions(functions: Mapping[str, Any]) -> Iterator[None]:
    """`user_function` for a block that calls several of them (binding -> function) among its own code: names
    the outermost one the exception passed through; any other exception goes on unchanged."""
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
