"""The extension protocol's one place of decisions (trainer/extensions/registry.py), driven with small
in-process fakes: capability refusals in one wording, the order of stages, the checks on `after`,
names and state, named values; and the capability table in the docs made from the declarations."""

from __future__ import annotations

import os
import re

import keras
import pytest

from tests.support import REPO
from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions import built_in, capabilities
from trainer.extensions.context import Context, Contributions
from trainer.extensions.early_stopping import EarlyStoppingOptions
from trainer.extensions.protocol import Extension
from trainer.extensions.registry import Registry
from trainer.run.settings import Settings
from trainer.tools import gin_config

PS = Settings(strategy="parameter_server")


class Recorder(Extension):
    """Records the stages it is taken through."""

    def __init__(self, name: str, log: list, *, after=(), state=None, supports=modes.ALL):
        self.name, self.after, self._state, self.supports, self._log = name, tuple(after), state, supports, log

    def check(self, settings):
        self._log.append(("check", self.name))

    def attach(self, context):
        self._log.append(("attach", self.name))

    def state_dict(self):
        return self._state


class Plain(Extension):
    name = "plain"


def names(extensions) -> list[str]:
    return [getattr(e, "name", "") or type(e).__name__ for e in extensions]


def test_every_built_in_refused_under_parameter_server_says_so_in_one_wording():
    refused = [(setting, support) for setting, support in capabilities.rows() if "parameter_server" not in support]
    assert {s for s, _ in refused} >= {
        "train.ema_decay",
        "train.export_saved_model",
        "train.warm_start",
        "train.keras_callbacks",
        "train.jit_compile",
        "train.async_checkpoint",
    }
    wording = re.compile(
        r"^(\S.*) is not supported with parameter_server \((.+)\); it works with the synchronous "
        r"strategies: (.+)$"
    )
    on = dict(
        ema_decay=0.9,
        export_saved_model=True,
        keras_callbacks=[keras.callbacks.TerminateOnNaN()],
        nonfinite="rollback",
        grad_accum_steps=2,
        clip_global_norm=1.0,
    )  # warm_start: tests/test_warm_start.py
    for key, value in on.items():
        settings = Settings(strategy="parameter_server", **{key: value})
        with pytest.raises(UserError) as refusal:
            Registry(built_in.participants(settings), settings)
        assert wording.match(str(refusal.value)), str(refusal.value)
    for key in ("jit_compile", "async_checkpoint"):
        with pytest.raises(UserError, match=wording.pattern.replace("^(\\S.*)", f"^train.{key}")):
            Settings(strategy="parameter_server", **{key: True})
    # A user's extension declaring no support there is refused the same way, naming how it was turned on.
    with pytest.raises(UserError, match=r"^swa \(train.extensions\) is not supported with parameter_server"):
        Registry([Recorder("swa", [], supports=modes.SYNCHRONOUS)], PS)
    Registry(built_in.participants(Settings(strategy="parameter_server", keep_best=2)), PS)  # supported: no error


def test_stages_follow_after_and_the_checkpoint_runs_after_every_extension_with_state():
    log = []
    *first, checkpoint = built_in.participants(Settings())
    participants = [
        *first,
        Recorder("b", log, after=("a",)),
        Recorder("a", log),
        Plain(),
        Recorder("kept", log, state={"n": 0}),
        checkpoint,
    ]
    registry = Registry(participants, Settings())
    order = names(registry.extensions)
    assert order.index("a") < order.index("b")
    assert order.index("kept") < order.index("checkpoint") and order.index("plain") < order.index("checkpoint")
    # the claim first, the data position's guarantee, then what others read, as given (the train metrics' results:
    # read by progress)
    assert order[:5] == ["model_dir_claim", "data_position", "train_metrics", "progress", "eval"]
    assert order[-2:] == ["checkpoint", "preemption"]  # Ctrl-C's save, in every run, after the periodic one
    registry.check()
    assert [n for stage, n in log if stage == "check"] == [n for n in order if n in ("a", "b", "kept")]


