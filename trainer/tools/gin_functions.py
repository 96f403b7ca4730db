"""Gin at the edge, for the functions a run calls: a function bound by reference (`train.step_fn
= @my_step`) is handed to the loop as the plain function with its bindings applied once.

Gin's wrapper looks the bindings up at every call; called inside a traced step, AutoGraph then
converts the wrapper and gin's lookup code into the step, about 1.2 s at every start. This reads
gin's registry and operative config (no public API does), so it lives beside gin_config.py.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import gin


def plain_function(reference: Any, *, positional: int) -> Callable | None:
    """The function a gin reference `@name` (or `@scope/name`, not called) stands for, with the
    bindings gin would give it applied once, instead of gin's wrapper looking them up at every
    call (and AutoGraph converting that wrapper and gin's lookup code into every traced step).

    Gin's semantics are kept: the bindings of the reference's scope and its parents, references
    in them evaluated; a parameter the caller passes wins (the first `positional` parameters are
    passed positionally by the loop, so their bindings are dropped, as gin drops them); the
    values used are logged in the operative config, as gin's wrapper logs them when called.
    None when `reference` is not such a reference to a plain function.
    """
    if not isinstance(reference, gin.config.ConfigurableReference) or reference.evaluate:
        return None
    configurable = reference.configurable
    fn = configurable.wrapped
    if not inspect.isfunction(fn):
        return None
    scope = "/".join(reference.scopes)
    scoped_selector = "/".join([*reference.scopes, configurable.selector])
    params = list(inspect.signature(fn).parameters.values())
    passed = {p.name for p in params[:positional] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
    kwargs = {k: v for k, v in gin.get_bindings(scoped_selector).items() if k not in passed}
    raw = {k: v for k, v in gin.get_bindings(scoped_selector, resolve_references=False).items() if k not in passed}
    denied = set(configurable.denylist or ()) | passed
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty and p.name not in denied
                and (not configurable.allowlist or p.name in configurable.allowlist)}
    with gin.config._OPERATIVE_CONFIG_LOCK:  # noqa: SLF001  (what gin's wrapper records when called)
        gin.config._OPERATIVE_CONFIG.setdefault((scope, configurable.selector), {}).update(defaults | raw)  # noqa: SLF001
    if not kwargs:
        return fn
    resolved = functools.partial(fn, **kwargs)
    resolved.__name__, resolved.__qualname__, resolved.__module__ = fn.__name__, fn.__qualname__, fn.__module__
    return resolved
