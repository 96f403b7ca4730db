"""Eval padding that cannot change a number: the loop pads an eval split with copies of its own examples
(weight 0), the built-in eval step selects rows of weight above 0 instead of multiplying by the weight, so a
model that is NaN on some example (Embedding(mask_zero=True) + GlobalAveragePooling1D on an all-zero
sequence: tests/masked_mean_text.py) gets the eval loss of its real examples, the same at a global batch that
pads and one that does not, under every strategy. A non-finite eval result is said in one warning line and
never ranks as the best checkpoint nor counts as an improvement."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.masked_mean_text import ALL_ZERO, NUM_EVAL, masked_mean_classifier, token_ids
from tests.support import launch_workers, main_in_one_process, read_jsonl, run_main
from trainer import data
from trainer.extensions.best_checkpoints import BestCheckpoints
from trainer.extensions.monitoring import monitored
from trainer.files.metrics_log import nonfinite_warning
from trainer.task import steps

NAN = float("nan")
# Learning rate 0: every run evaluates the same initial weights (seed 0), whatever its strategy and global batch.
RUN = [
    "--gin_bindings=import tests.masked_mean_text",
    "--gin_bindings=train.input_fn=@token_ids",
    "--gin_bindings=train.model_fn=@masked_mean_classifier",
    "--gin_bindings=train.optimizer_fn=@frozen",
    "--gin_bindings=train.total_steps=2",
    "--gin_bindings=train.steps_per_loop=1",
    "--gin_bindings=train.eval_every_steps=1",
    "--gin_bindings=train.checkpoint_every_steps=2",
    "--gin_bindings=train.log_every_steps=2",
]
PADS, WHOLE = 4, 10  # 10 eval examples: global batch 4 pads 2 rows, 10 none


def batch_size(size: int) -> str:
    return f"--gin_bindings=train.global_batch_size={size}"


def eval_losses(model_dir: str) -> list[float]:
    return [r["loss"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"]


def test_eval_padding_is_copies_of_the_split_weighing_zero():
    batches = list(data.eval_dataset(token_ids, PADS, pad_to_multiple_of=PADS).as_numpy_iterator())
    tokens, labels, sample_weights, weights = (np.concatenate(part) for part in zip(*batches))
    real = [np.stack(part) for part in zip(*token_ids("eval").as_numpy_iterator())]
    assert len(weights) == 12 and list(weights) == [1.0] * NUM_EVAL + [0.0, 0.0]
    np.testing.assert_array_equal(tokens, np.concatenate([real[0], real[0][:2]]))  # the split's first two again
    np.testing.assert_array_equal(labels, np.concatenate([real[1], real[1][:2]]))
    assert tokens[NUM_EVAL:].any()  # never all-zero rows the model is NaN on


def test_the_built_in_eval_step_selects_rows_of_weight_above_zero():
    """The all-zero example (weight 0) makes its logits NaN; the sums are those of the other rows."""
    model = masked_mean_classifier()
    tokens, labels, sample_weights = next(iter(token_ids("eval").batch(NUM_EVAL)))
    loop_weights = tf.ones([NUM_EVAL])
    assert math.isnan(float(model(tokens)[ALL_ZERO, 0]))
    sums = steps.classification_eval_step(model, (tokens, labels, sample_weights, loop_weights))
    keep = np.arange(NUM_EVAL) != ALL_ZERO
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=model(tokens)).numpy()
    assert float(sums["loss"]) == pytest.approx(per_example[keep].sum(), rel=1e-6)
    assert float(sums["accuracy/denominator"]) == keep.sum() and float(sums["num_examples"]) == NUM_EVAL
    # Rows the loop padded with (its weight 0), the NaN one among them, add nothing.
    padded = steps.classification_eval_step(model, (tokens, labels, tf.ones([NUM_EVAL]), tf.zeros([NUM_EVAL])))
    assert float(padded["loss"]) == 0.0 and float(padded["accuracy"]) == 0.0
    assert steps.weighted_sum(tf.constant([1.0, NAN, math.inf]), tf.constant([2.0, 0.0, 0.0])).numpy() == 2.0


def test_a_nonfinite_eval_never_ranks_nor_improves_and_is_said_in_one_line():
    for mode, best_ever in (("min", -math.inf), ("max", math.inf)):
        best = BestCheckpoints(2, monitored("train.", "loss", mode, ("eval",)))
        assert not best.ranks(NAN) and not best.ranks(best_ever)  # not even with room for it
        best._rank(10, 0.5)
        assert best.ranks(0.7) and not best.ranks(NAN) and not best._better(NAN, 0.5)
        assert not best.metric.improves(NAN, None) and not best.metric.improves(best_ever, 0.5)
    line = nonfinite_warning("eval", 40, {"loss": NAN, "accuracy": 0.9, "auc": math.inf})
    assert line.startswith("warning: eval split 'eval' at step 40: loss nan, auc inf (not finite") and "\n" not in line
    assert nonfinite_warning("eval", 40, {"loss": 0.3}) is None


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> float:
    """The eval loss of the 9 real examples of weight 1 (one device, a global batch that does not pad)."""
    model_dir = str(tmp_path_factory.mktemp("reference"))
    proc = run_main("--gin_file=gin/single.gin", *RUN, batch_size(WHOLE), f"--model_dir={model_dir}", timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = eval_losses(model_dir)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses) and losses[0] == losses[1]
    return losses[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_eval_loss_is_that_of_the_real_examples_padded_or_not_one_device_and_mirrored(tmp_path, reference):
    """Mirrored first: the process splits its CPU in two; the default strategy runs on it after. (One
    mirrored run a process: a second one's collectives fail in TensorFlow after a clear_session.)"""
    cases = {
        gin: (["--gin_file=gin/" + gin, *RUN, batch_size(PADS)], str(tmp_path / gin))
        for gin in ("mirrored.gin", "single.gin")
    }
    nan_counts = [
        *RUN,
        batch_size(PADS),
        "--gin_bindings=token_ids.zero_weight=1.0",
        "--gin_bindings=train.keep_best=1",
    ]
    nan_counts += ["--gin_bindings=train.early_stopping=@early_stopping()", "--gin_bindings=early_stopping.patience=5"]
    cases["nan counts"] = (["--gin_file=gin/single.gin", *nan_counts], str(tmp_path / "nan"))
    outcomes = main_in_one_process(cases, timeout=280)
    for name, outcome in outcomes.items():
        assert outcome["code"] == 0, (name, outcome["stderr"][-3000:])
    for name in cases.keys() - {"nan counts"}:
        assert "warning: eval" not in outcomes[name]["stdout"], name
        for loss in eval_losses(cases[name][1]):
            assert loss == pytest.approx(reference, rel=1e-6), name
    # The all-zero example weighing 1 is a real NaN: said once per eval, never the best checkpoint.
    said = [line for line in outcomes["nan counts"]["stdout"].splitlines() if line.startswith("warning: eval")]
    assert said == [
        f"warning: eval split 'eval' at step {step}: loss nan (not finite: the model is NaN or inf on an example "
        "of weight above 0); best checkpoints and early stopping never count it as the best or an improvement"
        for step in (1, 2)
    ]
    assert not os.path.exists(os.path.join(cases["nan counts"][1], "best", "best.json"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_eval_loss_is_that_of_the_real_examples_on_two_workers(tmp_path, reference):
    model_dir = str(tmp_path / "mwms")
    launch_workers("--gin_file=gin/mwms.gin", *RUN, batch_size(PADS), f"--model_dir={model_dir}", timeout=280)
    assert eval_losses(model_dir) == pytest.approx([reference] * 2, rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_eval_loss_is_that_of_the_real_examples_under_parameter_servers(tmp_path, reference):
    """No padding here (the coordinator's last batch is partial); the NaN example of weight 0 is selected out."""
    model_dir = str(tmp_path / "ps")
    proc = run_main("--gin_file=gin/ps.gin", *RUN, batch_size(PADS), f"--model_dir={model_dir}", timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert eval_losses(model_dir) == pytest.approx([reference] * 2, rel=1e-6)
