"""Config discovery: --print_config resolves every gin file without training, and
`python -m trainer.configurables` lists every registered name."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

from tests.support import REPO, run_python, subprocess_env

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


def test_print_config_of_every_gin_file_shows_each_bound_value_and_trains_nothing(tmp_path):
    assert len(GIN_FILES) >= 5, GIN_FILES
    procs = {}
    for path in GIN_FILES:  # all at once: each is mostly TensorFlow's import
        model_dir = tmp_path / os.path.basename(path)
        procs[path] = (model_dir, subprocess.Popen(
            [sys.executable, "-m", "trainer.main", f"--gin_file={path}", f"--model_dir={model_dir}",
             "--print_config", *EXTRA.get(path, [])],
            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    for path, (model_dir, proc) in procs.items():
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        assert proc.returncode == 0, (path, err[-3000:])
        assert not model_dir.exists(), path
        assert not re.search(r"^(training |step \d|model_dir:)", out, re.M), path  # nothing ran
        expected = expected_bindings(path)
        for flag in EXTRA.get(path, []):
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


def test_print_config_does_not_start_tensorflow():
    result = run_python(
        "import json, sys\n"
        "sys.argv = ['main', '--gin_file=gin/ps.gin', '--print_config']\n"
        "from trainer import main\n"
        "try:\n    main.main()\nexcept SystemExit as e:\n    code = e.code or 0\n"
        "from tensorflow.python.eager import context\n"
        "print(json.dumps({'code': code, 'started': context.context()._initialized}))\n",
        timeout=180,
    )
    assert result == {"code": 0, "started": False}


def test_configurables_lists_every_registered_name_with_parameters_and_doc(capsys):
    import gin

    from trainer import configurables, gin_config

    @gin.configurable("listed_by_registry_test")
    def late_addition(alpha=1.5):
        """Registered after trainer.configurables, as a user's module would be."""
        return alpha

    configurables.main()
    listing = capsys.readouterr().out
    names = [c.name for c in gin_config.registered_configurables()]
    assert {*configurables.REGISTERED, "progress_logger", "listed_by_registry_test"} <= set(names)
    for name in names:
        assert re.search(rf"^{re.escape(name)}\(.*\)\n    \S", listing, re.M), name
    assert "listed_by_registry_test(alpha=1.5)\n    Registered after trainer.configurables" in listing
    assert "profiler_hook(steps=(10, 20))" in listing
    assert "progress_logger(live=None, refresh_secs=0.5, all_workers=False)" in listing
