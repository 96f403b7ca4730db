"""The gin edge in process (the fast tier's view of what tests/test_mistakes.py runs as whole
commands): every gin mistake is one UserError line naming file:line and the fix, and importing the
entry point claims nothing until its main runs. An include cycle runs gin into Python's recursion
limit, which depends on the stack the parse starts from: it is tried as a whole command."""

from __future__ import annotations

import re
import subprocess
import sys

import gin
import pytest

from tests.support import REPO, subprocess_env
from trainer import gin_flags, main
from trainer.errors import UserError


@pytest.fixture(autouse=True)
def clean_gin():
    yield
    gin.clear_config()


def refused(files, bindings=()) -> str:
    with pytest.raises(UserError) as raised:
        gin_flags.parse_gin(list(files), list(bindings))
    line = str(raised.value)
    assert "\n" not in line, line
    return line


def test_a_good_config_parses_and_binds(tmp_path):
    gin_flags.parse_gin(["gin/single.gin"], ["train.total_steps = 7"])
    assert gin.query_parameter("train.total_steps") == 7


def test_a_missing_or_absent_gin_file_names_the_fix(tmp_path):
    assert refused([]).startswith("no --gin_file given; pass one of gin/*.gin")
    assert refused([str(tmp_path / "nope.gin")]).endswith("not found; check the path (configs live in gin/)")


def test_a_syntax_error_an_unclosed_bracket_and_an_unknown_name_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("train.total_steps = 10\ntrain.global_batch_size = = 3\n")
    assert re.match(
        rf"bad gin config \({re.escape(str(bad))}:2\): .*; fix the gin file or --gin_bindings$", refused([bad])
    )
    assert "an unclosed parenthesis or bracket?" in refused(["gin/single.gin"], ["train.eval_splits = ['eval'"])
    assert "doesn't have a parameter named 'no_such_parameter'" in refused(
        ["gin/single.gin"], ["train.no_such_parameter = 1"]
    )


def test_a_retired_binding_names_the_new_form():
    line = refused(["gin/single.gin"], ["train.hooks = []"])
    assert (
        line == "train.hooks is gone: hooks and extensions are one type now; bind train.extensions = [@my_extension()]"
    )


def test_the_default_model_dir_is_fresh_under_runs():
    assert re.fullmatch(r"runs/\d{8}-\d{6}-\d+", main.default_model_dir()), main.default_model_dir()


@pytest.mark.slow
def test_an_include_cycle_names_the_loop(tmp_path):
    (tmp_path / "a.gin").write_text(f"include '{tmp_path / 'b.gin'}'\n")
    (tmp_path / "b.gin").write_text(f"include '{tmp_path / 'a.gin'}'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.main", f"--gin_file={tmp_path / 'a.gin'}", f"--model_dir={tmp_path / 'run'}"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "includes itself" in errors[0] and errors[0].endswith("remove the include that closes the loop"), errors
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
