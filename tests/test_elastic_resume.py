"""Resume on another worker count: a MultiWorkerMirrored run stopped on 2 workers and continued on 1
(and back) at the same global batch is the same training; what would make it another one is refused."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

from tests.support import launch_workers, run_main
from tests.test_multiworker import model_weights, trainer_pids_for
from trainer.errors import UserError
from trainer.files import model_dir, run_record

# A tiny model and plain SGD: reduction-order differences stay at rounding size over 300 steps (with Adam
# they grow into chaos), while another data order would move the weights by far more than 1e-4.
TINY_SGD = [
    "--gin_file=gin/mwms.gin",
    "--gin_bindings=train.model_fn=@mlp",
    "--gin_bindings=mlp.hidden=(32,)",
    "--gin_bindings=make_optimizer.name='sgd'",
    "--gin_bindings=make_optimizer.learning_rate=0.1",
    "--gin_bindings=train.steps_per_loop=50",
    "--gin_bindings=train.log_every_steps=50",
    "--gin_bindings=train.checkpoint_every_steps=150",
    "--gin_bindings=train.eval_every_steps=1000",
]


def train_on(workers: int, model_dir: str, total_steps: int) -> str:
    """Trains `model_dir` to `total_steps` on 1 worker (trainer.main) or several (trainer.launch); its stdout."""
    args = [*TINY_SGD, f"--model_dir={model_dir}", f"--gin_bindings=train.total_steps={total_steps}"]
    if workers > 1:
        return launch_workers(*args, num_workers=workers, timeout=240).stdout
    proc = run_main(*args)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_continued_on_another_worker_count_ends_where_an_uninterrupted_one_does(tmp_path):
    uninterrupted = {workers: str(tmp_path / f"uninterrupted_{workers}") for workers in (1, 2)}
    for workers, directory in uninterrupted.items():
        train_on(workers, directory, 300)
    for first, then in ((2, 1), (1, 2)):
        directory = str(tmp_path / f"{first}_then_{then}")
        assert "resuming on" not in train_on(first, directory, 150)
        continued = train_on(then, directory, 300)
        line = f"resuming on {then} worker(s) (was {first}); same global batch 64, so the same updates"
        assert continued.count(line) == then, continued[-3000:]  # each worker says it, as it says what it restored
        assert "continuing from step 150" in continued
        with open(os.path.join(directory, "run_record.json")) as f:
            layouts = json.load(f)["layouts"]
        assert layouts == [
            {"from_step": 0, "num_workers": first, "num_replicas": first},
            {"from_step": 150, "num_workers": then, "num_replicas": then},
        ]
        got = model_weights(directory)
        assert len(got) == 4
        for reference in uninterrupted.values():
            expected = model_weights(reference)
            assert got.keys() == expected.keys()
            # Measured: at most 2.4e-7 (the sum over 2 replicas rounds differently from one replica's).
            for name in expected:
                np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-4, err_msg=name)
        assert not trainer_pids_for(directory)


def record(*, batch: int = 64, workers: int = 2, replicas: int | None = None, **changes) -> dict:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="out")], name="net")
    arguments = dict(strategy="multi_worker_mirrored", model=model, config_text="") | changes
    return run_record.make_record(
        global_batch_size=batch, num_workers=workers, num_replicas=replicas or workers, **arguments
    )


def test_another_worker_count_at_the_same_global_batch_is_allowed_printed_and_recorded(tmp_path):
    directory = str(tmp_path)
    model_dir.prepare(directory, record(workers=2), is_chief=True, start_step=0)
    printed = []
    one_worker = record(workers=1)
    run_record.check_resume(directory, one_worker, allow_changes=False, print_fn=printed.append)
    assert printed == ["resuming on 1 worker(s) (was 2); same global batch 64, so the same updates"]
    model_dir.prepare(directory, one_worker, is_chief=False, start_step=150)  # only the chief writes
    assert len(run_record.read_record(directory)["layouts"]) == 1
    model_dir.prepare(directory, one_worker, is_chief=True, start_step=150)
    model_dir.prepare(directory, one_worker, is_chief=True, start_step=200)  # the same counts: nothing added
    grown = record(workers=2, replicas=4)
    run_record.check_resume(directory, grown, allow_changes=False, print_fn=printed.append)
    assert printed[-1] == (
        "resuming on 2 worker(s) with 4 replica(s) (was 1 worker(s)); same global batch 64, so the same updates"
    )
    model_dir.prepare(directory, grown, is_chief=True, start_step=300)
    layouts = run_record.read_record(directory)["layouts"]
    assert layouts == [
        {"from_step": 0, "num_workers": 2, "num_replicas": 2},
        {"from_step": 150, "num_workers": 1, "num_replicas": 1},
        {"from_step": 300, "num_workers": 2, "num_replicas": 4},
    ]
    # Rolled back to ckpt-150 on one worker: the layouts from a later step are gone with the steps.
    model_dir.prepare(directory, record(workers=1), is_chief=True, start_step=150)
    assert run_record.read_record(directory)["layouts"] == layouts[:2]


def test_a_resume_that_would_change_the_global_batches_is_still_refused(tmp_path):
    directory = str(tmp_path)
    model_dir.prepare(directory, record(workers=2), is_chief=True, start_step=0)
    with pytest.raises(UserError, match=r"\(global_batch_size 64 -> 32\); resume with the original settings"):
        run_record.check_resume(directory, record(workers=1, batch=32), allow_changes=False)
    # Each worker reading its own files: the global batch of a step depends on the worker count.
    by_file = record(workers=1, batches_independent_of_workers=False)
    with pytest.raises(UserError, match=r"\(2 worker\(s\) -> 1 worker\(s\), whose global batches hold other examples"):
        run_record.check_resume(directory, by_file, allow_changes=False)
    printed = []
    run_record.check_resume(directory, by_file, allow_changes=True, print_fn=printed.append)
    assert printed == [
        "resuming on 1 worker(s) (was 2), with train.allow_resume_changes: the global batches change from here on"
    ]
    run_record.check_resume(directory, record(workers=2, batches_independent_of_workers=False), allow_changes=False)
    # Parameter servers: each worker reads its own stream and updates arrive asynchronously, as before.
    ps = str(tmp_path / "ps")
    model_dir.prepare(ps, record(strategy="parameter_server", replicas=1), is_chief=True, start_step=0)
    run_record.check_resume(
        ps, record(strategy="parameter_server", workers=3, replicas=1), allow_changes=False, print_fn=printed.append
    )
    assert printed[-1] == (
        "resuming on 3 worker(s) with 1 replica(s) (was 2 worker(s) with 1 replica(s)); parameter_server updates "
        "are asynchronous, so the steps differ from here on anyway"
    )


def test_a_run_on_the_data_service_may_change_its_worker_count(tmp_path):
    # The service hands out batches in its own order: another worker count changes nothing it guaranteed.
    directory = str(tmp_path)
    model_dir.prepare(directory, record(workers=2, data_service=True), is_chief=True, start_step=0)
    printed = []
    served = record(workers=1, batches_independent_of_workers=False, data_service=True)
    run_record.check_resume(directory, served, allow_changes=False, print_fn=printed.append)
    assert printed == [
        "resuming on 1 worker(s) (was 2); the tf.data service hands out the batches in its own order, so the "
        "steps differ anyway"
    ]
