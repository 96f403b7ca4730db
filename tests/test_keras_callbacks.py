"""Keras 3 callbacks as hooks (train.keras_callbacks): the same decisions as under `fit`, every
strategy of one process, model.stop_training agreed under MultiWorkerMirrored, refusals in one line."""

from __future__ import annotations

import csv
import os
import re
import textwrap

import pytest
import tensorflow as tf

from tests.support import launch_workers, main_in_one_process, read_jsonl, run_python
from tests.test_early_stopping import SHORT, best_steps, top_k_steps
from tests.test_multiworker import trainer_pids_for

# Must-show 6: the run and `fit` on the same model, optimizer and data, epochs = eval intervals,
# both fed the run's log sequence (fit's own logs must have the same keys), the callbacks compared.
COMPARE_WITH_FIT = textwrap.dedent("""
    import json, os, sys
    import keras, numpy as np, tensorflow as tf
    from trainer import data
    from trainer.task import models
    from trainer.task import optimizers
    from trainer.run.train import train

    EVERY, TOTAL, out = 20, 200, sys.argv[1] if len(sys.argv) > 1 else {out!r}

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs = []
        def on_epoch_end(self, epoch, logs=None):
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            self.epochs.append({{"epoch": epoch, "lr": lr, "logs": dict(logs)}})

    class Feeder(keras.callbacks.Callback):  # fit's logs replaced by the run's, key for key
        def __init__(self, epochs):
            super().__init__()
            added = ("learning_rate",)  # by ReduceLROnPlateau, after the feeder
            self.sequence = [{{k: v for k, v in e["logs"].items() if k not in added}} for e in epochs]
        def on_epoch_end(self, epoch, logs=None):
            assert set(logs) == set(self.sequence[epoch]), (sorted(logs), sorted(self.sequence[epoch]))
            logs.update(self.sequence[epoch])

    def callbacks(csv_path):
        stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.15)
        plateau = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5, min_delta=0.2)
        return [stop, plateau, keras.callbacks.CSVLogger(csv_path), Recorder()]

    def sgd(global_batch_size, total_steps):
        return optimizers.make_optimizer(global_batch_size=global_batch_size, total_steps=total_steps,
                                         name="sgd", learning_rate=0.05)

    ours = callbacks(os.path.join(out, "ours.csv"))
    train(model_dir=os.path.join(out, "run"), total_steps=TOTAL, eval_every_steps=EVERY, steps_per_loop=10,
          checkpoint_every_steps=100, log_every_steps=20, model_fn=models.mlp, optimizer_fn=sgd,
          keras_callbacks=ours, print_fn=lambda line: None)

    source = data.Digits()
    def arrays(split):
        x, y = zip(*[(a, b) for a, b in source(split).as_numpy_iterator()])
        return np.stack(x), np.stack(y)
    (x, y), (xe, ye) = arrays("train"), arrays("eval")
    keras.utils.set_random_seed(0)
    model = models.mlp(input_shape=x.shape[1:], num_classes=10)
    model.compile(optimizer=sgd(64, TOTAL), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    theirs = callbacks(os.path.join(out, "fit.csv"))
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64), epochs=TOTAL // EVERY,
                        steps_per_epoch=EVERY, validation_data=(xe, ye), verbose=0,
                        callbacks=[Feeder(ours[-1].epochs), *theirs])
    print(json.dumps({{
        "ours": {{"stopped_epoch": ours[0].stopped_epoch, "lr": [e["lr"] for e in ours[-1].epochs],
                 "checkpoints": sorted(f for f in os.listdir(os.path.join(out, "run")) if f.endswith(".index"))}},
        "fit": {{"stopped_epoch": theirs[0].stopped_epoch, "lr": [e["lr"] for e in theirs[-1].epochs],
                "epochs": len(history.epoch)}},
    }}))
""")


