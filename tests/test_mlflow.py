"""The MLflow hook against a real local MLflow file store (issue 13, must-show 7).

A short run, then a resume to more steps: one MLflow run holds the gin bindings as params, the
metric history exactly as metrics.jsonl has it (train at each log step, eval at each eval), and
operative_config.gin and run_record.json as artifacts. Two MultiWorkerMirrored workers log once.
Without mlflow installed, `@mlflow_hook()` is one error line naming the extra.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support import launch_workers, read_jsonl, run_main, subprocess_env

mlflow = pytest.importorskip("mlflow")
HOOK = "--gin_bindings=train.extensions=[@mlflow_hook()]"
SHORT = [
    "--gin_bindings=train.log_every_steps=20",
    "--gin_bindings=train.eval_every_steps=30",
    "--gin_bindings=train.steps_per_loop=10",
]


def store_runs(model_dir):
    """Every MLflow run in model_dir's default store, opened with mlflow's own client."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.tracking.MlflowClient(tracking_uri=f"file:{model_dir}/mlruns")
    experiment = client.get_experiment_by_name("trainer")
    return client, client.search_runs([experiment.experiment_id])


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def from_jsonl(model_dir, split: str, key: str) -> list[tuple[int, float]]:
    return sorted((r["step"], r[key]) for r in read_jsonl(model_dir / "metrics.jsonl") if r["split"] == split)


@pytest.mark.slow
def test_the_store_holds_params_metric_history_and_artifacts_of_a_resumed_run(tmp_path):
    model_dir = tmp_path / "run"
    first = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        HOOK,
        "--gin_bindings=train.total_steps=60",
        *SHORT,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        HOOK,
        "--gin_bindings=train.total_steps=90",
        *SHORT,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing from step 60" in resumed.stdout
    assert "mlflow: params train.total_steps differ from the resumed run's" in resumed.stdout

    client, runs = store_runs(model_dir)
    assert len(runs) == 1  # the resume logged into the same run
    run = runs[0]
    assert run.info.run_id == (model_dir / "mlflow_run_id").read_text().strip()
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params = run.data.params
    assert params["train.total_steps"] == "60" and params["make_optimizer.name"] == "adam"
    assert params["train.extensions"] == "[@mlflow_hook()]" and params["gin_files"] == "gin/single.gin"
    assert history(client, run.info.run_id, "train/loss") == from_jsonl(model_dir, "train", "loss")
    assert [s for s, _ in history(client, run.info.run_id, "train/loss")] == [20, 40, 60, 80, 90]
    assert history(client, run.info.run_id, "eval/accuracy") == from_jsonl(model_dir, "eval", "accuracy")
    assert [s for s, _ in history(client, run.info.run_id, "eval/accuracy")] == [30, 60, 90]
    assert "train/learning_rate" in run.data.metrics and "train/steps_per_sec" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"operative_config.gin", "run_record.json"}
    local = client.download_artifacts(run.info.run_id, "run_record.json", str(tmp_path))
    assert json.load(open(local)) == json.load(open(model_dir / "run_record.json"))
    config = open(client.download_artifacts(run.info.run_id, "operative_config.gin", str(tmp_path))).read()
    assert config == (model_dir / "operative_config.gin").read_text() and "train.total_steps = 90" in config


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_multiworker_workers_log_one_run_from_the_chief(tmp_path):
    model_dir = tmp_path / "run"
    launch_workers(
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        HOOK,
        "--gin_bindings=train.total_steps=40",
        *SHORT,
        timeout=200,
    )
    client, runs = store_runs(model_dir)
    assert len(runs) == 1
    assert history(client, runs[0].info.run_id, "train/loss") == from_jsonl(model_dir, "train", "loss")
    assert [s for s, _ in history(client, runs[0].info.run_id, "eval/loss")] == [30, 40]


@pytest.mark.slow
@pytest.mark.parametrize(
    "binding, needle",
    [
        (
            None,
            "mlflow_hook needs MLflow, which is not installed: pip install -e '.[mlflow]' (or pip install mlflow-skinny)",
        ),
        ("mlflow_hook.experiment_name=''", "mlflow_hook.experiment_name must be a non-empty string"),
    ],
)
def test_no_mlflow_or_a_bad_name_is_one_error_line_and_writes_nothing(tmp_path, binding, needle):
    hidden = tmp_path / "no_mlflow"
    hidden.mkdir()
    (hidden / "mlflow.py").write_text("raise ImportError(\"No module named 'mlflow'\")\n")
    env = subprocess_env()
    if binding is None:  # an interpreter where `import mlflow` fails as it does when it is not installed
        env["PYTHONPATH"] = os.pathsep.join([str(hidden), env["PYTHONPATH"]])
    args = [f"--gin_bindings={binding}"] if binding else []
    proc = run_main("--gin_file=gin/single.gin", f"--model_dir={tmp_path / 'run'}", HOOK, *args, env=env, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert lines == [proc.stderr.strip().splitlines()[-1]] and needle in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_the_store_is_the_binding_else_the_environment_else_the_model_dir(tmp_path, monkeypatch):
    from trainer.extensions.mlflow_tracking import tracking_uri_for

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert tracking_uri_for("runs/a", "http://mlflow:5000") == "http://mlflow:5000"
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # a server's store needs no file-store opt-in
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///tracking.db")
    assert tracking_uri_for("runs/a", None) == "sqlite:///tracking.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    assert tracking_uri_for("runs/a", None) == f"file:{tmp_path}/runs/a/mlruns"
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
