"""The comparisons: in this process against Keras 3 fit, or across processes (tf_keras fit,
other replica counts), each returning an Outcome (or a MetricOutcome by final eval metrics)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from trainer.errors import UserError
from trainer.run.settings import Settings
from trainer.run.setup import setup
from trainer.tools.parity import runs
from trainer.tools.parity.config import ParityConfig
from trainer.tools.parity.outcome import MetricOutcome, Outcome, describe, max_abs_difference


def compare_in_process(settings: Settings, config: ParityConfig, steps: int, atol: float) -> Outcome:
    """Ours and Keras 3 fit in this process, on the configured strategy, from the same state."""
    from trainer.tools.parity import fit

    runtime, task = setup(settings)
    fit_task = fit.build_fit_task(runtime, task.input, settings)
    model, fit_model = runs.single_model(task), runs.single_model(fit_task)
    runs.copy_state(model, fit_model)
    initial = runs.weights(model)
    ours = runs.run_ours(runtime, task, settings, steps)
    fit_losses = fit.run_fit(runtime, fit_task, settings, config, steps)
    return Outcome(
        title=f"{describe(settings, runtime.num_replicas)}: TrainLoop vs Keras 3 fit",
        columns=["ours", "Keras 3 fit"],
        losses=[ours, fit_losses],
        max_dw=max_abs_difference(runs.weights(model), runs.weights(fit_model)),
        atol=atol,
        num_params=sum(w.size for w in initial),
    )


def _check_exit(code: int, what: str, whose: str) -> None:
    if code == 2:
        raise UserError(f"the {what} stopped on a user mistake (see {whose} output above)")
    if code:
        raise RuntimeError(f"the {what} failed with exit code {code} (see {whose} output above)")


def _ours_and_fit(work_dir: str) -> tuple[dict, dict, dict, dict]:
    ours, ours_arrays = runs.load(os.path.join(work_dir, "ours"))
    fit, fit_arrays = runs.load(os.path.join(work_dir, "tf_keras_fit"))
    return ours, ours_arrays, fit, fit_arrays


def compare_multi_worker(settings: Settings, steps: int, atol: float, num_workers: int, gin_args: list[str]) -> Outcome:
    """Ours on `num_workers` processes, then tf_keras fit on as many, from ours' initial weights."""
    from trainer import launch

    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        common = [*gin_args, f"--steps={steps}", f"--work_dir={work_dir}"]
        for role in ("ours", "tf_keras_fit"):
            _check_exit(
                launch.launch(num_workers, 0, [*common, f"--role={role}"], module="trainer.parity"),
                f"{role} workers",
                "their",
            )
        ours, ours_arrays, fit, fit_arrays = _ours_and_fit(work_dir)
    return Outcome(
        title=(f"{describe(settings, ours['replicas'])} in {num_workers} worker processes: TrainLoop vs tf_keras fit"),
        columns=["ours", "tf_keras fit"],
        losses=[ours["losses"], fit["losses"]],
        max_dw=max_abs_difference(ours_arrays["final"], fit_arrays["final"]),
        atol=atol,
        num_params=sum(w.size for w in ours_arrays["initial"]),
    )


def compare_replicas(settings: Settings, steps: int, atol: float, counts: list[int], gin_args: list[str]) -> Outcome:
    """Ours on each replica count in a fresh process, all from the first one's initial weights."""
    results = []
    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        for count in counts:
            command = [
                sys.executable,
                "-m",
                "trainer.parity",
                *gin_args,
                f"--steps={steps}",
                f"--work_dir={work_dir}",
                "--role=replicas",
                f"--num_replicas={count}",
            ]
            proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode:
                print(proc.stdout, end="")
                if proc.returncode == 2:
                    raise UserError(proc.stdout.strip().splitlines()[-1].removeprefix("error: "))
                raise RuntimeError(f"the {count}-replica run failed with exit code {proc.returncode}")
            results.append(runs.load(os.path.join(work_dir, f"replicas{count}")))
    reference = results[0][1]["final"]
    return Outcome(
        title=(
            f"{settings.strategy} config on {', '.join(map(str, counts))} logical-CPU replicas "
            f"(MirroredStrategy), global batch {settings.global_batch_size}: same losses and weights"
        ),
        columns=[f"{c} replica(s)" for c in counts],
        losses=[meta["losses"] for meta, _ in results],
        max_dw=max(max_abs_difference(reference, arrays["final"]) for _, arrays in results[1:]),
        atol=atol,
        num_params=sum(w.size for w in reference),
    )


def compare_parameter_server(
    settings: Settings,
    config: ParityConfig,
    steps: int,
    atol: float,
    gin_args: list[str],
    *,
    metric_steps: int,
    metric_atol: float,
) -> Outcome | MetricOutcome:
    """Ours, then tf_keras fit, each in a subprocess that runs its own embedded ps cluster.

    One worker: step by step, exact. More: `metric_steps` steps each, then the final eval
    metric `config.metric` of both, computed here with the configured eval step.
    """
    from trainer import configurables

    if os.environ.get("TF_CONFIG", "").strip():
        raise UserError("parity for parameter_server starts its own local clusters; unset TF_CONFIG")
    workers = configurables.local_cluster().num_workers
    exact = workers == 1
    if not exact:
        steps = metric_steps
    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        for role in ("ours", "tf_keras_fit"):
            command = [
                sys.executable,
                "-m",
                "trainer.parity",
                *gin_args,
                f"--steps={steps}",
                f"--work_dir={work_dir}",
                f"--role={role}",
            ]
            _check_exit(subprocess.run(command).returncode, f"{role} run", "its")
        ours, ours_arrays, fit, fit_arrays = _ours_and_fit(work_dir)
    title = (
        f"parameter_server, {workers} worker(s), global batch {settings.global_batch_size}: TrainLoop vs tf_keras fit"
    )
    if exact:
        return Outcome(
            title=title,
            columns=["ours", "tf_keras fit"],
            losses=[ours["losses"], fit["losses"]],
            max_dw=max_abs_difference(ours_arrays["final"], fit_arrays["final"]),
            atol=atol,
            num_params=sum(w.size for w in ours_arrays["initial"]),
        )
    sides = []
    for meta, arrays in ((ours, ours_arrays), (fit, fit_arrays)):
        metrics = runs.evaluate(settings, arrays["final"])
        if config.metric not in metrics:
            raise UserError(
                f"parity.metric {config.metric!r} is not an output of train.eval_step_fn "
                f"(it returns {', '.join(sorted(metrics))})"
            )
        sides.append({"optimizer iterations": meta["iterations"], "last train loss": meta["losses"][-1], **metrics})
    return MetricOutcome(
        title=f"{title}, by final eval metrics",
        steps=steps,
        tolerance=metric_atol,
        ours=sides[0],
        fit=sides[1],
        metric=config.metric,
    )
