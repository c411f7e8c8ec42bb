"""Every notebook in notebooks/ executes without error in its small mode.

Each notebook runs in a fresh Jupyter kernel (nbclient), from notebooks/, with
``JAXAMP_NOTEBOOK_SMALL=1`` (a few steps per run) and ``MPLBACKEND=Agg``. The executed copy is
thrown away: the committed files keep the outputs of a full-size run.
"""

import os
import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def test_the_notebooks_are_there():
    assert [p.name for p in PATHS] == [
        "01_quickstart.ipynb",
        "02_fp16_loss_scaling.ipynb",
        "03_bf16_fp16_fp32.ipynb",
        "04_memory_and_audit.ipynb",
        "05_autocast.ipynb",
    ]


# The quickstart runs in `make test`; the others, whose steps the library's tests check in
# process, in `make test-all`.
@pytest.mark.parametrize("path", [pytest.param(p, marks=() if p.stem == "01_quickstart" else
                                               pytest.mark.slow) for p in PATHS],
                         ids=[p.stem for p in PATHS])
def test_notebook_runs_in_small_mode(path):
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, JAXAMP_NOTEBOOK_SMALL="1", MPLBACKEND="Agg")
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=env)  # raises CellExecutionError, with the cell and traceback, on error
    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_committed_notebook_holds_a_full_run(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.get("execution_count") for cell in code), "some cells were never executed"
    outputs = [out for cell in code for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    assert any("image/png" in out.get("data", {}) for out in outputs), "no plot in the outputs"
    setup = code[0]
    assert '"google.colab" in sys.modules' in setup.source
    assert "JAXAMP_INSTALL_SPEC" in setup.source
    assert "".join(out.get("text", "") for out in setup.outputs).strip() == "full-size run"
