"""A function bound by reference (`train.step_fn = @my_step`) reaches the loop as the plain function
with gin's bindings applied once, with gin's semantics (scopes and their parents, references in
the bindings, the values logged in the operative config), except that every binding reaches the
function whatever the parameter's position, and a binding of what the loop passes is refused. A run with a gin-configurable step trains exactly as one with
the same function bound without gin."""

from __future__ import annotations

import inspect

import gin
import pytest

from tests.support import read_jsonl, run_main, run_python
from trainer.errors import UserError
from trainer.task import contract
from trainer.task import task as task_lib
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
    ref = reference(
        "train_probe.step_fn = @scoped/gin_functions_step\n"
        "gin_functions_step.smoothing = 0.1\n"
        "scoped/gin_functions_step.scale = 2.0\n"
        "gin_functions_step.offset = @gin_functions_offset()\n",
        "train_probe.step_fn",
    )
    plain = gin_functions.plain_function(ref, supplied=contract.STEP.names, what="train.step_fn")
    assert plain.__name__ == "configurable_step"
    assert list(inspect.signature(plain).parameters) == ["model", "optimizer", "batch", "global_batch_size"]
    assert contract.adapt(plain, contract.STEP) is plain  # a positional call already fills what it should
    outputs = plain(None, None, None, 64)
    assert outputs == {"smoothing": 0.1, "scale": 2.0, "offset": 7, "global_batch_size": 64}
    assert outputs == ref.scoped_configurable_fn(None, None, None, 64)  # what gin's own wrapper gives
    assert plain(None, None, None, 64, scale=5.0)["scale"] == 2.0  # a binding wins over a caller's keyword
    operative = gin.operative_config_str()
    assert "scoped/gin_functions_step.scale = 2.0" in operative and "smoothing = 0.1" in operative


@gin.configurable("gin_functions_eval_step")
def eval_step_with_mode(model, batch, training=False):
    return {"model": model, "batch": batch, "training": training}


@gin.configurable("gin_functions_middle_step")
def middle_step(model, optimizer, loss_weight, batch, global_batch_size):
    return {"optimizer": optimizer, "loss_weight": loss_weight, "batch": batch, "global_batch_size": global_batch_size}


def sharded_source(path, split, input_context=None):
    return path, split, input_context


def positional_step(*args):
    return args


def renamed_eval_step(m, b, training=False):
    return {"m": m, "b": b, "training": training}


@gin.configurable("gin_functions_optimizer")
def probe_optimizer(*, global_batch_size, total_steps, name="sgd"):
    return {"global_batch_size": global_batch_size, "total_steps": total_steps, "name": name}


def test_a_bound_parameter_reaches_the_function_whatever_its_position(config):
    """The positional call `eval_step(model, batch, metrics)` would put the metrics into `training`,
    and `step(model, optimizer, batch, global_batch_size)` the batch into `loss_weight`."""
    gin.external_configurable(lambda **kw: kw, "train_probe3")
    gin.parse_config(
        "train_probe3.eval_step_fn = @gin_functions_eval_step\n"
        "train_probe3.step_fn = @gin_functions_middle_step\n"
        "train_probe3.optimizer_fn = @gin_functions_optimizer\n"
        "gin_functions_eval_step.training = True\n"
        "gin_functions_middle_step.loss_weight = 0.25\n"
        "gin_functions_optimizer.total_steps = 7\n"
    )
    refs = gin.get_bindings("train_probe3", resolve_references=False)
    eval_step = contract.adapt(
        gin_functions.plain_function(refs["eval_step_fn"], supplied=contract.EVAL_STEP.names), contract.EVAL_STEP
    )
    assert not contract.takes(eval_step, "metrics", contract.EVAL_STEP)
    assert eval_step("model", "batch") == {"model": "model", "batch": "batch", "training": True}
    step = contract.adapt(gin_functions.plain_function(refs["step_fn"], supplied=contract.STEP.names), contract.STEP)
    assert step("model", "optimizer", "batch", 64) == {
        "optimizer": "optimizer",
        "loss_weight": 0.25,
        "batch": "batch",
        "global_batch_size": 64,
    }
    # model_fn and optimizer_fn get what they declare of the loop's offers; a binding wins over the offer
    optimizer = gin_functions.plain_function(refs["optimizer_fn"])
    assert task_lib.call_with_declared(optimizer, {"global_batch_size": 64, "total_steps": 100}, what="x") == {
        "global_batch_size": 64,
        "total_steps": 7,
        "name": "sgd",
    }
    # an input function whose bound first parameter a positional `split` would fill
    source = contract.adapt(gin_functions.with_bindings(sharded_source, {"path": "/data"}), contract.INPUT)
    assert contract.takes(source, "input_context", contract.INPUT)
    assert source("train") == ("/data", "train", None)
    assert source("train", input_context="context") == ("/data", "train", "context")
    # a step that takes the values as *args is called positionally, as it asks
    assert contract.adapt(positional_step, contract.STEP) is positional_step
    # without gin: a renamed eval step gets model and batch by position, `metrics` only by its name
    renamed = contract.adapt(renamed_eval_step, contract.EVAL_STEP)
    assert renamed is renamed_eval_step and not contract.takes(renamed, "metrics", contract.EVAL_STEP)


