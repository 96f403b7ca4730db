"""What a newcomer copies from the docs works: every `pip install` the README, the docs and the
code's messages show installs from this repository (on the package index, `trainer` is someone
else's project), every `@name` the configurables listing shows resolves in gin, and the bindings
`trainer.write_tfrecords` prints train when pasted. The README's commands themselves:
tests/test_readme.py."""

from __future__ import annotations

import ast
import glob
import os
import re
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

import pytest

from tests.support import REPO, read_jsonl, run_module, run_python, subprocess_env

# `pip install [flags] TARGET`: the target as the shell sees it (quoted, or up to a space or
# the end of the code span, sentence or string).
PIP_LINE = re.compile(r"pip install((?: +-[\w-]+)*) +(?!-)('[^']*'|\"[^\"]*\"|[^\s`'\")]+)")
# Packages that are no dependency of the project but that its docs install on purpose.
OTHER_PACKAGES = {"pip", "tf-models-official"}  # the bench's Orbit (docs/speed.md)


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def package_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9][\w.-]*", requirement).group(0).lower().replace("_", "-")


def module_strings(path: str) -> list[tuple[int, str]]:
    """Every string in a module, an f-string with its module-level constants filled in (also those
    imported from another module of the repository), so a message reads as printed."""
    tree = ast.parse(open(path).read())

    def constants(module_tree: ast.Module) -> dict[str, str]:
        return {
            target.id: node.value.value
            for node in module_tree.body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            for target in node.targets
            if isinstance(target, ast.Name)
        }

    known = constants(tree)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("trainer", "experiments")):
            source = os.path.join(REPO, *node.module.split(".")) + ".py"
            if os.path.exists(source):
                theirs = constants(ast.parse(open(source).read()))
                known |= {
                    alias.asname or alias.name: theirs[alias.name] for alias in node.names if alias.name in theirs
                }

    def text(node: ast.JoinedStr) -> str:
        return "".join(
            part.value
            if isinstance(part, ast.Constant)
            else known.get(part.value.id, "{?}")
            if isinstance(part.value, ast.Name)
            else "{?}"
            for part in node.values
        )

    parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    return [
        (node.lineno, text(node) if isinstance(node, ast.JoinedStr) else node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        or (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts)
    ]


def pip_lines() -> list[tuple[str, str, str]]:
    """(where, flags, target) of every `pip install` in the README, docs, experiments and code."""
    found = []
    pages = [
        os.path.join(REPO, "README.md"),
        *glob.glob(os.path.join(REPO, "docs", "*.md")),
        *glob.glob(os.path.join(REPO, "experiments", "**", "*.md"), recursive=True),
        *glob.glob(os.path.join(REPO, "experiments", "**", "Dockerfile"), recursive=True),
        *glob.glob(os.path.join(REPO, ".ci", "*")),
    ]
    for page in pages:
        for number, line in enumerate(open(page).read().splitlines(), 1):
            found += [(f"{os.path.relpath(page, REPO)}:{number}", *m.groups()) for m in PIP_LINE.finditer(line)]
    for module in glob.glob(os.path.join(REPO, "trainer", "**", "*.py"), recursive=True) + glob.glob(
        os.path.join(REPO, "experiments", "**", "*.py"), recursive=True
    ):
        for number, string in module_strings(module):
            found += [
                (f"{os.path.relpath(module, REPO)}:{number}", *m.groups())
                for m in PIP_LINE.finditer(" ".join(string.split()))
            ]
    return found


def test_every_pip_install_installs_from_the_repository_or_a_named_package():
    meta = project()
    extras = set(meta["optional-dependencies"])
    packages = (
        {package_name(r) for r in meta["dependencies"]}
        | OTHER_PACKAGES
        | {package_name(r) for group in meta["optional-dependencies"].values() for r in group}
    )
    lines = pip_lines()
    wrong = []
    for where, _flags, target in lines:
        unquoted = target.strip("'\"")
        if unquoted.startswith("."):  # the repository: `.` or `'.[extra]'` (quoted: the shell globs [])
            extra = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", unquoted)
            if not extra or (extra.group(1) and (target == unquoted or not set(extra.group(1).split(",")) <= extras)):
                wrong.append((where, target))
        elif package_name(unquoted) not in packages or package_name(unquoted) == meta["name"]:
            wrong.append((where, target))
    assert not wrong, f"pip install lines that do not install from this repository: {wrong}"
    # The search itself finds what it must: the README's, an extra in the docs and in a message.
    assert {
        ("README.md", "."),
        ("docs/around-the-step.md", "'.[mlflow]'"),
        ("trainer/plot.py", "'.[plot]'"),
        ("experiments/bench/__main__.py", "tf-models-official==2.20.0"),
    } <= {(where.split(":")[0], target) for where, _, target in lines}


@pytest.mark.slow
def test_every_gin_reference_the_configurables_listing_shows_resolves():
    listing = run_module("trainer.configurables", timeout=120)
    assert listing.returncode == 0 and listing.stderr == "", listing.stderr[-3000:]
    references = sorted(set(re.findall(r"@[\w./]+(?:\(\))?", listing.stdout)))
    assert "@cnn" in references and "@float_feature()" in references, references
    result = run_python(f"""
import json, gin
import trainer.configurables
unresolved = []
for reference in {references!r}:
    try:
        gin.parse_config(f"train.extensions = [{{reference}}]")
    except Exception as e:
        unresolved.append(f"{{reference}}: {{str(e).splitlines()[0]}}")
    gin.clear_config()
print(json.dumps(unresolved))
""")
    assert result == [], result


@pytest.mark.slow
def test_write_tfrecords_prints_bindings_that_train_when_pasted(tmp_path):
    # The command as docs/your-data.md shows it (its relative --out_dir), from a directory of one's own.
    with open(os.path.join(REPO, "docs", "your-data.md")) as f:
        (command,) = re.findall(r"^python -m (trainer\.write_tfrecords .*)$", f.read(), re.M)
    module, *arguments = command.replace("--num_shards=4", "--num_shards=2").split()
    written = subprocess.run(
        [sys.executable, "-m", module, *arguments],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert written.returncode == 0 and written.stderr == "", written.stderr[-3000:]
    lines = written.stdout.splitlines()
    assert lines[0] == "train.input_fn = @tfrecord_files()" and all(
        line.startswith("tfrecord_files.") for line in lines[1:]
    ), lines
    (tmp_path / "mine.gin").write_text("include 'gin/single.gin'\n" + written.stdout)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.main",
            f"--gin_file={tmp_path / 'mine.gin'}",
            "--model_dir=runs/tfrecords",
            "--gin_bindings=train.total_steps=10",
            "--gin_bindings=train.steps_per_loop=10",
            "--gin_bindings=train.eval_every_steps=10",
        ],
        cwd=elsewhere,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    with open(elsewhere / "runs" / "tfrecords" / "operative_config.gin") as f:
        assert "tfrecord_files.num_classes = 10" in f.read()
    records = read_jsonl(str(elsewhere / "runs" / "tfrecords" / "metrics.jsonl"))
    assert [(r["step"], r["split"]) for r in records if r["split"] == "eval"] == [(10, "eval")], records


def test_the_default_model_dir_is_named_one_way():
    """`runs/<time>-<pid>` in the working directory, as trainer.main makes it."""
    texts = {
        path: open(path).read()
        for path in [
            os.path.join(REPO, "README.md"),
            os.path.join(REPO, "trainer", "main.py"),
            *glob.glob(os.path.join(REPO, "docs", "*.md")),
        ]
    }
    named = {
        (os.path.relpath(path, REPO), name)
        for path, text in texts.items()
        for name in re.findall(r"(?<![\w.])(?:\./)?runs/<[^>]*>[\w<>-]*", text)
    }
    assert named and {name for _, name in named} == {"runs/<time>-<pid>"}, named


def test_ci_checks_the_style_first_and_runs_the_readme_s_test_command():
    """.ci/run runs ruff on the paths the README's Development section formats, before the README's
    test command (verbatim); ruff comes with the test extra, and the fast tier's mark is registered
    (`--strict-markers` refuses any other)."""
    readme = open(os.path.join(REPO, "README.md")).read()
    ci = open(os.path.join(REPO, ".ci", "run")).read().splitlines()
    test_command = "pip install -e '.[test]' && python -m pytest -q"
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert f"\n{test_command}\n" in quickstart
    development = readme.split("## Development", 1)[1]
    (formatted,) = re.findall(r"^ruff format ([\w ]+) && ruff check \1$", development, re.M)
    assert re.search(r'^python -m pytest -q -m "not slow"$', development, re.M)
    style = [f"ruff check {formatted}", f"ruff format --check {formatted}"]
    assert all(ci.count(line) == 1 for line in [*style, test_command]), ci
    assert ci.index(style[0]) < ci.index(style[1]) < ci.index(test_command) == len(ci) - 1
    assert "ruff" in {package_name(r) for r in project()["optional-dependencies"]["test"]}
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        options = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"].split()
    assert [marker.split(":")[0] for marker in options["markers"]] == ["slow", "chaos"]


def test_the_layer_diagrams_name_every_folder_of_the_package():
    """The README's Concepts and docs/design.md's layers draw the same package: every folder of
    trainer/ appears in both (as `trainer/<folder>/` or `<folder>/`), and neither names a folder
    that is gone."""
    folders = {
        d
        for d in os.listdir(os.path.join(REPO, "trainer"))
        if os.path.isfile(os.path.join(REPO, "trainer", d, "__init__.py"))
    }
    readme = open(os.path.join(REPO, "README.md")).read().split("## Concepts", 1)[1].split("```")[1]
    design = open(os.path.join(REPO, "docs", "design.md")).read().split("## The layers", 1)[1].split("```")[1]
    for text in (readme, design):
        named = set(re.findall(r"(?:^|[\s(,])(?:trainer/)?([a-z_]+)/", text, re.M))
        assert folders <= named, sorted(folders - named)
        assert not {n for n in named if n not in folders and os.path.isdir(os.path.join(REPO, "trainer", n))}
        gone = {"hooks", "bench"} & named
        assert not gone, gone
