"""A function bound by reference (`train.step_fn = @my_step`) reaches the loop as the plain function
with gin's bindings applied once, with gin's semantics: scopes (and their parents), references in
the bindings, the caller winning over a binding of what it passes positionally, and the values
logged in the operative config. A run with a gin-configurable step trains exactly as one with
the same function bound without gin."""
from __future__ import annotations

import functools

import gin
import pytest

from tests.support import run_python
from trainer.tools import gin_functions


@pytest.fixture
def config():
    gin.clear_config()
    yield
    gin.clear_config()


@gin.configurable("gin_functions_step")
def configurable_step(model, optimizer, batch, global_batch_size, smoothing=0.0, scale=1.0, offset=0):
    return {"smoothing": smoothing, "scale": scale, "offset": offset, "global_batch_size": global_batch_size}


@gin.configurable("gin_functions_offset")
def offset_value(value=7):
    return value


def reference(text: str, name: str = "train.step_fn"):
    gin.parse_config(text)
    return gin.get_bindings(name.split(".")[0], resolve_references=False)[name.split(".")[1]]


def test_bindings_are_applied_once_as_gin_would_apply_them(config):
    gin.external_configurable(lambda **kw: kw, "train_probe")
    ref = reference("train_probe.step_fn = @scoped/gin_functions_step\n"
                    "gin_functions_step.smoothing = 0.1\n"
                    "scoped/gin_functions_step.scale = 2.0\n"
                    "gin_functions_step.offset = @gin_functions_offset()\n"
                    "gin_functions_step.global_batch_size = 999\n", "train_probe.step_fn")
    plain = gin_functions.plain_function(ref, positional=4)
    assert isinstance(plain, functools.partial) and plain.func is configurable_step.__wrapped__
    assert plain.__name__ == "configurable_step"
    outputs = plain(None, None, None, 64)  # the loop passes the first four positionally: they win
    assert outputs == {"smoothing": 0.1, "scale": 2.0, "offset": 7, "global_batch_size": 64}
    assert outputs == ref.scoped_configurable_fn(None, None, None, 64)  # what gin's own wrapper gives
    operative = gin.operative_config_str()
    assert "scoped/gin_functions_step.scale = 2.0" in operative and "smoothing = 0.1" in operative


def test_a_function_without_bindings_is_handed_over_as_it_is(config):
    gin.external_configurable(lambda **kw: kw, "train_probe2")
    ref = reference("train_probe2.step_fn = @gin_functions_step\n", "train_probe2.step_fn")
    assert gin_functions.plain_function(ref, positional=4) is configurable_step.__wrapped__
    assert gin_functions.plain_function("not a reference", positional=4) is None


def test_a_gin_configurable_step_trains_exactly_as_the_plain_function():
    result = run_python('''
import dataclasses, functools, json, tempfile
import gin
from trainer import configurables, main
from trainer.run.train import train
base = ["import tests.smoothed_steps", "train.total_steps = 20", "train.log_every_steps = 5", "train.model_fn = @mlp"]
lines = {}
for name in ("gin", "plain"):
    gin.clear_config()
    out = []
    with tempfile.TemporaryDirectory() as model_dir:
        if name == "gin":
            main.parse_gin(["gin/single.gin"], base + ["train.step_fn = @smoothed_step", "smoothed_step.smoothing = 0.2"])
            configurables.train(model_dir=model_dir, print_fn=out.append)
            operative = gin.operative_config_str()
        else:
            main.parse_gin(["gin/single.gin"], base)
            from tests.smoothed_steps import smoothed_step
            settings = configurables.settings_from_gin()
            fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
            train(**fields | {"model_dir": model_dir, "print_fn": out.append,
                              "step_fn": functools.partial(smoothed_step.__wrapped__, smoothing=0.2)})
    lines[name] = [line.split("  ")[1] for line in out if line.startswith("step ")]
print(json.dumps({"lines": lines, "logged": "smoothed_step.smoothing = 0.2" in operative}))
''')
    assert result["lines"]["gin"] == result["lines"]["plain"] and len(result["lines"]["gin"]) == 4, result
    assert result["logged"]  # the operative config still says what the step ran with
