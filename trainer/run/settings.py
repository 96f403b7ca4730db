"""`Settings`: everything a run is configured with, as one frozen object checked where it is made.

`train`'s keyword parameters are exactly these fields (gin: `train.<field>`); every entry point
that builds what a run builds takes a `Settings` too. The core's values are checked here, an
optional feature's options by its extension, each in one UserError line before anything is written.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import os
import re
from typing import Any, Callable, Mapping, Sequence

from trainer import data
from trainer.data import device as device_data
from trainer.data import service
from trainer.distribution import cluster, devices, modes
from trainer.errors import UserError
from trainer.extensions.protocol import Extension
from trainer.loops.options import DISTRIBUTE_METHODS, ParameterServerConfig
from trainer.task import contract, models, optimizers, precision, steps
from trainer.validation import check_bool, check_callable, check_choice, check_int, check_number

ASYNC_REASON = "asynchronous closures on remote workers"
# Options of the core (not extensions) that work under some strategies only.
CAPABILITIES = (("train.jit_compile", modes.SYNCHRONOUS), ("train.async_checkpoint", modes.SYNCHRONOUS))
# Parameters `train` had, each with what replaces it.
RETIRED = {"hooks": "hooks and extensions are one type now; bind train.extensions = [@my_extension()]"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """A run's configuration (gin: `train.<field>`).

    Length: total_steps, global_batch_size (the examples behind one update), steps_per_loop (steps
    per compiled call), seed; intervals: log_/checkpoint_/eval_every_steps, keep_checkpoints.
    Trained: model_fn, optimizer_fn (trainer/task/task.py), step_fn, eval_step_fn, eval_metrics_fn
    (trainer/task/steps.py), input_fn (older name `data_source`; default the embedded digits) and
    eval_splits (default: the input's `splits` but 'train', else ('eval',)). Where: strategy,
    device_config, cluster_resolver(_options), collective_timeout_secs, distribute_method,
    shard_policy, parameter_server, data_service (the tf.data service: 'local', 'grpc://host:port' or
    @data_service(), trainer/data/service.py), device_data_max_bytes (a train split with random access
    up to this size is held on every replica's device and gathered inside the compiled loop,
    trainer/data/device.py; 0: always tf.data), sequences (how examples of any length are padded and
    bucketed: @sequences(), trainer/data/sequences.py). Speed: jit_compile, mixed_precision, async_checkpoint. Safety:
    check_loss_scaling, nonfinite, max_rollbacks, loss_upper_bound, allow_resume_changes, max_time_secs.
    The optional features are extensions (trainer/extensions/built_in.py), beside your own
    `extensions`. Set by the entry point: model_dir, describe_config, hparams (the flat bindings), print_fn.
    """

    model_dir: str | None = None
    total_steps: int = 1000
    global_batch_size: int = 64
    steps_per_loop: int = 50
    log_every_steps: int = 100
    checkpoint_every_steps: int = 500
    eval_every_steps: int = 500
    seed: int = 0
    step_fn: Callable = steps.classification_step
    eval_step_fn: Callable = steps.classification_eval_step
    eval_metrics_fn: Callable[[], Mapping[str, Any]] | None = None
    check_loss_scaling: bool = True
    jit_compile: bool = False
    mixed_precision: str | None = None
    model_fn: Callable = models.cnn
    input_fn: Callable | None = None
    data_source: Callable | None = None
    eval_splits: Sequence[str] | None = None
    optimizer_fn: Callable = optimizers.make_optimizer
    strategy: str = "default"
    device_config: devices.DeviceConfig | None = None
    cluster_resolver: str = "tf_config"
    cluster_resolver_options: dict | None = None
    collective_timeout_secs: float | None = None
    distribute_method: str = "dataset"
    shard_policy: str = "AUTO"
    parameter_server: ParameterServerConfig | None = None
    data_service: str | service.DataServiceConfig | None = None
    device_data_max_bytes: int = device_data.DEFAULT_MAX_BYTES  # per device; 0: the train split through tf.data
    sequences: data.SequenceBatching | None = None  # examples of any length: padding values, bucketing
    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    nonfinite: str = "stop"
    max_rollbacks: int = 3
    loss_upper_bound: float | None = None
    max_time_secs: float | None = None
    allow_resume_changes: bool = False
    preemption_checkpointing: bool | None = None  # None: SIGTERM saves as Ctrl-C does, on one process
    grad_accum_steps: int = 1
    clip_global_norm: float | None = None
    ema_decay: float | None = None
    export_saved_model: bool = False
    warm_start: str | Mapping[str, str] | None = None  # a path, or {model key: path} for models of a dict
    keep_best: int = 0
    best_metric: str = "loss"
    best_mode: str = "min"
    early_stopping: Any = None  # trainer.extensions.early_stopping.EarlyStoppingOptions
    keras_callbacks: Sequence[Any] = ()
    train_metrics_reset: str | None = "log"  # Keras metrics the step updates: reset each 'log' interval or 'epoch'
    train_metrics_fn: Callable[[], Mapping[str, Any]] | None = None  # more of them, made under the scope
    extensions: Sequence[Extension] = ()
    describe_config: Callable[[], str] | None = None
    hparams: Mapping[str, bool | int | float | str] | None = None
    print_fn: Callable[[str], None] = print

    def __post_init__(self) -> None:
        for name in ("step_fn", "eval_step_fn", "model_fn", "optimizer_fn", "eval_metrics_fn", "train_metrics_fn"):
            check_callable(
                f"train.{name}",
                getattr(self, name),
                what="a function (bind it as @name, without parentheses)",
                optional=name in ("eval_metrics_fn", "train_metrics_fn"),
            )
        for name, rule in (("step_fn", contract.STEP), ("eval_step_fn", contract.EVAL_STEP)):
            object.__setattr__(self, name, contract.adapt(getattr(self, name), rule))  # by name, else position
        if not isinstance(self.extensions, (list, tuple)) or not all(isinstance(e, Extension) for e in self.extensions):
            raise UserError(
                "train.extensions must be a list of extensions (instances of trainer.extensions.Extension, bound as "
                f"@my_extension()), got {self.extensions!r}"
            )
        for name in ("extensions", "keras_callbacks"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.parameter_server is not None and not isinstance(self.parameter_server, ParameterServerConfig):
            raise UserError(f"train.parameter_server must be @parameter_server(), got {self.parameter_server!r}")
        object.__setattr__(self, "data_service", service.config_of(self.data_service))
        self._check_sequences()
        if self.data_service is not None:
            modes.require("train.data_service", service.SUPPORT, self.strategy)
        if self.model_dir is not None and not isinstance(self.model_dir, str):
            raise UserError(f"model_dir must be a path, got {self.model_dir!r}")
        if self.model_dir:
            object.__setattr__(self, "model_dir", absolute_model_dir(self.model_dir))
        for name in ("log_every_steps", "checkpoint_every_steps", "eval_every_steps", "keep_checkpoints"):
            check_int(f"train.{name}", getattr(self, name))
        for name in ("allow_resume_changes", "async_checkpoint"):
            check_bool(f"train.{name}", getattr(self, name))
        check_callable("train.describe_config", self.describe_config, optional=True)
        check_callable("train.print_fn", self.print_fn)
        if self.hparams is not None and not isinstance(self.hparams, Mapping):
            raise UserError(f"train.hparams must be a dict of names to values, got {self.hparams!r}")
        self._check_loop()
        self._check_runtime()
        _ = self.eval_split_names  # checked when made
        for setting, needs in CAPABILITIES:
            if getattr(self, setting.removeprefix("train.")):
                modes.require(setting, needs, self.strategy, reason=ASYNC_REASON)

    def _check_loop(self) -> None:
        """What the train loops read (trainer/loops/build.py)."""
        for name in ("total_steps", "global_batch_size", "steps_per_loop"):
            check_int(f"train.{name}", getattr(self, name))
        check_int("train.seed", self.seed, minimum=0)
        check_choice("train.distribute_method", self.distribute_method, DISTRIBUTE_METHODS)
        if not isinstance(self.shard_policy, str) or self.shard_policy.upper() not in data.SHARD_POLICIES:
            raise UserError(
                f"unknown train.shard_policy {self.shard_policy!r}: use one of {', '.join(data.SHARD_POLICIES)}"
            )
        check_bool("train.jit_compile", self.jit_compile)
        check_int("train.device_data_max_bytes", self.device_data_max_bytes, minimum=0)

    def _check_sequences(self) -> None:
        if self.sequences is not None and not isinstance(self.sequences, data.SequenceBatching):
            raise UserError(f"train.sequences must be @sequences(), got {self.sequences!r}")
        if self.sequences is not None and self.sequences.bucketing and self.data_service is not None:
            raise UserError(
                "sequences.bucket_window buckets the train order by index, and train.data_service hands out its "
                "own stream: set sequences.bucket_window = 0 (batches padded to their longest), or leave "
                "train.data_service unset"
            )

    def _check_runtime(self) -> None:
        """Where and how the run computes (trainer/distribution/runtime.py)."""
        modes.get(self.strategy)  # an unknown name is one line
        check_choice("train.cluster_resolver", self.cluster_resolver, cluster.RESOLVER_KINDS)
        if self.device_config is not None and not isinstance(self.device_config, devices.DeviceConfig):
            raise UserError(f"train.device_config must be @devices(), got {self.device_config!r}")
        if self.cluster_resolver_options is not None and not isinstance(self.cluster_resolver_options, Mapping):
            raise UserError(f"train.cluster_resolver_options must be a dict, got {self.cluster_resolver_options!r}")
        check_number("train.collective_timeout_secs", self.collective_timeout_secs, optional=True)
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, str):
            raise UserError(f"train.mixed_precision must be a policy name or None, got {self.mixed_precision!r}")
        precision.check(self.mixed_precision)

    @property
    def mode(self) -> modes.Mode:
        return modes.get(self.strategy)

    @functools.cached_property
    def input_function(self) -> Callable:
        """`train.input_fn` (or its older name `train.data_source`); the embedded digits by default."""
        if self.input_fn is not None and self.data_source is not None:
            raise UserError("both train.input_fn and train.data_source are set; they are the same thing: keep one")
        fn = self.input_fn if self.input_fn is not None else self.data_source
        fn = fn if fn is not None else data.Digits()
        if not callable(fn):
            raise UserError(f"train.input_fn must be a function fn(split) -> tf.data.Dataset, got {fn!r}")
        return contract.adapt(fn, contract.INPUT)

    @property
    def input_named(self) -> str:
        """The input as the user's config names it, for messages (the default is bound by no gin name)."""
        if self.input_fn is None and self.data_source is None:
            return "the default input (the embedded digits: train.input_fn is unset)"
        fn = self.input_fn if self.input_fn is not None else self.data_source
        fn = getattr(fn, "func", fn)  # functools.partial
        name = getattr(fn, "__name__", None)
        return f"train.input_fn = @{name}" if name else f"train.input_fn = @{type(fn).__name__}()"

    @functools.cached_property
    def eval_split_names(self) -> tuple[str, ...]:
        """The splits evaluated, in order (see the class docstring)."""
        if self.eval_splits is None:
            splits = getattr(self.input_function, "splits", ("train", "eval"))
            return tuple(s for s in splits if s != "train") or ("eval",)
        if (
            isinstance(self.eval_splits, str)
            or not self.eval_splits
            or not all(isinstance(s, str) for s in self.eval_splits)
        ):
            raise UserError(f"train.eval_splits must be a non-empty list of split names, got {self.eval_splits!r}")
        counts = collections.Counter(self.eval_splits)  # linear: a list of thousands of names is checked at once
        if twice := [name for name, count in counts.items() if count > 1]:
            shown = ", ".join(repr(name) for name in twice[:5]) + (
                f" and {len(twice) - 5} other names" if len(twice) > 5 else ""
            )
            raise UserError(
                f"train.eval_splits names {shown} more than once; each split is evaluated once and its results "
                "logged under its name: list each once"
            )
        return tuple(self.eval_splits)

    def make_input(self) -> data.Input:
        """The run's input (a fresh `data.Input`: it caches counts and in-memory data)."""
        return data.as_input(self.input_function, eval_splits=self.eval_split_names, sequences=self.sequences)

    @classmethod
    def of(cls, bindings: Mapping[str, Any]) -> "Settings":
        """Settings from `train.*` bindings (names of fields), refusing a name that is none."""
        unknown = sorted(set(bindings) - {f.name for f in dataclasses.fields(cls)})
        if retired := [name for name in unknown if name in RETIRED]:
            raise UserError(retired_line(retired[0]))
        if unknown:
            raise UserError(f"train has no parameter {unknown[0]!r}; see `python -m trainer.configurables`")
        return cls(**bindings)


def retired_line(name: str) -> str:
    return f"train.{name} is gone: {RETIRED[name]}"


def retired_binding(gin_error: Exception) -> str | None:
    """The line for a gin binding of a parameter `train` no longer has (None for any other error)."""
    found = re.search(r"'train' doesn't have a parameter named '(\w+)'", str(gin_error))
    return retired_line(found.group(1)) if found and found.group(1) in RETIRED else None


def absolute_model_dir(model_dir: str) -> str:
    """`model_dir` as an absolute path (a URL as it is), resolved once where a run is configured, so
    every reader and writer sees the same directory. A leading `~` is the user's home, as the shell would
    have made it had it not followed `=` (`--model_dir=~/run`), not a directory named `~`."""
    return model_dir if "://" in model_dir else os.path.abspath(os.path.expanduser(model_dir))


def signature() -> inspect.Signature:
    """`train`'s signature: Settings' fields as keyword-only parameters (gin refuses other names)."""
    return inspect.Signature(
        [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in dataclasses.fields(Settings)
        ]
    )