def test_a_binding_of_what_the_loop_passes_or_a_parameter_nothing_fills_is_one_error_line(config):
    gin.external_configurable(lambda **kw: kw, "train_probe4")
    ref = reference(
        "train_probe4.step_fn = @gin_functions_step\ngin_functions_step.global_batch_size = 999\n",
        "train_probe4.step_fn",
    )
    with pytest.raises(
        UserError,
        match=r"^gin binds gin_functions_step.global_batch_size, but train.step_fn "
        r"configurable_step gets 'global_batch_size' from the loop .*; remove",
    ):
        gin_functions.plain_function(ref, supplied=contract.STEP.names, what="train.step_fn")
    with pytest.raises(
        UserError,
        match=r"^train.step_fn middle_step has parameter 'loss_weight', which the loop "
        r"does not fill .* bind it in gin \(middle_step.loss_weight = \.\.\.\)$",
    ):
        contract.adapt(middle_step.__wrapped__, contract.STEP)  # unbound, and not named after a value of the loop


def test_a_function_without_bindings_is_handed_over_as_it_is(config):
    gin.external_configurable(lambda **kw: kw, "train_probe2")
    ref = reference("train_probe2.step_fn = @gin_functions_step\n", "train_probe2.step_fn")
    assert gin_functions.plain_function(ref, supplied=contract.STEP.names) is configurable_step.__wrapped__
    assert gin_functions.plain_function("not a reference") is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bound_input_step_and_eval_step_parameters_reach_a_run(tmp_path):
    """A run whose input function, step and eval step each have a bound parameter where the loop's
    positional call would have filled it: the run trains with those bound values."""
    proc = run_main(
        "--gin_file=gin/single.gin",
        "--gin_bindings=import tests.bound_functions",
        "--gin_bindings=train.input_fn = @split_of",
        "--gin_bindings=split_of.source = @digits()",
        "--gin_bindings=train.model_fn = @mlp",
        "--gin_bindings=mlp.num_classes = 10",
        "--gin_bindings=train.step_fn = @weighted_loss_step",
        "--gin_bindings=weighted_loss_step.loss_weight = 0.25",
        "--gin_bindings=train.eval_step_fn = @mode_eval_step",
        "--gin_bindings=mode_eval_step.training = True",
        "--gin_bindings=train.total_steps = 4",
        "--gin_bindings=train.log_every_steps = 2",
        "--gin_bindings=train.eval_every_steps = 4",
        f"--model_dir={tmp_path}",
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["loss_weight"] for r in train] == [0.25, 0.25]
    assert [r["training"] for r in evals] == [1.0]


@pytest.mark.slow
def test_a_gin_configurable_step_trains_exactly_as_the_plain_function():
    result = run_python("""
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
""")
    assert result["lines"]["gin"] == result["lines"]["plain"] and len(result["lines"]["gin"]) == 4, result
    assert result["logged"]  # the operative config still says what the step ran with
