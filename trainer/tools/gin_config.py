"""What a parsed gin config says: every configurable with its values and where each came from
(`--print_config`), and the bindings flattened to TensorBoard hparams; no TensorFlow here. Gin
cannot tell where a binding came from, so `binding_sources` re-reads the files with its parser.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Iterable, Iterator

import gin
from gin import config_parser

from trainer import internals

DEFAULT = "default"
FROM_FLAGS = "--gin_bindings"

# Parameters of `train` that trainer.main passes itself; gin never sets them.
SET_BY_MAIN = {
    "train": {
        "model_dir": "--model_dir (default: a fresh runs/<time>)",
        "describe_config": "gin's operative config",
        "hparams": "these bindings, flattened",
        "print_fn": "print",
    },
}


@dataclasses.dataclass(frozen=True)
class Configurable:
    """A registered gin name: `name` is what gin files write (e.g. `train`)."""

    name: str
    selector: str
    target: Any
    denylist: tuple[str, ...] = ()


def registered_configurables() -> list[Configurable]:
    """Every configurable gin knows now (ours and those of modules a gin file imported),
    without gin's own builtins (macro, constant, singleton), in registration order."""
    registry = internals.gin_registry()
    found = []
    for selector, entry in registry.items():
        if entry.module == "gin" or selector.startswith("gin."):
            continue
        found.append(
            Configurable(
                name=registry.minimal_selector(selector),
                selector=selector,
                target=entry.wrapped,
                denylist=tuple(entry.denylist or ()),
            )
        )
    return found


def parameters(configurable: Configurable) -> list[inspect.Parameter]:
    """The parameters a gin file can bind (no *args/**kwargs, none denylisted)."""
    try:
        signature = inspect.signature(configurable.target)
    except (TypeError, ValueError):
        return []
    return [
        p
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in configurable.denylist
    ]


def describe(configurable: Configurable) -> str:
    """`name(param=default, ...)` and the first line of the docstring."""
    params = ", ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={format_value(p.default)}"
        for p in parameters(configurable)
    )
    doc = (inspect.getdoc(configurable.target) or "").splitlines()
    return f"{configurable.name}({params})\n    {doc[0] if doc else '(no docstring)'}"


class _Placeholders(config_parser.ParserDelegate):
    """Parses without resolving references or macros: only the binding keys are wanted."""

    def configurable_reference(self, scoped_name, evaluate):
        return None

    def macro(self, macro_name):
        return None


def _statements(text_or_file) -> Iterator[Any]:
    yield from config_parser.ConfigParser(text_or_file, _Placeholders())


def _resolve(path: str, search_paths: Iterable[str]) -> str:
    if os.path.isabs(path):
        return path
    for prefix in ["", *search_paths]:
        candidate = os.path.join(prefix, path)
        if os.path.isfile(candidate):
            return candidate
    return path


def _shown_path(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def binding_sources(
    gin_files: Iterable[str], bindings: Iterable[str], search_paths: Iterable[str] = ()
) -> dict[tuple[str, str, str], str]:
    """(scope, complete selector, param; '' for a macro) -> 'file:line' or '--gin_bindings', the last
    binding of each key winning, as in gin (files in order, includes where they stand, then bindings)."""
    search_paths = list(search_paths)
    sources: dict[tuple[str, str, str], str] = {}

    def record(statement, where: str) -> None:
        selector = statement.selector
        if statement.arg_name:
            match = internals.gin_registry().get_match(selector)
            selector = match.selector if match is not None else selector
        sources[(statement.scope or "", selector, statement.arg_name)] = where

    def walk(statements, where) -> None:
        for statement in statements:
            if isinstance(statement, config_parser.BindingStatement):
                record(statement, where(statement))
            elif isinstance(statement, config_parser.IncludeStatement):
                include(statement.filename)

    def include(path: str) -> None:
        resolved = _resolve(path, search_paths)
        with open(resolved) as f:
            walk(_statements(f), lambda statement: f"{_shown_path(resolved)}:{statement.location.line_num}")

    for path in gin_files:
        include(path)
    text = "\n".join(bindings)
    if text.strip():
        walk(_statements(text), lambda _: FROM_FLAGS)
    return sources


def format_value(value: Any) -> str:
    """A value as a gin file would write it: `@cnn` for a registered function or class."""
    if isinstance(value, (list, tuple)):
        inner = ", ".join(format_value(v) for v in value)
        if isinstance(value, tuple):
            return f"({inner}{',' if len(value) == 1 else ''})"
        return f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{format_value(k)}: {format_value(v)}" for k, v in value.items()) + "}"
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
        for configurable in registered_configurables():
            if configurable.target is value:
                return f"@{configurable.name}"
        return f"{getattr(value, '__module__', '') or ''}.{getattr(value, '__qualname__', repr(value))}".lstrip(".")
    return repr(value)  # gin's ConfigurableReference repr is `@name` / `@name()` / `%MACRO`


