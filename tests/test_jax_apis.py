"""jaxamp leans on public JAX APIs, with one guarded private import (the saved-residuals list
behind ``jax.ad_checkpoint.print_saved_residuals``) and private objects reached through a
jaxpr (the operand layout of a ``scan``, whose params changed in jax 0.11; an equation's
traceback, which names the function that traced it). These tests pin the
JAX range both are known to work in, check the public fallback against the import, and check
that a diagnostic can never break a training step. The benchmarks' conformance suite reads
one more private module, JAX's primitive test harnesses, pinned here too."""

import pathlib
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxamp
from jaxamp import _jaxpr
from jaxamp._diagnoses import _audit as auditing

# The range the private APIs were checked in: jax 0.10.2, 0.11.2 and 0.12.0.1, each with this
# module's tests. A JAX outside it is not an error for users (the audit falls back to the
# public printer; the scan's layout raises a clear error if neither known form is there); it
# is a reminder to check both here before widening the range.
TESTED = ((0, 10, 2), (0, 13, 0))


def _version(text):
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def test_the_jax_version_is_in_the_tested_range():
    low, high = TESTED
    assert low <= _version(jax.__version__) < high, (
        f"jax {jax.__version__} is outside the range jaxamp's private APIs "
        "(jax._src.ad_checkpoint.saved_residuals in jaxamp/auditing.py, a scan's ft_in in "
        "jaxamp/_jaxpr.py) were checked in; check them with "
        "test_the_public_fallback_lists_the_same_residuals and "
        "test_the_layout_of_a_scan_is_read_from_its_params, then widen TESTED")


def _model(w, x):
    h = jnp.tanh(x @ w)
    return jnp.sum(jnp.exp(h.astype(jnp.float32)))


def test_the_public_fallback_lists_the_same_residuals():
    args = (jnp.ones((8, 4), jnp.bfloat16), jnp.ones((2, 8), jnp.bfloat16))
    from jax._src.ad_checkpoint import saved_residuals  # the import under test
    private = [(jnp.dtype(a.dtype), tuple(a.shape), d) for a, d in saved_residuals(_model, *args)]
    parsed = [(jnp.dtype(a.dtype), tuple(a.shape), d)
              for a, d in auditing._printed_residuals(_model, args, {})]
    assert parsed == private
    assert any(d == jnp.bfloat16 for d, _, _ in parsed)


def test_the_layout_of_a_scan_is_read_from_its_params():
    """``_jaxpr.scan_layout``: ``num_consts``/``num_carry`` up to jax 0.10, the flat tree
    ``ft_in`` (a private class, reached through the equation) from jax 0.11."""
    def f(x, xs):
        c = jnp.sin(x)  # a traced value closed over: one constant of the scan

        def step(carry, x):
            h, k = carry
            return (h + x * c, k + 1), h
        return lax.scan(step, (x, 0), xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((2, 3)))
    eqn = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    assert _jaxpr.scan_layout(eqn) == (1, 2)
    assert len(eqn.invars) == 1 + 2 + 1 and len(eqn.outvars) == 2 + 1
    assert ("num_consts" if _version(jax.__version__) < (0, 11) else "ft_in") in eqn.params
    unknown = types.SimpleNamespace(params={"length": 2, "jaxpr": None})
    with pytest.raises(NotImplementedError, match="operand layout of a scan"):
        _jaxpr.scan_layout(unknown)


def test_the_layout_of_a_while_loop_is_read_from_its_structure():
    """``_jaxpr.while_layout`` counts the constants from the jaxprs' inputs, and agrees with
    the params ``cond_nconsts``/``body_nconsts`` where a JAX has them (all up to 0.12)."""
    def f(x, n):
        c = jnp.sin(x)
        return lax.while_loop(lambda s: s[1] < n, lambda s: (s[0] * c, s[1] + 1), (x, 0))

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), 4)
    eqn = next(e for e in jaxpr.eqns if e.primitive.name == "while")
    assert _jaxpr.while_layout(eqn) == (1, 1)
    if "cond_nconsts" in eqn.params:
        assert _jaxpr.while_layout(eqn) == (eqn.params["cond_nconsts"],
                                            eqn.params["body_nconsts"])


def test_a_custom_jvps_rule_is_read_from_its_params():
    """``_jaxpr._jvp_rule``: a ``custom_jvp_call``'s params hold its rule as ``jvp_jaxpr_fun``
    (a ``WrappedFun``, reached through the equation) on jax 0.10 to 0.12; called with the
    tangents' zero flags, it gives the JVP's jaxpr, its constants and the outputs' zero
    flags. Without it autocast would differentiate the primal body instead."""
    @jax.custom_jvp
    def f(x, k):
        return jnp.round(x) * k

    @f.defjvp
    def f_jvp(primals, tangents):
        return f(*primals), tangents[0] * 3.0

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), 2.0)
    eqn = next(e for e in jaxpr.eqns if e.primitive.name == "custom_jvp_call")
    assert "jvp_jaxpr_fun" in eqn.params
    rule = _jaxpr._jvp_rule(eqn)
    assert rule is not None
    jvp, consts, out_zeros = rule(False, False)
    assert len(jvp.invars) == 4 and list(out_zeros) == [False]
    out = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jvp, consts))(
        jnp.full(3, 1.4), 2.0, jnp.ones(3), 0.0)
    np.testing.assert_array_equal(out[1], jnp.full(3, 3.0))


