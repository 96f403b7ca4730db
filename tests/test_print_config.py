"""Config discovery: --print_config resolves every gin file without training, and
`python -m trainer.configurables` lists every registered name."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO, run_main, subprocess_env

GIN_FILES = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "gin", "*.gin")))
EXTRA = {"gin/mirrored.gin": ["--gin_bindings=train.total_steps=7", "--gin_bindings=make_optimizer.name='sgd'"]}


def expected_bindings(path: str, found: dict[str, tuple[str, str]] | None = None) -> dict[str, tuple[str, str]]:
    """`selector.param` -> (value text, 'file:line') of every binding in a gin file and its
    includes, the last one winning (read here with a regex, independently of trainer)."""
    found = {} if found is None else found
    with open(os.path.join(REPO, path)) as f:
        for number, line in enumerate(f, 1):
            text = line.split("#")[0].strip()
            if include := re.fullmatch(r"include\s+'([^']+)'", text):
                expected_bindings(include.group(1), found)
            elif binding := re.fullmatch(r"([\w./]+\.\w+)\s*=\s*(.+)", text):
                found[binding.group(1)] = (binding.group(2), f"{path}:{number}")
    return found


# Runs trainer.main's `run` under absl, with its flag parser, as its `main` does, once per gin file in
# one fresh interpreter (TensorFlow's import dominates, so once, not once per file; `main` itself would
# end the process after the first), then reports each exit code and output, and whether TensorFlow's
# runtime (the eager context) was ever started.
PRINT_EVERY_FILE = """
import contextlib, io, json, sys
from absl import app, flags
from trainer import main
main.define_flags()
results = {}
for path, model_dir, extra in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    import gin; gin.clear_config()
    sys.argv = ['trainer.main', '--gin_file=' + path, '--model_dir=' + model_dir, '--print_config', *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            app.run(main.run, flags_parser=main.parse_flags)
        except SystemExit as e:
            code = e.code or 0
    results[path] = {'code': code, 'out': out.getvalue()}
from tensorflow.python.eager import context
print(json.dumps({'files': results, 'tf_started': context.context()._initialized}))
"""


def _check_output(path: str, out: str, extra: list[str]) -> None:
    assert not re.search(r"^(training |step \d|model_dir:)", out, re.M), path  # nothing ran
    expected = expected_bindings(path)
    for flag in extra:
        key, value = flag.removeprefix("--gin_bindings=").split("=", 1)
        expected[key] = (value, "--gin_bindings")
    assert expected, path
    for key, (value, source) in expected.items():
        line = rf"^{re.escape(key)} = {re.escape(value)}\s+# {re.escape(source)}$"
        assert re.search(line, out, re.M), (path, key, value, source)
    # Parameters nobody bound show their defaults, and every registered name has a section.
    assert re.search(r"^train\.keep_checkpoints = 3\s+# default$", out, re.M)
    for name in ("train", "cnn", "digits", "make_optimizer", "progress_logger", "profiler_hook", "eval_continuous"):
        assert re.search(rf"^# {name}: ", out, re.M), (path, name)


@pytest.mark.slow
def test_print_config_of_every_gin_file_shows_each_bound_value_and_trains_nothing(tmp_path):
    assert len(GIN_FILES) >= 5, GIN_FILES
    jobs = [(path, str(tmp_path / os.path.basename(path)), EXTRA.get(path, [])) for path in GIN_FILES]
    proc = subprocess.run(
        [sys.executable, "-c", PRINT_EVERY_FILE, json.dumps(jobs)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["tf_started"] is False  # not for the PS config either: no local cluster, no devices
    assert sorted(report["files"]) == GIN_FILES
    for path, model_dir, extra in jobs:
        result = report["files"][path]
        assert result["code"] == 0, (path, result["out"][-2000:])
        assert not os.path.exists(model_dir), path
        _check_output(path, result["out"], extra)


@pytest.mark.slow
def test_print_config_from_the_command_line(tmp_path):
    model_dir = tmp_path / "never"
    extra = EXTRA["gin/mirrored.gin"]
    proc = run_main("--gin_file=gin/mirrored.gin", f"--model_dir={model_dir}", "--print_config", *extra, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not model_dir.exists()
    _check_output("gin/mirrored.gin", proc.stdout, extra)


def test_configurables_lists_every_registered_name_with_parameters_and_doc(capsys):
    import gin

    from trainer import configurables
    from trainer.tools import gin_config

    @gin.configurable("listed_by_registry_test")
    def late_addition(alpha=1.5):
        """Registered after trainer.configurables, as a user's module would be."""
        return alpha

    configurables.main()
    listing = capsys.readouterr().out
    names = [c.name for c in gin_config.registered_configurables()]
    # Names registered with a module (keras.callbacks.EarlyStopping) are listed by gin's shortest unique form.
    short = {name.rsplit(".", 1)[-1] for name in names}
    assert {
        *(n.rsplit(".", 1)[-1] for n in configurables.REGISTERED),
        "progress_logger",
        "listed_by_registry_test",
    } <= short
    for name in names:
        assert re.search(rf"^{re.escape(name)}\(.*\)\n    \S", listing, re.M), name
    assert "listed_by_registry_test(alpha=1.5)\n    Registered after trainer.configurables" in listing
    assert "profiler_hook(steps=(10, 20), all_workers=False)" in listing
    assert "progress_logger(live=None, refresh_secs=0.5, all_workers=False)" in listing


def test_the_resolved_config_and_the_hparams_come_from_gin_in_process(tmp_path, monkeypatch):
    """describe_config and hparams (trainer/tools/gin_config.py) on a file that includes a repository
    config, binds a macro and is overridden by a binding: each value with where it came from."""
    import gin

    from trainer import configurables  # noqa: F401  (registers every name)
    from trainer.tools import gin_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.gin").write_text("include 'gin/single.gin'\nLR = 0.25\nmake_optimizer.learning_rate = %LR\n")
    files, bindings = ["my.gin"], ["train.total_steps = 7", "train.keras_callbacks = []"]
    gin.clear_config()
    try:
        gin.add_config_file_search_path(REPO)
        gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
        text = gin_config.describe_config(files, bindings, search_paths=[REPO])
        hparams = gin_config.hparams(files, bindings, search_paths=[REPO])
    finally:
        gin.clear_config()
    assert text.startswith("# Resolved config of my.gin with 2 --gin_bindings; after each value, where it came from.\n")
    assert re.search(r"^train\.total_steps = 7 +# --gin_bindings$", text, re.M)
    assert re.search(r"^make_optimizer\.learning_rate = %LR +# my\.gin:3$", text, re.M)
    assert re.search(r"^LR = 0\.25 +# my\.gin:2$", text, re.M)
    assert re.search(r"^train\.strategy = 'default' +# \S*gin/single\.gin:\d+$", text, re.M)
    assert re.search(r"^train\.model_dir = <.+> +# set by trainer\.main$", text, re.M)
    assert re.search(r"^\S+ = .+ +# default$", text, re.M) and "# ----- not bound or referenced" in text
    assert hparams["gin_files"] == "my.gin" and hparams["train.total_steps"] == 7
    assert hparams["make_optimizer.learning_rate"] == 0.25  # the macro's value
    assert hparams["train.keras_callbacks"] == "[]" and hparams["train.strategy"] == "default"