def _key(scope: str, name: str, param: str) -> str:
    return f"{scope + '/' if scope else ''}{name}.{param}"


def _query(scope: str, selector: str, param: str) -> Any:
    return gin.query_parameter(_key(scope, selector, param))


def _referenced_selectors(value: Any) -> Iterator[str]:
    if isinstance(value, gin.config.ConfigurableReference):
        yield value.configurable.selector
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _referenced_selectors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _referenced_selectors(v)


def _macro_value(value: Any) -> Any:
    """The value of a `%MACRO` reference (gin binds macros as `NAME/gin.macro.value`)."""
    if isinstance(value, gin.config.ConfigurableReference) and value.configurable.selector == "gin.macro":
        try:
            return _macro_value(gin.query_parameter(f"{'/'.join(value.scopes)}/gin.macro.value"))
        except ValueError:
            return value
    return value


def describe_config(gin_files: list[str], bindings: list[str], search_paths: Iterable[str] = ()) -> str:
    """Every configurable's parameters as `name.param = value  # source` (file:line, --gin_bindings or
    default); configurables the config binds or refers to first, scoped bindings after their own."""
    sources = binding_sources(gin_files, bindings, search_paths)
    configurables = registered_configurables()
    by_selector = {c.selector: c for c in configurables}
    bound_values = {key: _query(*key) for key in sources if key[2] and key[1] in by_selector}
    used = {selector for _, selector, _ in bound_values}
    for value in bound_values.values():
        used.update(_referenced_selectors(value))

    lines: list[tuple[str, str]] = []  # (binding text, comment)
    header = [
        f"# Resolved config of {', '.join(gin_files)}"
        + (f" with {len(list(bindings))} --gin_bindings" if bindings else "")
        + "; after each value, where it came from."
    ]

    def emit(configurable: Configurable) -> None:
        doc = (inspect.getdoc(configurable.target) or "").splitlines()
        lines.extend([("", ""), (f"# {configurable.name}: {doc[0] if doc else ''}".rstrip(": "), "")])
        set_by_main = SET_BY_MAIN.get(configurable.name, {})
        defaults = {p.name: p.default for p in parameters(configurable)}
        bound = {param for scope, sel, param in bound_values if sel == configurable.selector and not scope}
        for param in [*defaults, *sorted(bound - set(defaults))]:
            key = ("", configurable.selector, param)
            text = _key("", configurable.name, param)
            if key in bound_values:
                lines.append((f"{text} = {format_value(bound_values[key])}", sources[key]))
            elif param in set_by_main:
                lines.append((f"{text} = <{set_by_main[param]}>", "set by trainer.main"))
            elif defaults.get(param, inspect.Parameter.empty) is inspect.Parameter.empty:
                lines.append((f"{text} = <from the caller>", "no default"))
            else:
                lines.append((f"{text} = {format_value(defaults[param])}", DEFAULT))
        for key, value in bound_values.items():
            if key[0] and key[1] == configurable.selector:
                lines.append((f"{_key(key[0], configurable.name, key[2])} = {format_value(value)}", sources[key]))

    macros = [(key, src) for key, src in sources.items() if not key[2]]
    if macros:
        lines.extend([("", ""), ("# macros", "")])
        for (scope, name, _), where in macros:
            value = gin.query_parameter(f"{scope + '/' if scope else ''}{name}/gin.macro.value")
            lines.append((f"{name} = {format_value(value)}", where))
    first = [c for c in configurables if c.selector in used]
    rest = [c for c in configurables if c.selector not in used]
    for configurable in first:
        emit(configurable)
    if rest:
        lines.extend([("", ""), ("# ----- not bound or referenced by this config: at their defaults -----", "")])
        for configurable in rest:
            emit(configurable)

    width = min(max((len(text) for text, comment in lines if comment), default=0), 58)
    out = header + [f"{text.ljust(width)}  # {comment}" if comment else text for text, comment in lines]
    return "\n".join(out) + "\n"


def hparams(gin_files: list[str], bindings: list[str], search_paths: Iterable[str] = ()) -> dict[str, Any]:
    """Every bound parameter as a scalar hparam named like its binding ({'train.model_fn': '@cnn', ...}):
    references, lists and None as their gin text, macros resolved."""
    flat: dict[str, Any] = {"gin_files": ",".join(gin_files)}
    for scope, selector, param in binding_sources(gin_files, bindings, search_paths):
        if not param:
            continue
        match = internals.gin_registry().get_match(selector)
        name = internals.gin_registry().minimal_selector(match.selector) if match is not None else selector
        value = _macro_value(_query(scope, selector, param))
        if not isinstance(value, (bool, int, float, str)):
            value = format_value(value)
        flat[_key(scope, name, param)] = value
    return dict(sorted(flat.items()))
