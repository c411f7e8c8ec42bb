"""The package as a user installs it: the wheel and the sdist build, hold what they should, and
the wheel, installed into a fresh virtual environment with the source tree off the path, runs
the README's first example.

`make dist` builds the same two files into dist/ and runs `twine check` on them.
"""

import email.parser
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("dist")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], check=True,
                   capture_output=True, text=True, timeout=600)
    return out


def _wheel(dist: pathlib.Path) -> pathlib.Path:
    (wheel,) = dist.glob("jax_amp-*.whl")
    return wheel


def test_twine_check_strict_passes_on_both_files(dist):
    """What `make dist` runs after the build; CI runs it here, once."""
    files = sorted(str(p) for p in dist.iterdir())
    assert len(files) == 2, files
    twine = pathlib.Path(sys.executable).parent / "twine"
    result = subprocess.run([str(twine), "check", "--strict", *files], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.count("PASSED") == 2, result.stdout


def test_wheel_holds_the_library_and_nothing_else(dist):
    names = zipfile.ZipFile(_wheel(dist)).namelist()
    assert "jaxamp/py.typed" in names and "jaxamp/__init__.py" in names
    assert "jaxamp/fp8.py" in names and "jaxamp/_autocast/__init__.py" in names
    top = {name.split("/")[0] for name in names}
    assert top == {"jaxamp", f"jax_amp-{jaxamp.__version__}.dist-info"}, top
    outside = r"(train|tests|benchmarks|examples|notebooks|docs)/"
    assert not [n for n in names if re.match(outside, n)]
    assert f"jax_amp-{jaxamp.__version__}.dist-info/licenses/LICENSE" in names


def test_wheel_metadata(dist):
    wheel = _wheel(dist)
    assert wheel.name == f"jax_amp-{jaxamp.__version__}-py3-none-any.whl"
    text = zipfile.ZipFile(wheel).read(f"jax_amp-{jaxamp.__version__}.dist-info/METADATA")
    meta = email.parser.Parser().parsestr(text.decode())
    assert meta["Name"] == "jax-amp" and meta["Version"] == jaxamp.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.11"
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Documentation", "Repository", "Changelog"} <= set(urls)
    extras = set(meta.get_all("Provides-Extra"))
    assert {"train", "bench", "dev", "docs"} <= extras
    requires = meta.get_all("Requires-Dist")
    runtime = sorted(r.split(">=")[0] for r in requires if "extra ==" not in r)
    assert runtime == ["flax", "jax", "jaxlib", "optax"]
    assert meta.get_payload().startswith("# jaxamp")  # the README is the long description


def test_sdist_holds_the_sources_and_the_license(dist):
    (sdist,) = dist.glob("jax_amp-*.tar.gz")
    assert sdist.name == f"jax_amp-{jaxamp.__version__}.tar.gz"
    names = tarfile.open(sdist).getnames()
    base = f"jax_amp-{jaxamp.__version__}"
    for name in ("pyproject.toml", "README.md", "LICENSE", "jaxamp/__init__.py", "jaxamp/py.typed"):
        assert f"{base}/{name}" in names, name


def _readme_first_example() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", readme, flags=re.S)[0]


def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_readme(dist, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile",
                              str(_wheel(dist))], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]

    def run(code: str) -> str:
        result = subprocess.run([str(python), "-c", code], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    assert run("import jaxamp; print(jaxamp.__version__)").strip() == jaxamp.__version__
    where = run("import importlib.util, jaxamp; print(jaxamp.__file__); "
                "print(importlib.util.find_spec('train'), importlib.util.find_spec('benchmarks'))")
    location, probes = where.strip().splitlines()
    assert pathlib.Path(location).is_relative_to(venv), location  # not the source tree
    assert probes == "None None"
    (tmp_path / "readme_example.py").write_text(_readme_first_example())
    out = subprocess.run([str(python), "readme_example.py"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loss_scale" in out.stdout
