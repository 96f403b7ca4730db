"""--mode=evaluate: a checkpoint evaluated again gives, bit for bit, the results the run logged when it
wrote it (raw, EMA and SWA weights; single device, mirrored, central storage, MultiWorkerMirrored as one and
as 2 launched workers, parameter servers on their embedded cluster), printed, appended to metrics.jsonl
marked `"reevaluated"` and written to TensorBoard under reeval/; a mistake is one line, nothing written."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support import main_in_one_process, read_jsonl, refused_run, run_main, run_module, tree_digest
from tests.test_tensorboard import _accumulator, _series
from trainer.distribution import early_isolation
from trainer.errors import UserError
from trainer.files.metrics_log import read_history
from trainer.run.evaluate import plan
from trainer.run.settings import Settings
from trainer.task import models

SHORT = [
    f"--gin_bindings={b}"
    for b in (
        "train.model_fn=@mlp",
        "train.total_steps=40",
        "train.eval_every_steps=20",
        "train.checkpoint_every_steps=20",
        "train.steps_per_loop=10",
        "train.log_every_steps=20",
        "train.check_loss_scaling=False",  # the guard's extra traces change no result here
    )
]
EMA = "--gin_bindings=train.ema_decay=0.9"
SWA = ["--gin_file=experiments/swa/swa.gin", "--gin_bindings=swa.start_step=10", "--gin_bindings=swa.every_steps=10"]


def logged(model_dir: str) -> dict[tuple[int, str], dict]:
    """The run's own inline evals by (step, split): not the sidecar's (with a count), not re-evaluations."""
    return {
        (r["step"], r["split"]): r
        for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
        if r["split"] not in ("train", "resumed") and "num_examples" not in r and "reevaluated" not in r
    }


def reevaluated(model_dir: str, name: str) -> dict[tuple[int, str], dict]:
    """The re-evaluation lines of checkpoint `name`, without their marker, by (step, split)."""
    lines = [r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r.get("reevaluated") == name]
    return {(r["step"], r["split"]): {k: v for k, v in r.items() if k != "reevaluated"} for r in lines}


def assert_reevaluated_exactly(model_dir: str, name: str, keys: set[tuple[int, str]]) -> None:
    again, before = reevaluated(model_dir, name), logged(model_dir)
    assert set(again) == keys, (sorted(again), sorted(keys))
    for key in keys:
        assert again[key] == before[key], (key, again[key], before[key])  # bit-equal, every metric


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("single_runs")
def test_the_newest_checkpoint_evaluates_as_the_run_logged_it_and_mistakes_write_nothing(trained_single_dir, tmp_path):
    """tests/conftest.py's short single-device run (eval and checkpoints at 30 and 60), copied: others read it."""
    model_dir = str(shutil.copytree(trained_single_dir, tmp_path / "copy"))
    newest = run_main("--gin_file=gin/single.gin", f"--model_dir={model_dir}", "--mode=evaluate")
    assert newest.returncode == 0, newest.stderr[-3000:]
    assert "evaluating ckpt-60 (step 60) on eval with the model weights, strategy 'default'" in newest.stdout
    assert "eval at step 60: " in newest.stdout
    assert f'("reevaluated": "ckpt-60") and TensorBoard {model_dir}/reeval' in newest.stdout
    assert_reevaluated_exactly(model_dir, "ckpt-60", {(60, "eval")})
    series = _series(_accumulator(os.path.join(model_dir, "reeval", "eval")), "accuracy")  # TensorBoard: reeval/eval
    assert series == pytest.approx({60: logged(model_dir)[(60, "eval")]["accuracy"]}, rel=1e-6)
    # The history readers (trainer.plot's) still see one line per (step, split), the same values.
    history = {(r["step"], r["split"]): r["accuracy"] for r in read_history(model_dir) if r["split"] != "train"}
    assert history == {key: r["accuracy"] for key, r in logged(model_dir).items()}

    before = tree_digest(model_dir)
    unknown = run_main("--gin_file=gin/single.gin", f"--model_dir={model_dir}", "--mode=evaluate", "--checkpoint=7")
    assert unknown.returncode == 2, unknown.stderr[-3000:]
    assert unknown.stderr.strip().splitlines() == [
        f"error: --checkpoint=7: {model_dir} has no ckpt-7 (it has ckpt-30, ckpt-60); name one of those, or a "
        "checkpoint's path"
    ]
    assert tree_digest(model_dir) == before
    line = refused_run(tmp_path, "--gin_file=gin/single.gin", "--checkpoint=ckpt-20")
    assert line == (
        "error: --checkpoint is an option of --mode=evaluate|predict, not of --mode=train; drop it or add --mode=evaluate"
    )


