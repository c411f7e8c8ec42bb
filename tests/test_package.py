"""The package's layout: what ``import jaxamp`` loads, and which names each module may import
from another."""

import ast
import importlib
import pathlib
import re
import subprocess
import sys
import warnings
from types import ModuleType

import pytest

import jaxamp

PACKAGE = pathlib.Path(jaxamp.__file__).parent
API_PAGES = PACKAGE.parent / "docs" / "api"


# A public module of an optional dependency: reachable as jaxamp.equinox, not in __all__ (a
# star import must work without equinox installed).
OPTIONAL = ("equinox",)


def _public_modules() -> dict[str, ModuleType]:
    """``jaxamp`` and every public module it exports, by dotted name."""
    modules = {f"jaxamp.{n}": getattr(jaxamp, n) for n in (*jaxamp.__all__, *OPTIONAL)}
    return {"jaxamp": jaxamp} | {n: m for n, m in modules.items() if isinstance(m, ModuleType)}


def _names(module: ModuleType) -> set[str]:
    """The names a module exports, its public submodules aside."""
    return {n for n in module.__all__ if not isinstance(getattr(module, n), ModuleType)}


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
    assert public == ["equinox", "fp8", "gradients", "memory", "ops", "parallel", "reports",
                      "rounding", "state"]
    exported_modules = {n for n in jaxamp.__all__ if isinstance(getattr(jaxamp, n), ModuleType)}
    assert exported_modules | set(OPTIONAL) == set(public)
    assert not set(OPTIONAL) & set(jaxamp.__all__)


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


def test_the_top_level_is_small():
    """A user holds the top level in mind: at most 20 names besides the public modules, and
    the FP8 module at most 12 (the recipes carry their options, ``Fp8State`` its helpers)."""
    assert len(_names(jaxamp)) <= 20, sorted(_names(jaxamp))
    assert len(jaxamp.fp8.__all__) <= 12, jaxamp.fp8.__all__
    assert list(jaxamp.__all__) == sorted(jaxamp.__all__)


# Each name that left the top level (or jaxamp.fp8), and where a user finds it now.
MOVED = {
    "MixedPrecisionState": "jaxamp.state.MixedPrecisionState",
    "find_state": "jaxamp.state.find_state",
    "get_master_params": "jaxamp.state.get_master_params",
    "scale_loss": "jaxamp.state.scale_loss",
    "MASTERS": "jaxamp.state.MASTERS",
    "PRESETS": "jaxamp.Policy.PRESETS",
    "resolve_auto": "jaxamp.Policy.resolve_auto",
    "AuditReport": "jaxamp.reports.AuditReport",
    "OverflowReport": "jaxamp.reports.OverflowReport",
    "OverflowEvent": "jaxamp.reports.OverflowEvent",
    "fp8.FORMATS": "jaxamp.fp8.CurrentScaling.FORMATS",
    "fp8.GRANULARITIES": "jaxamp.fp8.CurrentScaling.GRANULARITIES",
    "fp8.WEIGHT_GRADS": "jaxamp.fp8.CurrentScaling.WEIGHT_GRADS",
    "fp8.KEEP": "jaxamp.fp8.CurrentScaling.KEEP",
    "fp8.AMAX_ALGOS": "jaxamp.fp8.DelayedScaling.AMAX_ALGOS",
    "fp8.find_fp8_states": "jaxamp.fp8.Fp8State.find_all",
    "fp8.replace_fp8_states": "jaxamp.fp8.Fp8State.replace_all",
    "fp8.update_fp8_state": "jaxamp.fp8.Fp8State.update",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_name_lives_in_one_place(old):
    module, _, name = f"jaxamp.{old}".rpartition(".")
    assert not hasattr(importlib.import_module(module), name)
    obj = jaxamp
    for part in MOVED[old].split(".")[1:]:
        obj = getattr(obj, part)
    assert obj.__doc__


def test_the_api_reference_lists_exactly_each_public_modules_names():
    """docs/api/ has one ``::: module.name`` entry for each name in a public module's
    ``__all__``, and no other: not a class's member (shown with its class), nor a name twice."""
    modules = _public_modules()
    listed: dict[str, set[str]] = {name: set() for name in modules}
    stray = []
    for page in sorted(API_PAGES.glob("*.md")):
        for entry in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M):
            module, _, name = entry.rpartition(".")
            if module in listed and name not in listed[module]:
                listed[module].add(name)
            else:
                stray.append(f"{page.name}: {entry}")
    missing = [f"{m}.{n}" for m, module in modules.items()
               for n in sorted(_names(module) - listed[m])]
    stray += [f"{m}.{n}" for m, module in modules.items()
              for n in sorted(listed[m] - _names(module))]
    assert (missing, stray) == ([], [])


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
