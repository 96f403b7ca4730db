"""How the loop hands its values to a function it calls: by name, else by position.

A function gets each value through the parameter of that name; failing that (only for the values passed
positionally), through the parameter at that value's position. Parameters a gin binding fills are hidden
from the signature, so an eval step `(model, batch, training=False)` with `training` bound keeps it where a
positional call would have put `metrics` into it. A parameter without a default that nothing fills is one
UserError line. `adapt` returns the function itself where a positional call already does exactly this
(nothing is added to a traced step in the common case), else a small function that calls it by keyword.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

from trainer.errors import UserError

DENOMINATOR = "/denominator"
"""An eval step's output `x` + DENOMINATOR is the sum the loop divides the sum `x` by, instead of
`num_examples`: a weighted mean, such as the weighted accuracy sum(w * correct) / sum(w)."""

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@dataclasses.dataclass(frozen=True)
class Contract:
    """What the loop passes a function: `positional` (by name, else by position), then `by_name`
    (only to a parameter of that name)."""

    what: str
    positional: tuple[str, ...]
    by_name: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.positional, *self.by_name)


STEP = Contract("train.step_fn", ("model", "optimizer", "batch", "global_batch_size"))
EVAL_STEP = Contract("train.eval_step_fn", ("model", "batch"), ("metrics",))
INPUT = Contract("train.input_fn", ("split",), ("input_context",))


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an object without one: called as it is
        return None


def function_name(fn: Callable) -> str:
    """A function's `__name__` (a callable object's class name): how refusals name a bound function."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def targets(fn: Callable, contract: Contract) -> dict[str, str] | None:
    """`{contract name: parameter of fn that receives it}` (None: no signature); UserError for a parameter
    without a default that neither the loop nor a binding fills."""
    signature = _signature(fn)
    if signature is None:
        return None
    params = signature.parameters
    positional = [p.name for p in params.values() if p.kind in _POSITIONAL]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    found: dict[str, str] = {}
    for index, name in enumerate(contract.positional):
        if name in params and params[name].kind not in _VARIADIC:
            found[name] = name
        elif index < len(positional) and positional[index] not in contract.names:
            found[name] = positional[index]
        elif takes_any:
            found[name] = name
    for name in contract.by_name:
        if (name in params and params[name].kind not in _VARIADIC) or takes_any:
            found[name] = name
    filled = set(found.values())
    for p in params.values():
        if p.name not in filled and p.default is inspect.Parameter.empty and p.kind not in _VARIADIC:
            raise UserError(
                f"{contract.what} {function_name(fn)} has parameter '{p.name}', which the loop does not fill "
                f"(it passes {', '.join(contract.names)} by name, the first {len(contract.positional)} else by "
                "position); "
                f"give '{p.name}' a default or bind it in gin ({function_name(fn)}.{p.name} = ...)"
            )
    return found


def takes(fn: Callable, name: str, contract: Contract) -> bool:
    found = targets(fn, contract)
    return found is not None and name in found


def adapt(fn: Callable, contract: Contract) -> Callable:
    """`fn` as a function of the contract's positional values, then the `by_name` ones it takes."""
    found = targets(fn, contract)
    if found is None:
        return fn
    signature = _signature(fn)
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()) and not any(
        n in params for n in contract.positional
    ):
        return fn  # `(*args, ...)` naming none of the values: it takes them by position, as it says
    order = [*contract.positional, *(n for n in contract.by_name if n in found)]
    positional = [p.name for p in params.values() if p.kind in _POSITIONAL]
    if all(found.get(name) == (positional[i] if i < len(positional) else None) for i, name in enumerate(order)):
        return fn  # a positional call already passes each value where it belongs
    only_positional = [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    by_position = [name for name in order if found.get(name) in only_positional]
    keywords = {name: found[name] for name in order if name in found and name not in by_position}
    if [found[n] for n in by_position] != only_positional[: len(by_position)]:
        raise UserError(
            f"{contract.what} {function_name(fn)} takes positional-only parameters "
            f"{only_positional} that the loop cannot fill by name; make them ordinary parameters"
        )

    def adapted(*values, **named):
        given = dict(zip(order, values)) | named
        return fn(
            *(given[n] for n in by_position), **{target: given[n] for n, target in keywords.items() if n in given}
        )

    adapted.__name__ = function_name(fn)
    adapted.__qualname__ = getattr(fn, "__qualname__", adapted.__name__)
    adapted.__module__ = getattr(fn, "__module__", __name__)
    adapted.__doc__ = getattr(fn, "__doc__", None)
    adapted.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in order]
    )
    for key, value in getattr(fn, "__dict__", {}).items():  # attributes of an input function, a combine rule
        if key not in ("__wrapped__", "__signature__") and not hasattr(adapted, key):
            setattr(adapted, key, value)
    return adapted
