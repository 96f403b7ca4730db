"""Entry point: `python -m trainer.main --gin_file=gin/mwms.gin [--gin_bindings=...] [--model_dir=DIR]`.

Exit codes (docs/design.md): 0 done; 2 a user mistake, with one line on stderr; 130 Ctrl-C; 1 anything else.
"""

from __future__ import annotations

import datetime
import os
import re
import tokenize

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

from trainer.distribution import early_isolation  # noqa: E402  (no TensorFlow: nothing runs threads yet)

early_isolation.isolate_early(sys.argv[1:])  # an embedded cluster's private network (docs/design.md, rule 12)

from trainer import quiet_start  # noqa: E402
from trainer.cli import (  # noqa: E402  (absl only)
    INTERRUPTED_EXIT_CODE,
    exit_without_teardown,
    fail,
    flush_and_exit,
    parse_flags,
    say_interrupted,
)

try:
    quiet_start.import_tensorflow()  # so its load-time C++ notices do not come before our first line
except KeyboardInterrupt:  # Ctrl-C in the seconds it takes
    say_interrupted()
    flush_and_exit(INTERRUPTED_EXIT_CODE)

from absl import app, flags, logging  # noqa: E402

from trainer.distribution import local_cluster  # noqa: E402
from trainer.errors import RunFailure, UserError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "Gin config file(s), applied in order.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings applied after the files, e.g. 'train.total_steps=100'.")
flags.DEFINE_string(
    "model_dir",
    None,
    "Where checkpoints, summaries and metrics.jsonl go (default: a fresh "
    "runs/<time>-<pid> in the working directory, whose path is printed).",
)
flags.DEFINE_enum(
    "mode",
    "train",
    ["train", "eval_continuous"],
    "train: train and evaluate inline. eval_continuous: a sidecar evaluator that evaluates every new "
    "checkpoint in --model_dir as it appears, until the one at train.total_steps.",
)
flags.DEFINE_bool(
    "print_config",
    False,
    "Print the resolved config (every configurable, each value and where it came from: gin "
    "file:line, --gin_bindings or default) and exit without training.",
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def default_model_dir() -> str:
    """`runs/<time>-<pid>` in the working directory (the pid tells apart runs started the same second)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{os.getpid()}")


def run(argv: list[str]) -> None:
    del argv
    import gin

    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # TensorFlow's INFO lines would drown the progress

    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_bindings)
        from trainer import configurables
        from trainer.run.settings import absolute_model_dir
        from trainer.tools import gin_config

        if FLAGS.print_config:
            print(gin_config.describe_config(FLAGS.gin_file, FLAGS.gin_bindings, [REPO_ROOT]), end="", flush=True)
            return

        print_fn = lambda line: print(line, flush=True)  # noqa: E731
        if FLAGS.mode == "eval_continuous":
            if not FLAGS.model_dir:
                raise UserError("--mode=eval_continuous needs --model_dir=DIR, the directory of the run to evaluate")
            configurables.evaluate_continuously(model_dir=absolute_model_dir(FLAGS.model_dir), print_fn=print_fn)
            return
        # Absolute from here on: a relative --model_dir means the same directory to every reader.
        model_dir = absolute_model_dir(FLAGS.model_dir or default_model_dir())
        if not FLAGS.model_dir:
            print(f"model_dir: {model_dir}", flush=True)
        bindings = gin.get_bindings("train", resolve_references=False)
        strategy, resolver = bindings.get("strategy", "default"), bindings.get("cluster_resolver", "tf_config")
        if local_cluster.needs_local_cluster(strategy, resolver):
            configurables.check_settings(model_dir)  # a mistake in the settings starts no server
        with local_cluster.cluster_for(
            strategy, configurables.local_cluster, print_fn=print_fn, cluster_resolver=resolver
        ):
            configurables.train(
                model_dir=model_dir,
                describe_config=gin.operative_config_str,
                hparams=gin_config.hparams(FLAGS.gin_file, FLAGS.gin_bindings, [REPO_ROOT]),
                print_fn=print_fn,
            )
    except UserError as e:
        print(e.details, end="", file=sys.stderr)  # the user's own frames, where their code raised
        fail(str(e))
    except TypeError as e:  # gin calling `@name()` without the arguments it needs
        if "No values supplied by Gin or caller" not in str(e):
            raise
        configurable = re.findall(r"In call to configurable '(\w+)'", str(e))
        name = configurable[0] if configurable else "a configurable"
        fail(
            f"gin called {name} with missing arguments ({str(e).splitlines()[0]}): bind them "
            f"({name}.<parameter> = ...), or write @{name} without parentheses where the loop calls it itself"
        )
    except RunFailure as e:
        fail(str(e), exit_code=1)
    except KeyboardInterrupt:  # Ctrl-C while no loop runs; in training it saves (trainer/extensions/preemption.py)
        say_interrupted()
        sys.exit(INTERRUPTED_EXIT_CODE)


def main() -> None:
    app.run(exit_without_teardown(run, local_cluster.coordinates_ps_cluster), flags_parser=parse_flags)


if __name__ == "__main__":
    main()
