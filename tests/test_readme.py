"""Every command README.md shows, run as written: read from README.md itself (so the test follows
the page), with relative paths, from a copy of the repository's root and from another working
directory, shortened only by `--gin_bindings` appended at the end (fewer steps).

The commands are found in the page's `sh` blocks, in the "Every mode" table and in its prose
(inline code starting with `python -m` or `VAR=... python`); the files its examples write
(`# my_steps.py`, `# my.gin`, the extension) are written from its code blocks. A command that is
not run here says why in `NOT_RUN`, and any other command the page gains is run, so nothing is
skipped silently. Relative `--model_dir`s land in the temporary directories, never in the repository.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from tests.support import REPO, read_jsonl, subprocess_env
from tests.test_fashion_mnist import _write_fashion_mnist

README = os.path.join(REPO, "README.md")
# What the page shows that this test does not run, and why (the pip lines are checked by
# tests/test_docs.py: each installs from the repository).
NOT_RUN = {
    "pip install -e .": "installs the project: done once before the suite runs",
    "pip install -e '.[test]'": "installs the test extra: done once before the suite runs",
    "python -m pytest -q": "the suite this test is part of",
    "python -m pytest -q --durations=20": "the suite this test is part of, listing its slowest tests",
    'python -m pytest -q -m "not slow"': "the suite's fast tier, a part of the suite this test is part of",
    "ruff format trainer tests experiments": "formats the code: .ci/run checks the format (tests/test_docs.py)",
    "ruff check trainer tests experiments": "the style check .ci/run runs first (tests/test_docs.py)",
}
# Shorter runs: the commands' own configs, fewer steps (appended, so they win).
SHORT = (
    "train.total_steps=40",
    "train.steps_per_loop=20",
    "train.log_every_steps=20",
    "train.checkpoint_every_steps=20",
    "train.eval_every_steps=20",
)
LONGER = "train.total_steps=60"  # the rerun that continues from step 40
TIMEOUT = 300


def bindings(*values: str) -> list[str]:
    return [f"--gin_bindings={value}" for value in values]


class Page:
    """What README.md shows: commands by section, the files of its examples, gin snippets."""

    def __init__(self, text: str):
        self.commands: list[tuple[str, str]] = []  # (section, command)
        self.table: dict[str, str] = {}  # the "Every mode" table: mode -> command
        self.files: dict[str, str] = {}  # `# name.ext` code blocks: name -> text
        self.gin_snippets: list[str] = []  # unnamed blocks of gin statements
        self.fragments: list[str] = []  # inline `--gin_bindings=...` examples
        section, block, language, prose = "", None, "", []
        for line in text.splitlines():
            if block is not None:
                if line.startswith("```"):
                    self._block(section, language, block)
                    block = None
                else:
                    block.append(line)
            elif line.startswith("```"):
                self._prose(section, " ".join(prose))
                prose, block, language = [], [], line[3:].strip()
            elif line.startswith("## "):
                self._prose(section, " ".join(prose))
                prose, section = [], line[3:].strip()
            elif match := re.fullmatch(r"\| (.+?) \| `(.+)` \|", line):
                self.table[match.group(1)] = match.group(2)
                self.commands.append((section, match.group(2)))
            else:
                prose.append(line)
        self._prose(section, " ".join(prose))

    def _block(self, section: str, language: str, lines: list[str]) -> None:
        name = re.fullmatch(r"# ([\w.]+\.(?:py|gin))", lines[0].strip()) if lines else None
        if name:
            self.files[name.group(1)] = "\n".join(lines) + "\n"
        elif language == "sh":
            for line in lines:
                self.commands += [(section, part.strip()) for part in line.split("&&") if part.strip()]
        elif not language and all(
            re.fullmatch(r"import [\w.]+|include '.+'|[\w.]+ = .+|#.*", line.strip()) for line in lines if line.strip()
        ):
            self.gin_snippets.append("\n".join(lines))

    def _prose(self, section: str, text: str) -> None:
        for span in re.findall(r"`([^`]+)`", text):
            if re.match(r"(\w+=\S+ )*python -m ", span):
                self.commands.append((section, span))
            elif span.startswith("--gin_bindings="):
                self.fragments.append(span)


PAGE = Page(open(README).read())


def words_of(command: str) -> tuple[dict[str, str], list[str]]:
    """The environment assignments before the program, and the program's words (`python` first)."""
    words = shlex.split(command)
    assignments = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        assignments[name] = value
    assert words[:2] == ["python", "-m"], command
    return assignments, words