def read_csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_early_stopping_reduce_lr_and_csvlogger_behave_as_under_fit(tmp_path):
    result = run_python(COMPARE_WITH_FIT.format(out=str(tmp_path)), timeout=220)
    ours, fit = result["ours"], result["fit"]
    print(result)
    assert ours["stopped_epoch"] == fit["stopped_epoch"] > 0  # EarlyStopping fired, at the same epoch
    stop_step = (ours["stopped_epoch"] + 1) * 20
    assert stop_step < 200 and ours["checkpoints"][-1] == f"ckpt-{stop_step}.index"  # the run stopped there
    assert ours["lr"] == fit["lr"] and len(ours["lr"]) == fit["epochs"]  # same rates after each epoch
    assert len(set(ours["lr"])) > 1  # ReduceLROnPlateau fired
    mine, theirs = read_csv(tmp_path / "ours.csv"), read_csv(tmp_path / "fit.csv")
    assert mine[0] == theirs[0] == ["epoch", "accuracy", "learning_rate", "loss", "val_accuracy", "val_loss"]
    assert [row[0] for row in mine] == [row[0] for row in theirs] and len(mine) == fit["epochs"] + 1


SINGLE_PROCESS = {  # strategy -> its gin file; the 2-replica ones first (TensorFlow splits the CPU before its first run)
    "mirrored": "gin/mirrored.gin",
    "central_storage": "gin/central_storage.gin",
    "default": "gin/single.gin",
    "one_device": "gin/single.gin",
}


