"""Checks of configured values, each a UserError line naming the gin name, the value and what is allowed:
gin passes whatever a file says, and a wrong type otherwise surfaces deep inside Keras, after writes."""

from __future__ import annotations

from typing import Any, Iterable

from trainer.errors import UserError


def _fail(name: str, value: Any, allowed: str, optional: bool = False) -> None:
    raise UserError(f"{name} must be {allowed}{' or None' if optional else ''}, got {value!r}")


def check_int(
    name: str, value: Any, *, minimum: int | None = 1, maximum: int | None = None, optional: bool = False
) -> None:
    """An int (not a bool) within [minimum, maximum]; None too if `optional`."""
    if optional and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not (ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)):
        if maximum is not None:
            _fail(name, value, f"an integer in {minimum}..{maximum}", optional)
        _fail(name, value, "a positive integer" if minimum == 1 else f"an integer >= {minimum}", optional)


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = 0.0,
    strictly: bool = True,
    below: float | None = None,
    optional: bool = False,
) -> None:
    """A real number (int or float, not a bool) above `minimum` (or at it unless `strictly`), under `below`."""
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and minimum is not None:
        ok = value > minimum if strictly else value >= minimum
    if ok and below is not None:
        ok = value < below
    if not ok:
        bound = "" if minimum is None else (f" > {minimum:g}" if strictly else f" >= {minimum:g}")
        upper = "" if below is None else f" and < {below:g}"
        _fail(name, value, f"a number{bound}{upper}", optional)


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, bool):
        _fail(name, value, "True or False", optional)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if not isinstance(value, type(choices[0])) or value not in choices:
        raise UserError(f"unknown {name} {value!r}: use one of {', '.join(map(repr, choices))}")


def check_callable(name: str, value: Any, *, what: str = "a function", optional: bool = False) -> None:
    if optional and value is None:
        return
    if not callable(value):
        _fail(name, value, what, optional)


def check_ints(name: str, value: Any, *, minimum: int = 1, optional: bool = False, allow_empty: bool = False) -> None:
    if optional and value is None:
        return
    ok = isinstance(value, (tuple, list)) and (allow_empty or len(value) > 0)
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value)
    if not ok:
        _fail(name, value, f"a list of integers >= {minimum}", optional)