def test_the_checkpoint_splits_and_weights_are_resolved_or_refused_before_anything_is_built(tmp_path):
    """What the CLI passes on, against a directory of real (tiny) checkpoints 20 and 40."""
    import tensorflow as tf

    model_dir = str(tmp_path / "run")
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(v=tf.Variable(1.0)), model_dir, None, checkpoint_name="ckpt"
    )
    for step in (20, 40):
        manager.save(checkpoint_number=step)
    before = tree_digest(model_dir)
    run = Settings(model_dir=model_dir, model_fn=models.mlp, ema_decay=0.9)
    assert plan(run).name == "ckpt-40" and plan(run).weights == ("model", "ema")
    for given in ("ckpt-20", "20", os.path.join(model_dir, "ckpt-20")):
        assert plan(run, checkpoint=given).path == os.path.join(model_dir, "ckpt-20"), given
    assert plan(run, checkpoint=model_dir).name == "ckpt-40"  # a directory: its newest
    copy = shutil.copytree(model_dir, tmp_path / "elsewhere")
    assert plan(run, checkpoint=str(copy)).name == os.path.join(copy, "ckpt-40")  # outside: its path
    assert plan(run, splits=["train", "eval", "train"]).settings.eval_split_names == ("train", "eval")
    refusals = {
        "no checkpoint in": dict(settings=Settings(model_dir=str(tmp_path / "empty"), model_fn=models.mlp)),
        "--checkpoint=ckpt-7: .* has no ckpt-7 (it has ckpt-20, ckpt-40)": dict(settings=run, checkpoint="ckpt-7"),
        "no checkpoint there": dict(settings=run, checkpoint=str(tmp_path / "none")),
        "the input function has no split 'test' (it has train, eval)": dict(settings=run, splits=["test"]),
        "--weights=swa: this run has no such weights (it evaluates model, ema)": dict(settings=run, weights=["swa"]),
        "--weights=ema: this run has no such weights (it evaluates model)": dict(
            settings=Settings(model_dir=model_dir, model_fn=models.mlp), weights=["ema"]
        ),
    }
    for message, arguments in refusals.items():
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            plan(arguments.pop("settings"), **arguments)
    assert tree_digest(model_dir) == before and not os.path.exists(tmp_path / "empty")
    # Under gin/ps.gin it isolates itself as training does, before TensorFlow starts threads: its
    # embedded cluster is closed to the network (tests/test_network.py).
    assert early_isolation.expects_embedded_cluster(["--gin_file=gin/ps.gin", "--mode=evaluate"])


def synchronous_args(mode: str) -> list[str]:
    """A short run under `mode` with EMA, or (mirrored) the SWA extension of experiments/swa."""
    return [f"--gin_file=gin/{mode}.gin", *SHORT, *(SWA if mode == "mirrored" else [EMA])]


# Central storage names its weights and splits; the others evaluate every weights on every split.
CHOSEN = {"central_storage": ["--weights=ema", "--eval_splits=eval"]}
EVALUATE_20 = ["--mode=evaluate", "--checkpoint=ckpt-20"]