@pytest.fixture(scope="module")
def single_process_runs(tmp_path_factory) -> tuple[str, dict]:
    """Best checkpoints, Keras' EarlyStopping and CSVLogger under each strategy of one process, the runs in one
    interpreter (main_in_one_process: one TensorFlow start instead of four). (their folder, outcomes by
    strategy); each run's model_dir is <folder>/<strategy>, its CSV log <folder>/<strategy>.csv."""
    root = str(tmp_path_factory.mktemp("single_process"))
    cases = {
        strategy: (
            [
                f"--gin_file={gin_file}",
                *SHORT,
                f"--gin_bindings=train.strategy='{strategy}'",
                "--gin_bindings=train.keep_best=2",
                "--gin_bindings=train.best_metric='accuracy'",
                "--gin_bindings=train.best_mode='max'",
                "--gin_bindings=train.keras_callbacks=[@keras.callbacks.EarlyStopping(), @keras.callbacks.CSVLogger()]",
                "--gin_bindings=keras.callbacks.EarlyStopping.min_delta=100.0",
                "--gin_bindings=keras.callbacks.EarlyStopping.patience=2",
                f"--gin_bindings=keras.callbacks.CSVLogger.filename='{root}/{strategy}.csv'",
            ],
            os.path.join(root, strategy),
        )
        for strategy, gin_file in SINGLE_PROCESS.items()
    }
    return root, main_in_one_process(cases)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "gin_file,strategy",
    [
        ("gin/single.gin", "default"),
        ("gin/single.gin", "one_device"),
        ("gin/mirrored.gin", "mirrored"),
        ("gin/central_storage.gin", "central_storage"),
    ],
)
@pytest.mark.xdist_group("single_process_runs")
def test_all_three_features_under_each_single_process_strategy(single_process_runs, gin_file, strategy):
    root, outcomes = single_process_runs
    outcome, model_dir = outcomes[strategy], os.path.join(root, strategy)
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    # Keras' EarlyStopping stops after epoch 2 (steps 41-60): the run ends at step 60.
    assert os.path.exists(os.path.join(model_dir, "ckpt-60.index")), outcome["stdout"][-2000:]
    assert len(read_csv(os.path.join(root, f"{strategy}.csv"))) == 1 + 3
    assert best_steps(model_dir) == top_k_steps(model_dir, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_model_stop_training_is_agreed_by_two_multiworker_mirrored_workers(tmp_path):
    model_dir = str(tmp_path / "run")
    proc = launch_workers(
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        *SHORT,
        "--gin_bindings=train.keras_callbacks=[@keras.callbacks.EarlyStopping(), "
        "@keras.callbacks.ReduceLROnPlateau(), @keras.callbacks.CSVLogger()]",
        "--gin_bindings=keras.callbacks.EarlyStopping.min_delta=100.0",
        "--gin_bindings=keras.callbacks.EarlyStopping.patience=2",
        "--gin_bindings=keras.callbacks.ReduceLROnPlateau.min_delta=100.0",
        "--gin_bindings=keras.callbacks.ReduceLROnPlateau.patience=1",
        f"--gin_bindings=keras.callbacks.CSVLogger.filename='{tmp_path}/log.csv'",
    )
    assert "[worker 1] finished at step 60/200" in proc.stdout, proc.stdout[-3000:]
    assert os.path.exists(os.path.join(model_dir, "ckpt-60.index"))
    rows = read_csv(f"{tmp_path}/log.csv")  # the chief's only
    assert rows[0] == ["epoch", "accuracy", "learning_rate", "loss", "val_accuracy", "val_loss"] and len(rows) == 4
    assert [float(r[2]) for r in rows[1:]] == pytest.approx([2e-3, 2e-3, 2e-4])  # each epoch's rate, as fit logs it
    # ReduceLROnPlateau (factor 0.1) after epochs 1 and 2, on both workers alike (else the next step's
    # all-reduce of gradients would still agree but the weights would not: the chief's lr is checked).
    rates = {
        r["step"]: r["learning_rate"]
        for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
        if r["split"] == "train"
    }
    assert rates == pytest.approx({20: 2e-3, 40: 2e-3, 60: 2e-4})
    final = tf.train.load_checkpoint(model_dir).get_tensor("optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE")
    assert final == pytest.approx(2e-5)
    assert not trainer_pids_for(model_dir)


REFUSED = {
    "reduce_lr_on_a_schedule": (
        ["train.keras_callbacks=[@keras.callbacks.ReduceLROnPlateau()]", "make_optimizer.warmup_steps=10"],
        "ReduceLROnPlateau sets the learning rate, but the optimizer's rate is a schedule",
    ),
    "not_a_callback": (
        ["train.keras_callbacks=[@early_stopping()]"],
        "train.keras_callbacks must be a list of keras.callbacks.Callback",
    ),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, dict]:
    """Each case of REFUSED in an empty model_dir, both in one interpreter."""
    root = tmp_path_factory.mktemp("refusals")
    cases = {}
    for name, (bindings, _) in REFUSED.items():
        (root / name).mkdir()
        args = ["--gin_file=gin/single.gin", *SHORT, *[f"--gin_bindings={b}" for b in bindings]]
        cases[name] = (args, str(root / name))
    return main_in_one_process(cases, timeout=100)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.xdist_group("keras_callbacks_refusals")
@pytest.mark.parametrize("name", list(REFUSED))
def test_refusals_are_one_line_and_write_nothing(refusals, name):
    outcome, needle = refusals[name], REFUSED[name][1]
    assert outcome["code"] == 2, outcome["stderr"][-2000:]
    last = outcome["stderr"].strip().splitlines()[-1]
    assert last.startswith("error: ") and needle in last, last
    assert outcome["unchanged"]  # still empty
    assert not re.search(r"Traceback", outcome["stderr"])


def test_only_a_list_of_callbacks_the_loop_can_drive_is_taken():
    import keras

    from trainer.errors import UserError
    from trainer.extensions.keras_callbacks import check_callbacks

    logger = keras.callbacks.CSVLogger("log.csv")
    assert check_callbacks((logger,)) == [logger] and check_callbacks([]) == []
    for wrong in (logger, [logger, "early_stopping"], None):
        with pytest.raises(UserError, match="must be a list of keras.callbacks.Callback instances"):
            check_callbacks(wrong)
    for refused, instead in (
        (keras.callbacks.ModelCheckpoint("x.keras"), "ModelCheckpoint is not needed here: the run checkpoints"),
        (keras.callbacks.BackupAndRestore("x"), "BackupAndRestore is not needed here: the run resumes"),
        (keras.callbacks.TensorBoard("x"), "TensorBoard is not needed here: the run writes TensorBoard"),
    ):
        with pytest.raises(UserError, match=f"train.keras_callbacks: keras.callbacks.{instead}"):
            check_callbacks([logger, refused])