def run(command: str, cwd: str, *appended: str, install: str = REPO) -> subprocess.CompletedProcess:
    """`command` as a shell would run it in `cwd`, with `appended` arguments; the project is
    importable as after `pip install -e .` of `install`. Launched task groups are ended by the
    launcher (SIGTERM) at a timeout, then killed."""
    assignments, words = words_of(command)
    env = subprocess_env()
    env["PYTHONPATH"] = install
    for name, value in assignments.items():  # PYTHONPATH=. adds to the installed project
        env[name] = value + (os.pathsep + install if name == "PYTHONPATH" else "")
    proc = subprocess.Popen(
        [sys.executable, *words[1:], *appended],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{command} ran past {TIMEOUT} s:\n{err[-3000:]}")
    result = subprocess.CompletedProcess(words, proc.returncode, out, err)
    assert result.returncode == 0, f"{command} (in {cwd}) exited {result.returncode}:\n{err[-3000:]}\n{out[-2000:]}"
    assert not re.search(r"^(error:|warning: .*cannot be read)|Traceback", err, re.M), f"{command}:\n{err[-3000:]}"
    return result


def model_dir_of(command: str) -> str:
    return next(w.split("=", 1)[1] for w in words_of(command)[1] if w.startswith("--model_dir="))


def assert_trained(directory: str, step: int, *, restarted_from: int | None = None) -> None:
    """`directory` holds a run trained to `step`, each train record once (a rerun trains no step twice)."""
    assert os.path.exists(os.path.join(directory, f"ckpt-{step}.index")), sorted(os.listdir(directory))
    records = read_jsonl(os.path.join(directory, "metrics.jsonl"))
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == step, train_steps
    if restarted_from is not None:
        assert restarted_from in train_steps


def assert_resumed(result: subprocess.CompletedProcess, directory: str) -> None:
    assert re.search(
        rf"restored {re.escape(os.path.join(directory, 'ckpt-40'))}; continuing from step 40", result.stdout
    ), result.stdout[-2000:]
    assert "eval at step 60:" in result.stdout
    assert_trained(directory, 60, restarted_from=40)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """A copy of the repository: the commands' `gin/...` and `runs/...` are relative to its root."""
    copy = str(tmp_path_factory.mktemp("readme") / "trainer")
    shutil.copytree(
        REPO, copy, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", ".pytest_cache", "*.egg-info")
    )
    return copy


def elsewhere(command: str) -> bool:
    """Run by the tests from another directory below: the step example and the listings."""
    return "--gin_file=my.gin" in command or "--print_config" in command or "trainer.configurables" in command


def root_groups() -> dict[str, list[str]]:
    """The page's other commands, run from the repository's root: the quickstart's, and the rest by
    the model_dir they name (a sidecar, an evaluation or a prediction after the run it reads)."""
    groups: dict[str, list[str]] = {}
    for section, command in PAGE.commands:
        if command not in NOT_RUN and not elsewhere(command):
            key = section if section == "Quickstart" else model_dir_of(command)
            groups.setdefault(key, []).append(command)
    return {key: sorted(commands, key=lambda c: "--mode=" in c) for key, commands in groups.items()}


ROOT_GROUPS = root_groups()


def test_the_page_shows_the_commands_this_test_runs():
    assert set(PAGE.table) >= {"one device", "a sidecar evaluator of a run", "multi-worker, N local processes"}
    assert {"my_steps.py", "my.gin", "my_extensions.py"} <= set(PAGE.files)
    assert PAGE.gin_snippets and PAGE.fragments
    assert ROOT_GROUPS["Quickstart"] == ["python -m trainer.main --gin_file=gin/mwms.gin"]
    assert ROOT_GROUPS["runs/ps"] == [
        PAGE.table["parameter servers, embedded local cluster"],
        PAGE.table["a sidecar evaluator of a run"],
    ]
    in_groups = [c for commands in ROOT_GROUPS.values() for c in commands]
    assert set(PAGE.table.values()) <= set(in_groups)
    assert sum(1 for _, c in PAGE.commands if elsewhere(c)) == 3
    for section, command in PAGE.commands:  # each is run once (or said why not in NOT_RUN)
        assert command in NOT_RUN or elsewhere(command) or in_groups.count(command) == 1, (section, command)
        if command not in NOT_RUN:
            assert words_of(command)[1][2] in ("trainer.main", "trainer.launch", "trainer.configurables"), command


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", list(ROOT_GROUPS))
def test_from_the_repository_root(root, tmp_path, group):
    """The page's commands from the repository's root, in the page's order; the quickstart's rerun by
    its relative path continues (the one-device row's by its full path: the test below); the sidecar
    evaluates the run it names."""
    if group == "Quickstart":  # a fresh runs/<time>-<pid>, printed; run again with it, it continues
        (command,) = ROOT_GROUPS[group]
        first = run(command, root, *bindings(*SHORT), install=root)
        printed = re.search(r"^model_dir: (\S+)$", first.stdout, re.M).group(1)
        assert os.path.dirname(printed) == os.path.join(root, "runs"), printed
        assert_trained(printed, 40)
        relative = os.path.relpath(printed, root)
        again = run(f"{command} --model_dir={relative}", root, *bindings(*SHORT, LONGER), install=root)
        assert_resumed(again, printed)
        return
    model_dir = os.path.join(root, group)
    for command in ROOT_GROUPS[group]:
        if "--mode=eval_continuous" in command:  # the sidecar of the finished run it names
            result = run(command, root, *bindings(*SHORT), install=root)
            evaluated = re.findall(r"^sidecar eval of ckpt-(\d+) at step \d+", result.stdout, re.M)
            assert evaluated == ["20", "40"], result.stdout[-2000:]
            assert "reached train.total_steps 40; done" in result.stdout
            continue
        if "--mode=evaluate" in command:  # the newest checkpoint of the run it names
            result = run(command, root, install=root)
            assert re.search(r"^evaluating ckpt-40 \(step 40\) on eval", result.stdout, re.M), result.stdout[-2000:]
            records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
            assert [r["step"] for r in records if "reevaluated" in r] == [40]
            continue
        if "--mode=predict" in command:  # the finished run's newest checkpoint, into one file
            result = run(command, root, install=root)
            last = result.stdout.strip().splitlines()[-1]
            path = os.path.join(model_dir, "predictions", "eval-ckpt-40.npz")
            assert last == f"predictions: {path} (359 examples)" and os.path.exists(path), result.stdout[-2000:]
            continue
        extra = SHORT
        if "fashion_mnist" in command:  # small files in the Fashion-MNIST layout
            _write_fashion_mnist(str(tmp_path))
            extra += (f"fashion_mnist.data_dir='{tmp_path}'", "fashion_mnist.validation_size=100")
        result = run(command, root, *bindings(*extra), install=root)
        assert "eval at step 40:" in result.stdout, result.stdout[-2000:]
        assert_trained(model_dir, 40)
    assert not os.path.exists(os.path.join(model_dir, "runs"))  # no runs/x/runs/x/...


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_step_and_extension_examples_from_another_directory(root, tmp_path):
    """The step example where its files are written from the page ("anywhere on PYTHONPATH"), with
    the extension example's gin lines appended: the step's bindings apply, and every 100 steps the
    extension records the weights' norm."""
    cwd = str(tmp_path)
    for name, text in PAGE.files.items():
        with open(os.path.join(cwd, name), "w") as f:
            f.write(text)
    (step_command,) = [c for _, c in PAGE.commands if "--gin_file=my.gin" in c]
    snippet = [line for block in PAGE.gin_snippets for line in block.splitlines() if line.strip()]
    run(step_command, cwd, *bindings(*snippet, *SHORT, "train.total_steps=100"), install=root)
    model_dir = os.path.join(cwd, model_dir_of(step_command))
    assert_trained(model_dir, 100)
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    assert [r["step"] for r in records if r["split"] == "weights" and r["norm"] > 0] == [100], records
    with open(os.path.join(model_dir, "operative_config.gin")) as f:
        assert "my_step.label_smoothing = 0.2" in f.read()
    assert os.listdir(os.path.join(cwd, "runs")) == [os.path.basename(model_dir)]


@pytest.mark.slow
def test_the_listings_from_another_directory(root, tmp_path):
    """Every gin name, and a config shown with the page's override example."""
    cwd = str(tmp_path)
    (listing,) = [c for _, c in PAGE.commands if "trainer.configurables" in c]
    assert re.search(r"^cnn\(input_shape, num_classes", run(listing, cwd, install=root).stdout, re.M)
    (print_config,) = [c for _, c in PAGE.commands if "--print_config" in c]
    overrides = [w for fragment in PAGE.fragments for w in shlex.split(fragment)]
    shown = run(
        print_config.replace("--gin_file=...", "--gin_file=gin/single.gin"), cwd, *overrides, install=root
    ).stdout
    assert re.search(r"train\.total_steps = 2000\b", shown) and "make_optimizer.name = 'sgd'" in shown, shown[-2000:]
    assert os.listdir(cwd) == []  # nothing written


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_relative_and_an_absolute_model_dir_are_one_run_to_every_reader(root, tmp_path):
    """The one-device row from another directory, on its relative runs/single with export and best
    checkpoints; run again by its absolute path (as the quickstart prints it), it continues; the
    sidecar by the absolute path; a warm start from the relative one."""
    cwd = str(tmp_path)
    single = PAGE.table["one device"]
    relative = model_dir_of(single)
    features = (
        *SHORT,
        "train.export_saved_model=True",
        "train.keep_best=1",
        "train.best_metric='accuracy'",
        "train.best_mode='max'",
    )
    directory = os.path.join(cwd, relative)
    absolute = single.replace(f"--model_dir={relative}", f"--model_dir={directory}")
    run(single, cwd, *bindings(*features), install=root)
    assert_trained(directory, 40)
    assert_resumed(run(absolute, cwd, *bindings(*features, LONGER), install=root), directory)
    assert os.path.isdir(os.path.join(directory, "export", "60", "variables"))
    with open(os.path.join(directory, "best", "checkpoint")) as f:
        best = re.search(r'model_checkpoint_path: "([^"]+)"', f.read()).group(1)
    assert os.path.exists(os.path.join(directory, "best", os.path.basename(best) + ".index"))
    result = run(f"{absolute} --mode=eval_continuous", cwd, *bindings(*SHORT, LONGER), install=root)
    assert re.findall(r"^sidecar eval of ckpt-(\d+)", result.stdout, re.M) == ["20", "40", "60"], result.stdout
    warm = run(
        single.replace(f"--model_dir={relative}", "--model_dir=runs/warm"),
        cwd,
        *bindings(*SHORT, f"train.warm_start='{relative}'", "train.total_steps=20"),
        install=root,
    )
    source = re.search(r"^warm start from (\S+): restored (\d+) of the model's \2 variables", warm.stdout, re.M)
    assert source and os.path.samefile(
        os.path.join(cwd, source.group(1) + ".index"), os.path.join(directory, "ckpt-60.index")
    ), warm.stdout[-2000:]
    assert_trained(os.path.join(cwd, "runs", "warm"), 20)
    assert sorted(os.listdir(os.path.join(cwd, "runs"))) == sorted({os.path.basename(relative), "warm"})
    assert not os.path.exists(os.path.join(directory, "runs"))  # no runs/single/runs/single/...