def test_after_must_name_something_known_and_not_loop():
    with pytest.raises(UserError, match=r"runs after 'evall', which is neither"):
        Registry([Recorder("x", [], after=("evall",))], Settings())
    Registry([Recorder("x", [], after=("warm_start",))], Settings())  # a built-in that is off constrains nothing
    with pytest.raises(UserError, match="form a cycle"):
        Registry([Recorder("x", [], after=("y",)), Recorder("y", [], after=("x",))], Settings())
    with pytest.raises(UserError, match="two extensions of this run are named 'x'"):
        Registry([Recorder("x", []), Recorder("x", [])], Settings())


def test_state_cannot_be_ordered_after_the_checkpoint():
    participants = [*built_in.participants(Settings()), Recorder("late", [], after=("checkpoint",), state={})]
    with pytest.raises(UserError, match="late keeps state of its own, so it must run before the checkpoint"):
        Registry(participants, Settings())


def test_a_named_value_has_one_provider_and_contributions_end_with_the_build():
    contributions = Contributions()
    context = Context(Settings(), None, None, contributions)
    contributions.owner = "ema"
    context.provide("export_weights", 1)
    contributions.owner = "swa"
    assert context.values["export_weights"] == 1 and "missing" not in context.values
    with pytest.raises(UserError, match="ema and swa both provide 'export_weights'"):
        context.provide("export_weights", 2)
    context.saver = "made"  # train, after every `attach`: the checkpoint holds its items now
    with pytest.raises(UserError, match=r"context.add_checkpoint_item works in an extension's attach only"):
        context.add_checkpoint_item("late", object())
    contributions.owner = None  # the registry, after every `restored`
    with pytest.raises(UserError, match=r"context.wrap_step works in an extension's attach or restored only"):
        context.wrap_step(lambda step_fn: step_fn)


def test_train_hooks_is_refused_naming_train_extensions():
    from trainer.run.train import train

    with pytest.raises(UserError, match=r"^train.hooks is gone: .*bind train.extensions = \[@my_extension\(\)\]$"):
        train(hooks=[Plain()])


def test_update_wrappers_compose_in_order_and_after_update_actions_all_run():
    contributions, calls = Contributions(), []
    contributions.step_wrappers += [lambda f: lambda *a: f(*a) + "1", lambda f: lambda *a: f(*a) + "2"]
    assert contributions.wrap(lambda: "step")() == "step12"
    assert contributions.after_update_action() is None
    contributions.after_update += [lambda: calls.append("a"), lambda: calls.append("b")]
    contributions.after_update_action()()
    assert calls == ["a", "b"]


def test_the_docs_capability_table_is_the_one_the_declarations_make():
    with open(os.path.join(REPO, "docs", "around-the-step.md")) as f:
        text = f.read()
    assert capabilities.table() in text


def test_each_built_in_is_declared_once_and_shows_in_the_factory_the_registry_the_table_and_gin():
    on = Settings(
        describe_config=lambda: "",
        hparams={"lr": 0.1},
        ema_decay=0.9,
        keep_best=1,
        early_stopping=EarlyStoppingOptions(),
        keras_callbacks=[keras.callbacks.TerminateOnNaN()],
        export_saved_model=True,
        max_time_secs=3600,
        strategy="multi_worker_mirrored",  # the worker watch's
    )  # warm_start needs a checkpoint to start from: tests/test_warm_start.py
    made = names(built_in.participants(on))
    assert made == [e.name for e in built_in.BUILT_IN if e.name in made]  # the table's order is the default one
    rows = {setting for setting, _ in capabilities.rows()}
    import trainer.configurables  # noqa: F401  (gives the library its gin names)

    gin_listed = {c.selector: c.target for c in gin_config.registered_configurables()}
    for entry in built_in.BUILT_IN:
        assert entry.make or entry.gin, f"{entry.name} can be turned on neither by a setting nor by gin"
        if entry.make and entry.name != "warm_start":
            assert entry.name in made
        Registry([Recorder("mine", [], after=(entry.name,))], Settings())  # a name `after` may use, present or not
        if entry.cls.setting and not entry.shown_as:
            assert entry.cls.setting in rows
        for gin_name, target in entry.gin.items():
            assert [t for s, t in gin_listed.items() if s == gin_name or s.endswith("." + gin_name)] == [target]
    assert not {s.rpartition(".")[2] for s in gin_listed} & {"eval_hook", "checkpoint_hook"}  # named, never used