def test_an_equations_traceback_names_jaxs_attention_function():
    """The attention finder's private read (``jaxamp/_autocast/_attention.py``): an equation's
    ``source_info.traceback.raw_frames()`` holds the code of ``jax.nn.dot_product_attention``,
    defined in ``jax/_src/nn/functions.py``, for the equations it traced; and an equation
    without a traceback is none of its calls."""
    from jaxamp._autocast import _attention
    q = jnp.ones((1, 4, 1, 8))
    jaxpr = jax.make_jaxpr(lambda q: jax.nn.dot_product_attention(q, q, q) + 1)(q).jaxpr
    sites = [_attention.site(e) for e in jaxpr.eqns]
    assert all(sites[:-1]) and sites[-1] is None
    code, _ = sites[0][0]
    assert code is jax.nn.dot_product_attention.__code__
    assert code.co_filename.endswith(_attention._MODULE)
    no_traceback = types.SimpleNamespace(source_info=types.SimpleNamespace(traceback=None))
    assert _attention.site(no_traceback) is None


def test_where_names_the_user_line_and_survives_missing_source_info():
    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    site = _jaxpr.where(jaxpr.jaxpr.eqns[0])
    assert "test_jax_apis.py:" in site and "(test_where_names" in site
    broken = types.SimpleNamespace(source_info=None, primitive=jaxpr.jaxpr.eqns[0].primitive)
    assert _jaxpr.where(broken) == "<unknown>"
    assert _jaxpr.scope(broken) == ""


def test_the_fp32_matmul_warning_never_breaks_a_step(monkeypatch):
    """The diagnostic reads the jaxpr the step traces (the loss is traced once); a failure of
    the diagnostic itself (a JAX whose jaxpr it cannot read) still trains, silently."""
    from jaxamp._step import _train_step

    def unreadable(jaxpr):
        raise AttributeError("a jaxpr this JAX writes differently")
    monkeypatch.setattr(_train_step, "_fp32_matmul_sites", unreadable)
    calls = {"n": 0}

    def loss_fn(params, batch):
        calls["n"] += 1
        return jnp.mean((batch["x"] @ params["w"]).astype(jnp.float32) ** 2)

    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params={"w": jnp.ones((3,))}, tx=tx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, m = jax.jit(jaxamp.make_train_step(loss_fn))(state, {"x": np.ones((4, 3))})
    assert bool(m["grads_finite"]) and calls["n"] == 1


@pytest.mark.parametrize("name", ["Literal", "JaxprEqn", "ClosedJaxpr"])
def test_the_public_jaxpr_types_exist(name):
    import jax.extend.core as core
    assert hasattr(core, name)


@pytest.mark.parametrize("name", ["shard_map", "typeof", "lax.pcast", "lax.psum_scatter",
                                  "lax.all_gather", "sharding.auto_axes", "sharding.reshard",
                                  "sharding.get_abstract_mesh", "sharding.AxisType"])
def test_the_public_apis_of_the_data_parallel_step_exist(name):
    """The data-parallel step under jit (jaxamp/_step/_data_parallel.py) uses only these."""
    obj = jax
    for part in name.split("."):
        obj = getattr(obj, part)
    assert obj is not None


def test_make_jaxpr_takes_a_type_from_typeof_with_another_dtype():
    """autocast traces ``fn`` from its half arguments' types with fp32 as the dtype
    (``jax.typeof(x).update(dtype=...)``), their sharding and varying axes kept."""
    x = jnp.ones((2, 3), jnp.bfloat16)

    def traced(x):
        aval = jax.typeof(x).update(dtype=jnp.dtype(jnp.float32), weak_type=False)
        jaxpr = jax.make_jaxpr(lambda y: y * 2)(aval)
        assert jaxpr.in_avals[0].dtype == jnp.float32
        return x
    traced(x)
    jax.jit(traced)(x)
    jax.grad(lambda x: jnp.sum(traced(x).astype(jnp.float32)))(x)


def test_jaxs_primitive_test_harnesses_import_and_hold_harnesses():
    """The conformance suite (benchmarks/conformance.py) reads JAX's primitive test harnesses
    from their private module, ``jax._src.internal_test_util.test_harnesses``, in
    ``conformance.corpus()`` alone; this pins that it still imports, and that its harnesses
    still have what the suite reads."""
    from benchmarks import conformance
    harnesses = conformance.corpus()
    assert len(harnesses) > 1000
    assert len({h.group_name for h in harnesses}) > 100
    h = next(h for h in harnesses if h.group_name == "exp")
    assert isinstance(h.name, str) and callable(h.dyn_fun) and h.dtype is not None
    assert all(hasattr(lim, "filter") for lim in h.jax_unimplemented)
    assert h.filter("cpu", include_jax_unimpl=False) in (True, False)
    args = h.dyn_args_maker(np.random.RandomState(0))
    assert any(jnp.issubdtype(np.asarray(a).dtype, jnp.floating) for a in args)
    assert jnp.shape(h.dyn_fun(*args)) == np.shape(args[0])


def test_a_jax_newer_than_the_tested_range_is_warned_about_once_by_name():
    from jaxamp import _versions
    assert _versions.check()  # the jax of this lane is tested
    assert _versions.check("0.12.9") and _versions.check("0.10.2")
    with pytest.warns(UserWarning, match=r"tested with jax 0.10.2 to 0.12.x, and jax 0.13.0 "
                                         r"is newer.*install jax<0.13"):
        assert not _versions.check("0.13.0")
    pyproject = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert (f"# Tested with jax {_versions.TESTED[0]} to {_versions.TESTED[1]}.x" in pyproject
            and f'"jax>={_versions.TESTED[0]}"' in pyproject)
