"""Gin at the edge, for the functions a run calls: a function bound by reference (`train.step_fn
= @my_step`) is handed to the loop as the plain function with its bindings applied once. Gin's
wrapper looks them up at every call, and inside a traced step AutoGraph would convert the wrapper
and gin's lookup code into the step (about 1.2 s at every start).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Collection

import gin

from trainer import internals
from trainer.errors import UserError


def plain_function(reference: Any, *, supplied: Collection[str] = (), what: str = "") -> Callable | None:
    """The function a gin reference `@name` (or `@scope/name`, not called) stands for, with the bindings
    gin would give it (its scope's and parents', logged in the operative config) applied once; None
    for any other reference. The bound parameters leave its signature, so the loop, which passes what
    a function declares (trainer/task/contract.py), leaves them alone. A binding of one of `supplied`
    (what the loop passes itself) is ambiguous: refused in one line naming `what`."""
    if not isinstance(reference, gin.config.ConfigurableReference) or reference.evaluate:
        return None
    configurable = reference.configurable
    fn = configurable.wrapped
    if not inspect.isfunction(fn):
        return None
    scope = "/".join(reference.scopes)
    scoped_selector = "/".join([*reference.scopes, configurable.selector])
    signature = inspect.signature(fn)
    kwargs = gin.get_bindings(scoped_selector)
    raw = gin.get_bindings(scoped_selector, resolve_references=False)
    clash = [k for k in kwargs if k in supplied and k in signature.parameters]
    if clash:
        shown = "/".join([*reference.scopes, configurable.name])
        raise UserError(
            f"gin binds {shown}.{clash[0]}, but {what} {fn.__name__} gets '{clash[0]}' from the "
            f"loop (it passes {', '.join(supplied)}); remove the binding"
        )
    denied = set(configurable.denylist or ()) | set(supplied)
    defaults = {
        p.name: p.default
        for p in signature.parameters.values()
        if p.default is not inspect.Parameter.empty
        and p.name not in denied
        and (not configurable.allowlist or p.name in configurable.allowlist)
    }
    internals.record_operative(scope, configurable.selector, defaults | raw)  # what gin's wrapper records
    attributes = _attributes(configurable.wrapper)  # e.g. a combine rule decorated over gin's wrapper
    if not kwargs and all(getattr(fn, k, None) is v for k, v in attributes.items()):
        return fn
    bound = with_bindings(fn, kwargs, signature)
    for key, value in attributes.items():
        setattr(bound, key, value)
    return bound


def _attributes(fn: Callable) -> dict[str, Any]:
    """The attributes a user set on a function (a `combine` rule), without Python's own."""
    return {k: v for k, v in getattr(fn, "__dict__", {}).items() if not k.startswith("__")}


def with_bindings(fn: Callable, bindings: dict[str, Any], signature: inspect.Signature | None = None) -> Callable:
    """`fn` with `bindings` applied to every call, winning over the caller's; its signature is `fn`'s
    without them, later positional parameters keyword-only (as `functools.partial` shows them)."""
    signature = signature or inspect.signature(fn)
    params, keyword_only = [], False
    for p in signature.parameters.values():
        if p.name in bindings:
            keyword_only = keyword_only or p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            continue
        if keyword_only and p.kind is p.POSITIONAL_OR_KEYWORD:
            p = p.replace(kind=p.KEYWORD_ONLY)
        params.append(p)
    bindings = dict(bindings)

    def bound(*args, **kwargs):
        return fn(*args, **{**kwargs, **bindings})

    bound.__name__, bound.__qualname__, bound.__module__ = fn.__name__, fn.__qualname__, fn.__module__
    bound.__doc__ = fn.__doc__
    bound.__signature__ = signature.replace(parameters=params)
    bound.__dict__.update(_attributes(fn))
    return bound
