"""Every notebook under experiments/, executed cell by cell in a real Jupyter kernel (nbclient + ipykernel),
where TensorFlow is initialised by an earlier cell; and committed without outputs, so it stays small and
diffable."""

from __future__ import annotations

import glob
import os

import pytest

from tests.support import REPO

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "experiments", "**", "*.ipynb"), recursive=True))
# What a notebook must not print: TensorFlow's C++ start-up notices and its Python INFO lines (a wall in a
# notebook, where TensorFlow sends them to the cell's output).
NOISE = ("absl::InitializeLog", "oneDNN custom operations", "cuda drivers", "INFO:tensorflow")


def test_there_is_a_notebook_and_none_carries_outputs():
    import nbformat

    assert any(path.endswith(os.path.join("notebooks", "quickstart.ipynb")) for path in NOTEBOOKS), NOTEBOOKS
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        run = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not run, (
            f"{os.path.relpath(path, REPO)}: cells {run} carry outputs; clear them before committing "
            "(jupyter nbconvert --clear-output --inplace NOTEBOOK)"
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: os.path.relpath(p, REPO))
def test_the_notebook_runs_in_a_kernel(path, tmp_path, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)  # the level a user has not set
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("TRAINER_TESTS_HIDDEN", raising=False)  # the kernel is IPython; the notebook draws a plot
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the notebook's runs go (tempfile.mkdtemp)
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # a cell's error raises CellExecutionError, naming the cell
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert not [n for n in NOISE if n in text], text[-3000:]
    if path.endswith("quickstart.ipynb"):
        assert sum("image/png" in o.get("data", {}) for o in outputs) == 1  # the plot of result.history
        assert "on 2 replica(s)" in text and "eval at step 40" in text and "re-evaluated ckpt-20" in text
        assert "predictions:" in text and text.count("training Sequential") == 2
