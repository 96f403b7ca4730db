"""The profiler hook traces exactly the steps asked for, where TensorBoard's profile plugin looks."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest

from tests.support import read_jsonl


@pytest.mark.slow
@pytest.mark.xdist_group("single_runs")
def test_trace_lands_where_the_profile_plugin_reads_it(profiled_run):
    from trainer.extensions.profiler import trace_files

    model_dir, proc = profiled_run
    # The loop calls ended exactly at steps 7 and 13 (not boundaries of any other hook: logs
    # every 10, eval every 20, steps_per_loop 25), so the trace holds steps 8..13.
    assert f"profiler: traced steps 8-13 into {model_dir}/plugins/profile" in proc.stdout, proc.stdout
    traces = trace_files(model_dir)
    assert len(traces) == 1, traces
    # <logdir>/plugins/profile/<profile run>/<host>.xplane.pb: the layout the plugin globs.
    run_dir = os.path.dirname(traces[0])
    assert os.path.dirname(run_dir) == os.path.join(model_dir, "plugins", "profile")
    assert os.path.getsize(traces[0]) > 10_000  # ops of several steps, not an empty session
    train_steps = [r["step"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "train"]
    assert train_steps == [10, 20, 30, 40]  # the extra boundaries change no record


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("xprof") is None,
    reason="the profile plugin (pip install -e '.[profile]') is not installed",
)
@pytest.mark.xdist_group("single_runs")
def test_the_profile_plugin_itself_lists_the_trace(profiled_run):
    from xprof import profile_plugin

    model_dir, _ = profiled_run
    parent = os.path.dirname(model_dir)
    for logdir, prefix in ((model_dir, ""), (parent, os.path.basename(model_dir) + "/")):
        context = types.SimpleNamespace(
            logdir=logdir, data_provider=None, flags=types.SimpleNamespace(master_tpu_unsecure_channel="")
        )
        runs = list(profile_plugin.ProfilePlugin(context).generate_runs())
        assert len(runs) == 1 and runs[0].startswith(prefix), runs


def test_bad_steps_are_a_user_error_and_boundaries_are_exact():
    from trainer.errors import UserError
    from trainer.extensions.profiler import Profiler

    for bad in [(5, 5), (-1, 3), (9, 2), (3,), "10-20"]:
        with pytest.raises(UserError):
            Profiler(bad)
    hook = Profiler((7, 13))
    assert [hook.steps_to_boundary(s) for s in (0, 6, 7, 10, 13, 20)] == [7, 1, 6, 3, None, None]
