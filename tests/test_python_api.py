"""The Python surface (trainer/api.py, docs/python.md): `trainer.train`, `evaluate`, `predict`, the result,
mistakes raised as the CLI's line, runs repeated in one process, a quiet start."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO, refused_in_one_process, subprocess_env
from trainer.run.settings import Settings

DOCS = os.path.join(REPO, "docs", "python.md")
# TensorFlow's C++ start-up notices (trainer/quiet_start.py): none of them from `import trainer` or a run.
STARTUP_NOTICES = ("absl::InitializeLog", "oneDNN custom operations", "cuda drivers", "cuInit", "rebuild TensorFlow")


def quiet_env(**extra: str) -> dict[str, str]:
    """The suite's subprocess environment without its TF_CPP_MIN_LOG_LEVEL: the level a user has not set."""
    env = subprocess_env(**extra)
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    return env


def run_script(code: str, cwd: str = REPO, timeout: float = 280) -> tuple[dict, str]:
    """`code` in a fresh interpreter; (the JSON object its last stdout line prints, its stderr)."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=quiet_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def default_text(value) -> str:
    """A default as docs/python.md's table shows it: a function by its module path, else its repr."""
    if value is print:
        return "print"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def test_the_docs_list_every_setting_with_its_default():
    text = open(DOCS).read().split("## Every setting", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `(.+)` \|$", text, re.M)
    expected = [(f.name, default_text(f.default)) for f in dataclasses.fields(Settings)]
    assert rows == expected, set(rows) ^ set(expected)


def test_import_trainer_loads_no_tensorflow_and_gives_the_api():
    code = (
        "import sys, trainer\n"
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
        "print(trainer.UserError.__module__, sorted(n for n in ('train', 'evaluate', 'predict', 'configure_devices')"
        " if n in dir(trainer)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=quiet_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == ["[]", "trainer.errors ['configure_devices', 'evaluate', 'predict', 'train']"]


def test_a_mistake_is_raised_before_anything_is_written(tmp_path):
    import gin

    import trainer

    model_dir = tmp_path / "run"
    for settings, line in (
        ({"total_steps": -5}, "train.total_steps must be a positive integer, got -5"),
        ({"total_step": 5}, "train has no parameter 'total_step'; see `python -m trainer.configurables`"),
        ({"strategy": "parameter_server"}, "strategy 'parameter_server' from Python needs a running cluster"),
        ({"gin_files": ["gin/nowhere.gin"]}, "gin file gin/nowhere.gin not found"),
        ({"gin_files": "gin/single.gin"}, "gin_files and gin_bindings are lists of strings"),
    ):
        with pytest.raises(trainer.UserError) as raised:
            trainer.train(model_dir=str(model_dir), **settings)
        assert str(raised.value).startswith(line) and "\n" not in str(raised.value)
        assert not model_dir.exists()
    with pytest.raises(trainer.UserError, match="^the run to read is a TrainResult or a model_dir path"):
        trainer.evaluate(None)
    with pytest.raises(trainer.UserError, match=f"^no checkpoint in {re.escape(str(model_dir))}"):
        trainer.evaluate(str(model_dir))
    assert not model_dir.exists()
    with pytest.raises(ValueError):  # a call that parsed gin files left none of it behind
        gin.query_parameter("train.total_steps")


GIN_MISTAKES = {
    "negative_steps": ["--gin_file=gin/single.gin", "--gin_bindings=train.total_steps=-5"],
    "unknown_binding": ["--gin_file=gin/single.gin", "--gin_bindings=train.total_step=5"],
    "missing_arguments": ["--gin_file=gin/single.gin", "--gin_bindings=train.model_fn=@cnn()"],
    "bad_syntax": ["--gin_file=gin/single.gin", "--gin_bindings=train.total_steps = ("],
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_cli_refusal_is_the_same_line_from_python(tmp_path):
    (tmp_path / "cli").mkdir()
    cli = refused_in_one_process(tmp_path / "cli", GIN_MISTAKES)
    cases = {name: ([a.split("=", 1)[1] for a in args if a.startswith("--gin_file")],
                    [a.split("=", 1)[1] for a in args if a.startswith("--gin_bindings")])
             for name, args in GIN_MISTAKES.items()}  # fmt: skip
    code = f"""
import json, os, trainer
lines = {{}}
for name, (files, bindings) in {cases!r}.items():
    model_dir = os.path.join({str(tmp_path)!r}, "python", name)
    try:
        trainer.train(model_dir=model_dir, gin_files=files, gin_bindings=bindings)
    except trainer.UserError as e:
        lines[name] = "error: " + str(e) if not os.path.exists(model_dir) else "written"
print(json.dumps(lines))
"""
    python, _ = run_script(code)
    assert python == cli


# One interpreter, as a notebook's kernel: two runs of the same settings, a BatchNorm model and a step of
# one's own; then mirrored in mixed precision on the two logical CPUs, a dict of models, an older
# checkpoint evaluated, predictions; devices asked for too late; a run from a gin file; a fresh model_dir.
SCRIPT = """
import json, os, sys
import trainer

trainer.configure_devices(logical_cpus=2)
import keras, numpy as np, tensorflow as tf
from experiments.gan import gan

tmp = sys.argv[1]
short = dict(total_steps=20, steps_per_loop=10, log_every_steps=10, eval_every_steps=10, checkpoint_every_steps=10,
             global_batch_size=32)
lines = []

def bn_model(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(16),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.Dense(num_classes)])

def my_step(model, optimizer, batch, global_batch_size):
    images, labels = batch
    with tf.GradientTape() as tape:
        logits = tf.cast(model(images, training=True), tf.float32)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        scaled = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return {"loss": loss}

runs = [trainer.train(model_dir=os.path.join(tmp, name), model_fn=bn_model, step_fn=my_step, print_fn=lines.append,
                      **short) for name in ("a", "b")]
weights = [[w.numpy() for w in r.model.weights] for r in runs]
images = np.zeros((3, 8, 8, 1), np.float32)
first = runs[0]
out = {
    "identical": len(weights[0]) > 4 and all(np.array_equal(x, y) for x, y in zip(*weights)),
    "model_dir": first.model_dir, "metrics": sorted(first.metrics["eval"]), "step": first.step,
    "checkpoint": first.checkpoint, "history": [(r["step"], r["split"]) for r in first.history],
    "called": list(first.model(images, training=False).shape),
}
mixed = trainer.train(model_dir=os.path.join(tmp, "mixed"), model_fn=bn_model, step_fn=my_step, strategy="mirrored",
                      mixed_precision="mixed_float16", print_fn=lines.append, **short)
logged = next(r for r in mixed.history if r["step"] == 10 and r["split"] == "eval")
out["evaluated"] = [trainer.evaluate(mixed, checkpoint="ckpt-10")["eval"], {k: logged[k] for k in ("loss", "accuracy")}]
predictions = trainer.predict(mixed, checkpoint="ckpt-20")
out["predictions"] = [os.path.relpath(predictions.path, tmp), predictions.num_examples,
                      list(predictions.outputs["output"].shape)]
out["same_as_model"] = bool(np.allclose(predictions.outputs["output"][:3],
                                        mixed.model(trainer.data.Digits()("eval").batch(3).take(1).get_single_element()[0],
                                                    training=False), atol=1e-2))
gans = trainer.train(model_dir=os.path.join(tmp, "gan"), model_fn=gan.gan_models, optimizer_fn=gan.gan_optimizers,
                     step_fn=gan.gan_step, eval_step_fn=gan.gan_eval_step, print_fn=lines.append,
                     **short)
out["gan"] = sorted(gans.model)
try:
    trainer.train(model_dir=os.path.join(tmp, "late"), device_config=trainer.DeviceConfig(logical_cpus=3), **short)
except trainer.UserError as e:
    out["late"] = [str(e), os.path.exists(os.path.join(tmp, "late"))]
from_gin = trainer.train(gin_files=["gin/mwms.gin"], gin_bindings=["train.total_steps=10"], model_fn=bn_model,
                         model_dir=os.path.join(tmp, "gin"), print_fn=lines.append, **{k: v for k, v in short.items()
                         if k != "total_steps"})
out["gin"] = [from_gin.settings.strategy, from_gin.step, from_gin.settings.model_fn is bn_model]
os.chdir(tmp)
out["fresh"] = os.path.relpath(trainer.train(total_steps=1, eval_every_steps=1, print_fn=lines.append).model_dir, tmp)
out["lines"] = [line for line in lines if line.startswith(("training", "note:", "model_dir:"))]
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_runs_repeat_in_one_process_and_return_what_they_made(tmp_path):
    out, stderr = run_script(SCRIPT.replace("sys.argv[1]", repr(str(tmp_path))), timeout=380)
    assert out["identical"], "two runs of the same settings in one process trained different weights"
    a = str(tmp_path / "a")
    assert out["model_dir"] == a and out["checkpoint"] == os.path.join(a, "ckpt-20") and out["step"] == 20
    assert out["metrics"] == ["accuracy", "loss"]
    assert out["history"] == [[10, "train"], [10, "eval"], [20, "train"], [20, "eval"]]
    assert out["called"] == [3, 10]
    evaluated, logged = out["evaluated"]
    assert evaluated == logged  # ckpt-10 evaluated again: the results the run logged at step 10
    assert out["predictions"] == [os.path.join("mixed", "predictions", "eval-ckpt-20.npz"), 359, [359, 10]]
    assert out["same_as_model"]
    assert out["gan"] == ["discriminator", "generator"]
    late, written = out["late"]
    assert late.startswith("device setup failed") and "trainer.configure_devices(" in late and not written
    assert out["gin"] == ["multi_worker_mirrored", 10, True]
    assert re.fullmatch(r"runs/\d{8}-\d{6}-\d+", out["fresh"])
    assert f"model_dir: {tmp_path / out['fresh']}" in out["lines"]  # printed first, as the CLI prints it
    starts = [line.split(" with strategy ")[1].split(", global")[0] for line in out["lines"] if "training" in line]
    default, mirrored = "'default' on 1 replica(s) (1 worker(s))", "'mirrored' on 2 replica(s) (1 worker(s))"
    assert starts[:4] == [default, default, mirrored, default]  # a, b, mixed, gan; then the gin file's MWMS
    assert starts[4] == "'multi_worker_mirrored' on 1 replica(s) (1 worker(s))"  # MWMS: one CPU device a worker
    assert not any(line.startswith("note:") for line in out["lines"])  # the CPU was split: nothing to say
    assert not [n for n in STARTUP_NOTICES if n in stderr], stderr[-3000:]
    assert "Traceback" not in stderr


# A kernel's interrupt (SIGINT) from the first loop's end, as a user's Ctrl-C would come.
INTERRUPTING = """
import faulthandler, os, signal
from trainer.extensions import SYNCHRONOUS, Extension

faulthandler.dump_traceback_later(260, exit=True)  # a hang fails with every thread's stack, not a bare timeout

class Interrupt(Extension):
    name, supports, sent = "interrupt", SYNCHRONOUS, False

    def after_loop(self, context, step, metrics):
        if step >= 10 and not self.sent:  # once, whatever lengths the loop calls had
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mirrored_on_an_unsplit_cpu_says_how_and_an_interrupt_is_a_keyboard_interrupt(tmp_path):
    code = f"""
import json, os, signal, trainer
{INTERRUPTING}
lines, out = [], {{}}
trainer.train(model_dir={str(tmp_path / "run")!r}, strategy="mirrored", total_steps=2, eval_every_steps=2,
              print_fn=lines.append)
out["lines"] = [line for line in lines if line.startswith(("note:", "training"))]
model_dir = {str(tmp_path / "interrupted")!r}
try:
    trainer.train(model_dir=model_dir, total_steps=100000, steps_per_loop=10, extensions=[Interrupt()],
                  print_fn=lines.append)
except KeyboardInterrupt as e:
    out["interrupted"] = [str(e), sorted(f for f in os.listdir(model_dir) if f.endswith(".index"))]
out["handler"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
saved = max(int(name.split("-")[1].split(".")[0]) for name in out["interrupted"][1])
out["again"] = [saved, trainer.train(model_dir=model_dir, total_steps=saved + 10, print_fn=lines.append).step]
print(json.dumps(out))
"""
    out, _ = run_script(code)
    assert out["lines"] == [
        "note: strategy 'mirrored' runs 1 replica on this unsplit CPU; for 2, call "
        "trainer.configure_devices(logical_cpus=2) before the first run",
        out["lines"][1],
    ]
    assert "on 1 replica(s)" in out["lines"][1]
    message, checkpoints = out["interrupted"]
    assert message.startswith("training interrupted; the same trainer.train call continues") and checkpoints
    saved, step = out["again"]
    assert out["handler"] and step == saved + 10  # the process goes on: Ctrl-C works as before, a run resumes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_python_example_runs_as_written_quietly_after_tensorflow(tmp_path):
    """In a session whose earlier line imported TensorFlow (its own notices went out then, as a notebook's
    earlier cell): the example adds nothing to stderr, not even the failed cuInit that a machine without a
    GPU driver logs when the devices are first listed."""
    readme = open(os.path.join(REPO, "README.md")).read().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert "total_steps=600" in block and len(block.strip().splitlines()) == 5
    example = block.replace("total_steps=600", "total_steps=20, eval_every_steps=20")
    code = f"import sys, tensorflow\nprint('MARK', file=sys.stderr, flush=True)\n{example}print('{{}}')\n"
    _, stderr = run_script(code, cwd=str(tmp_path))
    assert (tmp_path / "runs" / "python" / "ckpt-20.index").exists()
    assert (tmp_path / "runs" / "python" / "predictions" / "eval-ckpt-20.npz").exists()
    assert stderr.split("MARK\n", 1)[1] == ""
