"""The speed options (train.jit_compile, train.mixed_precision) train correctly, and the loop
compiles once. Speed itself is only reported by `python -m experiments.bench`, never asserted."""

from __future__ import annotations

import textwrap

import pytest

from tests.support import run_python

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

# Runs `train` in this process with an extension that records each loop call; prints its findings.
RUN = textwrap.dedent('''
    import json, math, tempfile
    import keras
    from trainer import data
    from trainer.distribution import devices
    from trainer.task import models
    from trainer.task import optimizers
    from trainer.run import train as train_lib
    from trainer.extensions.protocol import Extension

    class Calls(Extension):
        """Records each loop call's length, its outputs and the loop's trace count."""
        def begin(self, context):
            self.step, self.lengths, self.losses = context.start_step, [], []
        def after_loop(self, context, step, metrics):
            self.lengths.append(step - self.step)
            self.step = step
            self.losses.append(metrics["loss"])
            self.trace_count = context.loop.trace_count
            self.optimizer = type(context.task.optimizers).__name__

    def run(**kwargs):
        calls = Calls()
        kwargs.setdefault("optimizer_fn", optimizers.make_optimizer)
        with tempfile.TemporaryDirectory() as model_dir:
            final = train_lib.train(model_dir=model_dir, extensions=[calls], print_fn=lambda line: None, **kwargs)
        return {"eval": final, "lengths": calls.lengths, "losses": calls.losses, "trace_count": calls.trace_count,
                "optimizer": calls.optimizer, "policy_after": keras.mixed_precision.global_policy().name}
''')


# Their bfloat16 runs are fast only where the CPU computes in bfloat16 (AVX-512 BF16, AMX): elsewhere
# (TF_ENABLE_ONEDNN_OPTS=0 here) the first took 205 s and the second over 300 s on 2 loaded cores.
@pytest.mark.timeout(600)
def test_jit_compile_trains_on_one_and_two_replicas_and_the_loop_compiles_once():
    result = run_python(
        RUN
        + textwrap.dedent("""
        short = dict(model_fn=models.mlp, total_steps=13, steps_per_loop=3,
                     log_every_steps=4, checkpoint_every_steps=5, eval_every_steps=100, global_batch_size=32)
        mirrored = run(strategy="mirrored", device_config=devices.DeviceConfig(logical_cpus=2), jit_compile=True,
                       mixed_precision="mixed_bfloat16", **short)
        single = run(strategy="default", jit_compile=True, **short)
        plain = run(strategy="mirrored", **short)
        print(json.dumps({"mirrored": mirrored, "single": single, "plain": plain}))
    """),
        timeout=540,
    )
    for name, run in result.items():
        # Calls of 1, 2 and 3 steps (steps_per_loop 3, boundaries every 4 and 5): one trace for all.
        assert len(set(run["lengths"])) >= 3, (name, run["lengths"])
        assert run["trace_count"] == 1, (name, run)
        assert all(loss == loss for loss in run["losses"]), (name, run["losses"])  # finite, not NaN
        assert run["losses"][-1] < run["losses"][0], (name, run["losses"])
        assert run["policy_after"] == "float32", name  # train puts the global policy back
    # The same data and initial weights: XLA and bfloat16 change rounding, not what is learned.
    assert abs(result["mirrored"]["eval"]["accuracy"] - result["plain"]["eval"]["accuracy"]) < 0.1


@pytest.mark.timeout(900)
def test_mixed_bfloat16_reaches_float32_accuracy_on_digits():
    """The CNN of gin/base.gin (600 steps, batch 64, Adam 0.002) on digits, float32 and bfloat16."""
    result = run_python(
        RUN
        + textwrap.dedent("""
        base = dict(total_steps=600, global_batch_size=64, steps_per_loop=50, log_every_steps=200,
                    checkpoint_every_steps=600, eval_every_steps=600,
                    optimizer_fn=lambda **kw: optimizers.make_optimizer(learning_rate=0.002, **kw))
        print(json.dumps({p: run(mixed_precision=p, **base) for p in ("float32", "mixed_bfloat16")}))
    """),
        timeout=840,
    )
    float32, bfloat16 = result["float32"]["eval"]["accuracy"], result["mixed_bfloat16"]["eval"]["accuracy"]
    assert float32 > 0.95, result
    assert abs(bfloat16 - float32) <= 0.01, (float32, bfloat16)


def test_mixed_float16_scales_the_loss_correctly():
    """With plain SGD a missing scale (or unscale) changes each update 32768-fold; with correct
    loss scaling the float16 run follows the float32 one."""
    result = run_python(
        RUN
        + textwrap.dedent("""
        sgd = lambda **kw: optimizers.make_optimizer(name="sgd", learning_rate=0.1, **kw)
        short = dict(model_fn=models.mlp, total_steps=30, steps_per_loop=10,
                     log_every_steps=10, checkpoint_every_steps=100, eval_every_steps=100, optimizer_fn=sgd)
        print(json.dumps({p: run(mixed_precision=p, **short) for p in ("float32", "mixed_float16")}))
    """)
    )
    float32, float16 = result["float32"], result["mixed_float16"]
    assert float16["optimizer"].endswith("LossScaleOptimizer") and float32["optimizer"] == "SGD"
    assert all(loss == loss and abs(loss) < 1e6 for loss in float16["losses"]), float16["losses"]
    assert float16["losses"][-1] < 0.8 * float16["losses"][0], float16["losses"]
    for a, b in zip(float32["losses"], float16["losses"]):
        assert abs(a - b) <= 0.05 * a, (float32["losses"], float16["losses"])
