"""Entry point: `python -m trainer.main --gin_file=gin/mwms.gin [--gin_bindings=...] [--model_dir=DIR]`.

Exit codes (docs/design.md): 0 done; 2 a user mistake, with one line on stderr; 130 Ctrl-C; 1 anything else.
"""

from __future__ import annotations

import datetime
import os
import sys

from absl import app, flags, logging

from trainer.cli import (  # absl only: importing this module loads no TensorFlow and starts no thread
    INTERRUPTED_EXIT_CODE,
    exit_without_teardown,
    fail,
    import_tensorflow_quietly,
    parse_flags,
    say_interrupted,
)
from trainer.distribution import early_isolation, local_cluster, modes  # no TensorFlow either
from trainer.errors import RunFailure, UserError
from trainer.gin_flags import REPO_ROOT, define_config_flags, missing_arguments_line, parse_gin

FLAGS = flags.FLAGS


def define_flags() -> None:
    """trainer.main's flags, defined by `main` (so that importing this module claims no flag name)."""
    define_config_flags()
    flags.DEFINE_string(
        "model_dir",
        None,
        "Where checkpoints, summaries and metrics.jsonl go (default: a fresh "
        "runs/<time>-<pid> in the working directory, whose path is printed).",
    )
    flags.DEFINE_enum(
        "mode",
        "train",
        list(modes.RUN_MODES),
        " ".join(f"{m.name}: {m.help}." for m in modes.RUN_MODES.values()),
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "--mode=evaluate and --mode=predict: the checkpoint, as ckpt-N, N, or a path (a checkpoint's prefix, or "
        "a directory whose newest is taken); default the newest in --model_dir.",
    )
    flags.DEFINE_list(
        "eval_splits", None, "--mode=evaluate: the splits to evaluate, e.g. test,eval (default: train.eval_splits)."
    )
    flags.DEFINE_list(
        "weights",
        None,
        "--mode=evaluate: which weights, e.g. model,ema: 'model' and the averaged weights of the run's "
        "extensions (ema, swa) (default: every one the run's own eval evaluates). --mode=predict: the one "
        "to predict with (default model).",
    )
    flags.DEFINE_string(
        "output",
        None,
        "--mode=predict: the .npz to write (default: <model_dir>/predictions/<split>-ckpt-N.npz).",
    )
    flags.DEFINE_bool(
        "print_config",
        False,
        "Print the resolved config (every configurable, each value and where it came from: gin "
        "file:line, --gin_bindings or default) and exit without training.",
    )


# The flags that belong to one mode (or a few), refused with any other.
MODE_FLAGS = {
    "checkpoint": ("evaluate", "predict"),
    "eval_splits": ("evaluate",),
    "weights": ("evaluate", "predict"),
    "output": ("predict",),
}


def check_mode_flags() -> modes.RunMode:
    """The --mode asked for, refused with a flag of another mode or without the --model_dir it reads."""
    for name, run_modes in MODE_FLAGS.items():
        if FLAGS[name].present and FLAGS.mode not in run_modes:
            raise UserError(
                f"--{name} is an option of --mode={'|'.join(run_modes)}, not of --mode={FLAGS.mode}; drop it "
                f"or add --mode={run_modes[0]}"
            )
    mode = modes.RUN_MODES[FLAGS.mode]
    if mode.needs_model_dir and not FLAGS.model_dir:
        raise UserError(f"--mode={mode.name} needs --model_dir=DIR, the directory of the run it reads")
    return mode


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
        mode = check_mode_flags()
        parse_gin(FLAGS.gin_file, FLAGS.gin_bindings)
        from trainer import configurables
        from trainer.run.settings import absolute_model_dir
        from trainer.tools import gin_config

        if FLAGS.print_config:
            print(gin_config.describe_config(FLAGS.gin_file, FLAGS.gin_bindings, [REPO_ROOT]), end="", flush=True)
            return

        print_fn = lambda line: print(line, flush=True)  # noqa: E731
        bindings = gin.get_bindings("train", resolve_references=False)
        strategy, resolver = bindings.get("strategy", "default"), bindings.get("cluster_resolver", "tf_config")
        if strategy in modes.MODES:  # another name is refused with the settings, in their words
            modes.require_run_mode(mode.name, strategy)

        def on_the_run_cluster(check, data_workers: int = 0):
            """The run's embedded cluster where it has one, and the tf.data service's servers where
            `data_workers` are asked for; `check()` first: a mistake starts no server."""
            if local_cluster.needs_local_cluster(strategy, resolver) or data_workers:
                check()
            return local_cluster.cluster_for(
                strategy,
                configurables.local_cluster,
                print_fn=print_fn,
                cluster_resolver=resolver,
                data_workers=data_workers,
            )

        if mode.name == "eval_continuous":
            configurables.evaluate_continuously(model_dir=absolute_model_dir(FLAGS.model_dir), print_fn=print_fn)
            return
        if mode.name == "evaluate":
            model_dir = absolute_model_dir(FLAGS.model_dir)
            choices = dict(checkpoint=FLAGS.checkpoint, splits=FLAGS.eval_splits or (), weights=FLAGS.weights or ())
            with on_the_run_cluster(lambda: configurables.check_evaluation(model_dir=model_dir, **choices)):
                configurables.evaluate_checkpoint(model_dir=model_dir, print_fn=print_fn, **choices)
            return
        if mode.name == "predict":  # on this process alone, as the sidecar evaluates
            configurables.predict(
                model_dir=absolute_model_dir(FLAGS.model_dir),
                checkpoint=FLAGS.checkpoint,
                output=FLAGS.output,
                weights=FLAGS.weights or (),
                print_fn=print_fn,
            )
            return
        # Absolute from here on: a relative --model_dir means the same directory to every reader.
        model_dir = absolute_model_dir(FLAGS.model_dir or default_model_dir())
        if not FLAGS.model_dir:
            print(f"model_dir: {model_dir}", flush=True)
        elif FLAGS.model_dir.startswith("~"):  # the shell leaves `~` alone after `=`
            print(f"model_dir: {model_dir} (~ expanded: --model_dir={FLAGS.model_dir})", flush=True)
        with on_the_run_cluster(lambda: configurables.check_settings(model_dir), configurables.local_data_workers()):
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
        if not (line := missing_arguments_line(e)):
            raise
        fail(line)
    except RunFailure as e:
        fail(str(e), exit_code=1)
    except KeyboardInterrupt:  # Ctrl-C while no loop runs; in training it saves (trainer/extensions/preemption.py)
        say_interrupted()
        sys.exit(INTERRUPTED_EXIT_CODE)


def main() -> None:
    """The program. Its first lines run before TensorFlow starts threads: entering the private network
    namespace of an embedded cluster (docs/design.md, rule 12) needs a single-threaded process."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    early_isolation.isolate_early(sys.argv[1:])
    import_tensorflow_quietly()  # so its load-time C++ notices do not come before our first line
    define_flags()
    app.run(exit_without_teardown(run, local_cluster.coordinates_ps_cluster), flags_parser=parse_flags)


if __name__ == "__main__":
    main()
