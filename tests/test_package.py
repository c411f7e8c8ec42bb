"""The package's layout: what ``import jaxamp`` loads, and which names each module may import
from another."""

import ast
import importlib
import pathlib
import subprocess
import sys
import warnings
from types import ModuleType

import pytest

import jaxamp

PACKAGE = pathlib.Path(jaxamp.__file__).parent


def test_no_module_imports_a_name_its_source_does_not_export():
    """Between the library's modules, a name imported from a public module must be in that
    module's ``__all__`` (private modules aside: they are the library's own)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("jaxamp.")):
                continue
            if any(part.startswith("_") for part in node.module.split(".")):
                continue  # a private module, or one inside a private package
            exported = set(importlib.import_module(node.module).__all__)
            bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                    if a.name not in exported]
    assert bad == []


def test_every_library_module_but_the_public_subpackages_is_private():
    public = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_"))
    assert public == ["equinox", "fp8", "gradients", "memory", "ops", "parallel", "rounding",
                      "state"]
    exported_modules = {n for n in jaxamp.__all__ if isinstance(getattr(jaxamp, n), ModuleType)}
    assert exported_modules == set(public)


def test_import_jaxamp_and_autocast_do_not_load_flax_nnx():
    code = ("import sys, jax.numpy as jnp, jaxamp\n"
            "jaxamp.autocast(lambda x: x @ x, 'mixed_bfloat16')(jnp.ones((2, 2)))\n"
            "assert 'flax.nnx' not in sys.modules, 'flax.nnx loaded'\n"
            "jaxamp.fp8.Linear\n"
            "assert 'flax.nnx' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", ["put_sharded", "kahan_split", "grad_stats", "gpu_memory",
                                  "get_loss_scale"])
def test_a_name_of_a_public_module_is_not_on_the_top_level(name):
    """Before the first release nothing keeps an alias: the names live in their modules."""
    assert not hasattr(jaxamp, name)


@pytest.mark.parametrize("old", ["policy", "loss_scale", "master_weights", "train_step",
                                 "autocasting", "auditing", "overflow"])
def test_no_old_module_path_is_left(old):
    assert not (PACKAGE / f"{old}.py").exists()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"jaxamp.{old}")


def test_importing_jaxamp_installs_no_import_hook():
    """``import jaxamp`` leaves the import system as it was."""
    code = ("import sys, jaxamp\n"
            "ours = [f for f in (*sys.meta_path, *sys.path_hooks)\n"
            "        if getattr(f, '__module__', '').startswith('jaxamp')]\n"
            "assert ours == [], ours\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_unknown_name_is_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'mixed_precisoin'"):
            jaxamp.mixed_precisoin  # noqa: B018
