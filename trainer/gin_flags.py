"""The flags of every entry point that runs a gin config (trainer.main, trainer.parity, the bench)
and their parsing into gin, every gin mistake one UserError line with its file:line."""

from __future__ import annotations

import os
import re
import tokenize

from absl import flags

from trainer.errors import UserError


def define_config_flags() -> None:
    """--gin_file and --gin_bindings; called by an entry point's `main`, so that importing one claims no flag."""
    flags.DEFINE_multi_string("gin_file", [], "Gin config file(s), applied in order.")
    flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings applied after the files, e.g. 'train.total_steps=100'.")


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where gin/ is


_GIN_LOCATION = re.compile(r'In file "([^"]+)", line (\d+)')


def parse_gin(gin_files: list[str], bindings: list[str]) -> None:
    """Parses gin files and bindings; any gin mistake becomes one UserError line with file:line."""
    import gin

    from trainer import configurables  # noqa: F401  (registers the gin names)

    if not gin_files:
        raise UserError("no --gin_file given; pass one of gin/*.gin, e.g. --gin_file=gin/single.gin")
    gin.add_config_file_search_path(REPO_ROOT)
    for path in gin_files:
        if not os.path.isfile(path) and not os.path.isfile(os.path.join(REPO_ROOT, path)):
            raise UserError(f"gin file {path} not found; check the path (configs live in gin/)")
    source = "--gin_bindings"
    try:
        for source in gin_files:
            gin.parse_config_file(source, skip_unknown=False)
        source = "--gin_bindings"
        gin.parse_config(bindings)
    except RecursionError as e:  # an include cycle; gin follows it until Python's stack runs out
        raise UserError(include_cycle_line(e) or gin_error_line(e, source)) from e
    except Exception as e:  # noqa: BLE001  (gin raises whatever its parser or an import raised)
        from trainer.run.settings import retired_binding

        raise UserError(retired_binding(e) or gin_error_line(e, source)) from e


def missing_arguments_line(error: TypeError) -> str | None:
    """The line for gin calling a configurable written `@name()` without the arguments it needs (None for
    any other TypeError)."""
    if "No values supplied by Gin or caller" not in str(error):
        return None
    configurable = re.findall(r"In call to configurable '(\w+)'", str(error))
    name = configurable[0] if configurable else "a configurable"
    return (
        f"gin called {name} with missing arguments ({str(error).splitlines()[0]}): bind them "
        f"({name}.<parameter> = ...), or write @{name} without parentheses where the loop calls it itself"
    )


def include_cycle_line(error: RecursionError) -> str | None:
    """The line naming a cycle of gin includes, read from the `In file "F", line N` that gin adds
    to the error on its way out of each include (innermost first); None if no include repeats."""
    chain: list[tuple[str, str]] = []
    for where in reversed(_GIN_LOCATION.findall(str(error))):  # from the file given, inwards
        if where in chain:
            loop = " -> ".join(f"{path}:{line}" for path, line in chain[chain.index(where) :])
            return (
                f"gin file {where[0]} includes itself ({loop} -> {where[0]}); remove the include that closes the loop"
            )
        chain.append(where)
    return None


def gin_error_line(error: Exception, source: str) -> str:
    """One line for a gin parse error: where (file:line) and what."""
    text = str(error)
    if isinstance(error, SyntaxError) and error.filename:
        where, detail = f"{error.filename}:{error.lineno}", error.msg
    elif isinstance(error, tokenize.TokenError):  # an unclosed bracket: the tokenizer ran off the end
        message, (line, _) = error.args
        where, detail = f"{source}:{line}", f"{message} (an unclosed parenthesis or bracket?)"
    elif match := _GIN_LOCATION.search(text):
        where, detail = f"{match.group(1)}:{match.group(2)}", text
    else:
        where, detail = source, text
    detail = detail.strip().splitlines()[0].rstrip(".") if detail.strip() else type(error).__name__
    return f"bad gin config ({where}): {detail}; fix the gin file or --gin_bindings"
