"""Every notebook in notebooks/ executes without error in its small mode.

Each notebook runs in a fresh Jupyter kernel (nbclient), from notebooks/, with
``JAXAMP_NOTEBOOK_SMALL=1`` (a few steps per run) and ``MPLBACKEND=Agg``. The executed copy is
thrown away: the committed files keep the outputs of a full-size run.
"""

import os
import pathlib
import subprocess
import sys
import tomllib

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
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


def _repository_url() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_each_notebook_installs_this_library_from_the_repository_and_opens_in_colab(path):
    """The registry's `jaxamp` is another project: the setup cell clones the repository whose
    URL pyproject.toml gives, installs that checkout, and names a `jaxamp` without
    `mixed_precision` as another project's, with the install line."""
    nb = nbformat.read(path, as_version=4)
    setup = [cell for cell in nb.cells if cell.cell_type == "code"][0].source
    url = _repository_url()
    assert f'REPO = "{url}"' in setup
    assert "jaxamp[train]" not in setup and "jax-amp[train] @ git+{REPO}" in setup
    assert 'hasattr(jaxamp, "mixed_precision")' in setup
    first = nb.cells[0].source
    colab = url.replace("https://github.com/", "https://colab.research.google.com/github/")
    assert f"[Open in Colab]({colab}/blob/main/notebooks/{path.name})" in first


def test_the_repository_url_lives_in_pyproject_and_the_docs_site_names_the_same():
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    assert f"repo_url: {_repository_url()}" in lines


def test_python_m_train_names_another_projects_jaxamp(tmp_path):
    """A `jaxamp` that is not this library (the registry's) first on the path: one sentence
    with the install line, not an AttributeError."""
    fake = tmp_path / "fake" / "jaxamp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("# another project's jaxamp\n")
    result = subprocess.run([sys.executable, "-m", "train", "--help"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}:{ROOT}"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("pip install '.[train]' (its distribution is named "
                                          "jax-amp)"), result.stderr
    assert "another project" in result.stderr and "Traceback" not in result.stderr