@pytest.fixture(scope="module")
def synchronous_runs(tmp_path_factory) -> tuple[str, dict]:
    """Mirrored and central storage each trained, then its ckpt-20 evaluated, in one interpreter
    (main_in_one_process: one TensorFlow start instead of four). (their folder, outcomes by
    "mode/train" and "mode/evaluate"); each mode's model_dir is <folder>/<mode>."""
    root = str(tmp_path_factory.mktemp("synchronous"))
    cases = {}
    for mode in ("mirrored", "central_storage"):
        model_dir = os.path.join(root, mode)
        cases[f"{mode}/train"] = (synchronous_args(mode), model_dir)
        cases[f"{mode}/evaluate"] = ([*synchronous_args(mode), *EVALUATE_20, *CHOSEN.get(mode, [])], model_dir)
    return root, main_in_one_process(cases)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("synchronous_runs")
@pytest.mark.parametrize("mode", ["mirrored", "central_storage", "mwms"])
def test_each_synchronous_strategy_evaluates_a_checkpoint_as_it_logged_it(request, tmp_path, mode):
    """With EMA, or (mirrored) the SWA extension of experiments/swa, a user's AveragedWeights: an older
    checkpoint, every weights by default; central storage names its weights and splits."""
    chosen = CHOSEN.get(mode, [])
    if mode == "mwms":  # MultiWorkerMirrored in processes of its own
        model_dir = str(tmp_path / "run")
        args = [*synchronous_args(mode), f"--model_dir={model_dir}"]
        trained = run_main(*args, timeout=150)
        assert trained.returncode == 0, trained.stderr[-3000:]
        again = run_main(*args, *EVALUATE_20, *chosen, timeout=150)
        assert again.returncode == 0, again.stderr[-3000:]
        stdout = again.stdout
    else:
        root, outcomes = request.getfixturevalue("synchronous_runs")
        model_dir = os.path.join(root, mode)
        for step in ("train", "evaluate"):
            assert outcomes[f"{mode}/{step}"]["code"] == 0, outcomes[f"{mode}/{step}"]["stderr"][-3000:]
        stdout = outcomes[f"{mode}/evaluate"]["stdout"]
    suffix = "_swa" if mode == "mirrored" else "_ema"
    assert (f"eval ({suffix[1:].upper()}) at step 20: " in stdout) and (("eval at step 20: " in stdout) == (not chosen))
    expected = {(20, f"eval{suffix}")} | (set() if chosen else {(20, "eval")})
    assert_reevaluated_exactly(model_dir, "ckpt-20", expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("launched_mwms_run")
def test_two_launched_workers_evaluate_a_checkpoint_as_they_logged_it(launched_mwms_run, tmp_path):
    """The 2-worker run of tests/conftest.py (eval and checkpoints at 200 and 400), copied: its own tests
    read the original."""
    model_dir = str(shutil.copytree(launched_mwms_run.model_dir, tmp_path / "run"))
    proc = run_module(
        "trainer.launch",
        "--num_workers=2",
        "--",
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        "--mode=evaluate",
        "--checkpoint=ckpt-200",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on eval with the model weights, strategy 'multi_worker_mirrored'" in proc.stdout
    assert "[worker 1] eval at step" not in proc.stdout  # the chief prints and writes alone
    assert_reevaluated_exactly(model_dir, "ckpt-200", {(200, "eval")})


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("embedded_ps_run")
def test_parameter_servers_evaluate_a_checkpoint_on_their_embedded_cluster(embedded_ps_run, tmp_path):
    """The embedded-cluster run of tests/conftest.py (600 steps, eval and checkpoints every 200), copied."""
    model_dir = str(shutil.copytree(embedded_ps_run.model_dir, tmp_path / "run"))
    proc = run_main("--gin_file=gin/ps.gin", f"--model_dir={model_dir}", "--mode=evaluate", "--checkpoint=200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "local cluster: ps 0 pid" in proc.stdout and "strategy 'parameter_server'" in proc.stdout
    assert_reevaluated_exactly(model_dir, "ckpt-200", {(200, "eval")})
