"""Tests of jaxamp.autocast: per-op dtype rules on any unmodified JAX, Flax or Equinox model."""

import ast
import functools
import inspect
import pathlib
import re
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ROOT
from helpers import assert_tree_bitwise_equal
from helpers import init_params
from helpers import make_batch
from helpers import mse_loss
from jax import lax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import _jaxpr

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
MATMULS = ("dot_general", "conv_general_dilated")


def eqns(fn, *args):
    """Every equation of ``fn``'s jaxpr, nested ones included."""
    return [e for e, _ in _jaxpr.walk(jax.make_jaxpr(fn)(*args))]


def operand_dtypes(fn, *args, names=MATMULS):
    return {(e.primitive.name, jnp.dtype(v.aval.dtype).name)
            for e in eqns(fn, *args) if e.primitive.name in names
            for v in e.invars if hasattr(v.aval, "dtype")}


def matmul_dtypes(fn, *args):
    return {d for _, d in operand_dtypes(fn, *args)}


def grad_of(fn, argnums=0):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32)), argnums=argnums)


W = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)) * 0.3, F32)
X = jnp.asarray(np.random.default_rng(1).normal(size=(4, 16)), F32)


# --------------------------------------------------------------------------------------------
# The rules, op by op, forward and backward
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compute", ["mixed_bfloat16", "mixed_float16"])
def test_matmuls_run_in_the_compute_dtype_forward_and_backward(compute):
    half = jaxamp.get_policy(compute).compute_dtype.name

    def f(w, x):
        return jnp.tanh(x @ w) @ w.T

    ac = jaxamp.autocast(f, compute)
    assert matmul_dtypes(ac, W, X) == {half}
    # The gradient's transposed matmuls meet a half-precision cotangent: half too.
    assert matmul_dtypes(grad_of(ac, (0, 1)), W, X) == {half}
    assert ac(W, X).dtype == F32  # what fn returns: the policy's output dtype


def test_precision_sensitive_ops_run_in_fp32_on_half_inputs():
    def f(w, x):
        h = x @ w                       # bf16 under autocast
        z = jnp.exp(h) + jnp.log1p(jnp.abs(h)) + jax.nn.sigmoid(h) + jnp.sqrt(jnp.abs(h))
        return jnp.sum(jax.nn.log_softmax(z, axis=-1) + lax.rsqrt(1.0 + h * h))

    ac = jaxamp.autocast(f)
    names = ("exp", "log", "log1p", "logistic", "sqrt", "rsqrt", "reduce_sum")
    found = operand_dtypes(ac, W, X, names=names)
    assert {n for n, _ in found} == set(names)
    assert {d for _, d in found} == {"float32"}
    found = operand_dtypes(grad_of(ac), W, X, names=names)
    assert {d for _, d in found} == {"float32"}
    # The audit lists no precision-sensitive op in half precision.
    assert jaxamp.audit_grad(ac, W, X).half_sensitive_ops == []


def test_integers_booleans_and_keys_are_never_touched():
    def f(w, x, labels, key):
        logits = x @ w
        noise = jax.random.normal(key, logits.shape)
        keep = labels[:, None] > 2
        return jnp.sum(jnp.where(keep, logits + noise, 0.0)) + jnp.sum(labels)

    labels = jnp.arange(4, dtype=jnp.int32)
    ac = jaxamp.autocast(f)
    jaxpr = jax.make_jaxpr(ac)(W, X, labels, jax.random.key(0))
    ints = [e for e, _ in _jaxpr.walk(jaxpr) if e.primitive.name == "reduce_sum"
            and jnp.issubdtype(e.invars[0].aval.dtype, jnp.integer)]
    assert ints and all(e.invars[0].aval.dtype == jnp.int32 for e in ints)
    np.testing.assert_allclose(ac(W, X, labels, jax.random.key(0)),
                               f(W, X, labels, jax.random.key(0)), rtol=2e-2)


def test_constants_follow_and_the_widest_traced_input_wins():
    def f(w, x, b):
        h = x @ w                                   # bf16
        return (h * 0.5 + jnp.ones((4, 8), F32),    # a Python number, a constant: bf16
                h + b)                              # a traced fp32 operand: fp32

    ac = jaxamp.autocast(f, "p=f32,c=bf16,o=bf16")
    b = jnp.ones((4, 8), F32)
    follow, widest = ac(W, X, b)
    assert follow.dtype == BF16 and widest.dtype == BF16  # outputs cast to output_dtype
    adds = [e for e in eqns(ac, W, X, b) if e.primitive.name == "add"]
    assert [jnp.dtype(e.outvars[0].aval.dtype).name for e in adds] == ["bfloat16", "float32"]


def test_the_function_keeps_fns_signature_and_passes_non_arrays_through_as_static():
    def f(w, x, rows, mode, *, flag=False):
        h = (x @ w).reshape(rows, -1)       # a traced ``rows`` could not set a shape
        if mode == "tanh" and flag:          # nor a traced ``flag`` decide a branch
            h = jnp.tanh(h)
        return {"h": h}

    ac = jaxamp.autocast(f)
    assert inspect.signature(ac) == inspect.signature(f) and ac.__name__ == "f"
    out = ac(W, X, 2, "tanh", flag=True)
    assert out["h"].shape == (2, 16) and out["h"].dtype == F32
    np.testing.assert_allclose(out["h"], f(W, X, 2, "tanh", flag=True)["h"], atol=2e-2)
    names = {e.primitive.name for e in eqns(lambda w, x: ac(w, x, 2, "tanh", flag=False), W, X)}
    assert "tanh" not in names and "dot_general" in names


def test_fn_is_interpreted_once_under_jit_and_on_every_eager_call():
    calls = []

    def f(w, x):
        calls.append(1)
        return jnp.tanh(x @ w)

    jitted = jax.jit(jaxamp.autocast(f))
    for _ in range(3):
        jitted(W, X)
    assert len(calls) == 1
    eager = jaxamp.autocast(f)
    for _ in range(3):
        eager(W, X)
    assert len(calls) == 4


def test_the_program_is_fns_own_ops_with_the_rules_casts_inserted():
    """Nothing but casts is added to the forward program (the names and the checkpoint of
    ``recompute`` are no ops)."""
    def f(w, x):
        h = jnp.tanh(x @ w) * 2.0 + 1.0
        return jax.nn.softmax(h @ w.T, axis=-1)

    no_ops = {"convert_element_type", "name", "remat2", "checkpoint", "pjit", "jit",
              "custom_jvp_call"}

    def ops(fn):
        return Counter(e.primitive.name for e in eqns(fn, W, X)
                       if e.primitive.name not in no_ops)
    ac = jaxamp.autocast(f)
    assert ops(ac) == ops(f)
    assert any(e.primitive.name == "convert_element_type" for e in eqns(ac, W, X))


def test_convolutions_and_ragged_dots_run_in_the_compute_dtype_forward_and_backward():
    def f(w, x, kernel, image):
        grouped = lax.ragged_dot(x, jnp.stack([w, 2 * w]), jnp.array([2, 2], jnp.int32))
        conv = lax.conv_general_dilated(image, kernel, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(grouped ** 2) + jnp.sum(conv ** 2)

    kernel, image = jnp.full((3, 3, 2, 4), 0.1), jnp.ones((1, 6, 6, 2))
    ac = jaxamp.autocast(f)
    names = ("conv_general_dilated", "ragged_dot", "ragged_dot_general")
    for fn in (ac, jax.grad(ac, argnums=(0, 2))):   # operands and outputs, both passes
        found = {(e.primitive.name.replace("ragged_dot_general", "ragged_dot"),
                  jnp.dtype(v.aval.dtype).name) for e in eqns(fn, W, X, kernel, image)
                 if e.primitive.name in names for v in (*e.invars[:2], *e.outvars)}
        assert found == {("conv_general_dilated", "bfloat16"), ("ragged_dot", "bfloat16")}


def test_a_half_precision_matmul_accumulates_in_fp32_on_xla_cpu():
    """4096 bf16 products summed in bf16 (in order, or pairwise) end several ulps off; XLA:CPU
    sums them in fp32 and rounds the result once."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(8, 4096)), BF16)
    b = jnp.asarray(rng.normal(size=(4096, 8)), BF16)
    out = np.asarray(jaxamp.autocast(lambda a, b: a @ b, "p=f32,c=bf16,o=bf16")(a, b),
                     np.float64)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(exact))) - 7)
    assert np.all(np.abs(out - exact) <= 0.51 * ulp)


FP32_RULE_OPS = {
    "exp": jnp.exp, "exp2": jnp.exp2, "log": lambda h: jnp.log(jnp.abs(h) + 1),
    "log1p": lambda h: jnp.log1p(jnp.abs(h)), "expm1": jnp.expm1, "logistic": jax.nn.sigmoid,
    "erf": lax.erf, "erfc": lax.erfc, "erf_inv": lambda h: lax.erf_inv(jnp.tanh(h) * 0.5),
    "pow": lambda h: lax.pow(jnp.abs(h) + 1, h), "rsqrt": lambda h: lax.rsqrt(jnp.abs(h) + 1),
    "sqrt": lambda h: jnp.sqrt(jnp.abs(h)), "cbrt": jnp.cbrt, "tan": jnp.tan,
    "lgamma": lambda h: lax.lgamma(jnp.abs(h) + 1),
    "digamma": lambda h: lax.digamma(jnp.abs(h) + 1),
    "cumsum": lambda h: jnp.cumsum(h, -1), "cumprod": lambda h: jnp.cumprod(h, -1),
    "cumlogsumexp": lambda h: lax.cumlogsumexp(h, axis=1),
    "reduce_sum": lambda h: jnp.sum(h, -1), "reduce_prod": lambda h: jnp.prod(h, -1),
    "reduce_max": lambda h: jnp.max(h, -1), "reduce_min": lambda h: jnp.min(h, -1),
    "fft": lambda h: jnp.abs(jnp.fft.rfft(h, axis=-1)),
}
"""An op of each primitive of the ``float32`` rule, on a bf16 matmul's output."""


@pytest.mark.parametrize("name", sorted(FP32_RULE_OPS))
def test_each_primitive_of_the_float32_rule_runs_in_fp32_on_a_half_input(name):
    def f(w, x):
        return FP32_RULE_OPS[name](x @ w)

    found = operand_dtypes(jaxamp.autocast(f, "p=f32,c=bf16,o=bf16"), W, X, names=(name,))
    assert found == {(name, "float32")}


@pytest.mark.parametrize("reduce", [jnp.max, jnp.min])
def test_reduce_max_and_min_run_in_fp32_so_their_derivatives_sum_in_fp32(reduce):
    def f(w, x):
        return reduce(x @ w, -1)

    name = f"reduce_{reduce.__name__}"
    grad = grad_of(jaxamp.autocast(f, "p=f32,c=bf16,o=bf16"))
    assert operand_dtypes(grad, W, X, names=(name, "reduce_sum")) == {
        (name, "float32"), ("reduce_sum", "float32")}


def test_promoted_ops_take_the_widest_input_and_single_input_ops_follow_theirs():
    def f(w, x, y):
        h = x @ w                                                # bf16
        return (jnp.maximum(h, y), jnp.where(h > 0, h, y), jnp.concatenate([h, y], -1),
                -h, jnp.tanh(h), jnp.tanh(jnp.exp(h)))

    names = ("max", "select_n", "concatenate", "neg", "tanh")
    found = [(e.primitive.name, jnp.dtype(e.outvars[0].aval.dtype).name)
             for e in eqns(jaxamp.autocast(f), W, X, jnp.ones((4, 8)))
             if e.primitive.name in names]
    assert found == [("max", "float32"), ("select_n", "float32"), ("concatenate", "float32"),
                     ("neg", "bfloat16"), ("tanh", "bfloat16"), ("tanh", "float32")]


def test_a_half_cast_fn_makes_and_jaxs_own_promotions_are_kept():
    def f(w, x, labels, y):
        h = x @ w                                                # bf16
        own = h.astype(BF16).astype(F32) * 3.0                  # fn's casts: fp32
        promoted = h.astype(jnp.float16) + y                    # jnp: f16 + f32 is f32
        counted = labels[:, None] + h                           # jnp: i32 + f32 is f32
        return own, promoted, counted

    found = [(e.primitive.name, jnp.dtype(e.outvars[0].aval.dtype).name)
             for e in eqns(jaxamp.autocast(f, "p=f32,c=bf16,o=bf16"), W, X,
                           jnp.arange(4, dtype=jnp.int32), jnp.ones((4, 8)))
             if e.primitive.name in ("mul", "add")]
    assert sorted(found) == [("add", "float32"), ("add", "float32"), ("mul", "float32")]


def test_an_fp32_op_returns_fp32_and_the_next_matmul_casts_it_back():
    def f(w, x):
        e = jnp.exp(x @ w)
        return e @ w.T, e

    found = [(e.primitive.name, jnp.dtype(e.invars[0].aval.dtype).name,
              jnp.dtype(e.outvars[0].aval.dtype).name)
             for e in eqns(jaxamp.autocast(f, "p=f32,c=bf16,o=bf16"), W, X)
             if e.primitive.name in ("exp", "dot_general")]
    assert found == [("dot_general", "bfloat16", "bfloat16"), ("exp", "float32", "float32"),
                     ("dot_general", "bfloat16", "bfloat16")]


# --------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------

def test_per_primitive_rules_override_the_defaults():
    def f(w, x):
        return jnp.sum(jnp.exp(x @ w))
    ac = jaxamp.autocast(f, rules={"exp": "compute", "dot_general": "float32"})
    assert operand_dtypes(ac, W, X, names=("exp", "dot_general")) == {
        ("exp", "bfloat16"), ("dot_general", "float32")}


def test_fp32_scopes_and_full_precision_regions():
    def f(w, x):
        with jax.named_scope("body"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("head"):
            out = h @ w.T
        return out

    ac = jaxamp.autocast(f, fp32_scopes=("head",))
    sites = {(_jaxpr.scope(e), jnp.dtype(e.invars[0].aval.dtype).name)
             for e in eqns(ac, W, X) if e.primitive.name == "dot_general"}
    assert sites == {("body", "bfloat16"), ("head", "float32")}

    def g(w, x):
        return jaxamp.full_precision(lambda a, b: a @ b)(x, w) + jnp.tanh(x @ w)
    assert matmul_dtypes(jaxamp.autocast(g), W, X) == {"float32", "bfloat16"}


@pytest.mark.parametrize("rule,dtype", [("compute", "bfloat16"), ("float32", "float32"),
                                        ("promote", "bfloat16"), ("original", "float32")])
def test_each_rule_runs_an_op_as_documented(rule, dtype):
    def f(w, x):
        return jnp.exp(x @ w)       # exp of a bf16 matmul's output, traced in fp32

    found = operand_dtypes(jaxamp.autocast(f, rules={"exp": rule}), W, X, names=("exp",))
    assert found == {("exp", dtype)}


def test_the_fp8_rule_quantizes_a_dot_general_under_any_half_policy():
    found = operand_dtypes(jaxamp.autocast(lambda w, x: x @ w, rules={"dot_general": "fp8"}),
                           W, X, names=("dot_general",))
    assert found == {("dot_general", "float8_e4m3fn")}


def test_linen_modules_open_a_scope_each_and_fp32_scopes_match_a_module_path():
    import flax.linen as nn

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            gate = jax.nn.softmax(nn.Dense(4, name="router")(x), -1)
            return nn.Dense(8, name="proj")(x) * gate.sum(-1, keepdims=True)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="router")(Encoder(name="Encoder")(x))  # another router

    params = Net().init(jax.random.key(0), X)
    ac = jaxamp.autocast(Net().apply, fp32_scopes=("Encoder/router",))
    found = {(_jaxpr.scope(e), jnp.dtype(e.invars[0].aval.dtype).name)
             for e in eqns(ac, params, X) if e.primitive.name == "dot_general"}
    assert found == {("Net/Encoder/router", "float32"), ("Net/Encoder/proj", "bfloat16"),
                     ("Net/router", "bfloat16")}


def _sites(fn, *args, names=("dot_general",)):
    return {(e.primitive.name, _jaxpr.scope(e), jnp.dtype(e.invars[0].aval.dtype).name)
            for e in eqns(fn, *args) if e.primitive.name in names}


def test_rules_by_name_scope_hold_inside_the_scope_only_the_innermost_deciding():
    def f(w, x):
        with jax.named_scope("body"):
            h = jnp.exp(x @ w)
            with jax.named_scope("inner"):
                h = jnp.tanh(h @ w.T @ w)
        with jax.named_scope("head"):
            out = jnp.exp(h @ w.T)
        return out

    ac = jaxamp.autocast(f, rules={"exp": "compute",               # everywhere
                                   "body": {"dot_general": "float32", "exp": "float32"},
                                   "inner": {"dot_general": "compute"}})
    assert _sites(ac, W, X, names=("dot_general", "exp")) == {
        ("dot_general", "body", "float32"), ("exp", "body", "float32"),
        ("dot_general", "body/inner", "bfloat16"),     # the innermost scope that names it
        ("dot_general", "head", "bfloat16"), ("exp", "head", "bfloat16")}
    # fp32_scopes put every op of a scope in fp32, whatever a scope's rules say
    both = jaxamp.autocast(f, rules={"head": {"dot_general": "compute"}}, fp32_scopes=("head",))
    assert ("dot_general", "head", "float32") in _sites(both, W, X)


def test_rules_by_module_path_and_an_fp8_matmul_in_one_scope():
    import flax.linen as nn

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="proj")(jax.nn.relu(nn.Dense(4, name="router")(x)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="router")(Encoder(name="Encoder")(x))  # another router

    params = Net().init(jax.random.key(0), X)
    ac = jaxamp.autocast(Net().apply, rules={"Encoder/router": {"dot_general": "float32"},
                                             "proj": {"dot_general": "fp8"}})
    sites = _sites(ac, params, X)
    # proj's matmul is FP8's (traced inside fp8_dot_general, under no scope of the model's)
    assert {d for _, _, d in sites} == {"float32", "float8_e4m3fn", "bfloat16"}
    assert {s for s in sites if s[2] != "float8_e4m3fn"} == {
        ("dot_general", "Net/Encoder/router", "float32"), ("dot_general", "Net/router", "bfloat16")}
    np.testing.assert_allclose(np.asarray(ac(params, X)), np.asarray(Net().apply(params, X)),
                               rtol=0.1, atol=0.05)


def test_a_scope_of_rules_that_matches_nothing_is_warned_about_by_name():
    def f(w, x):
        with jax.named_scope("body"):
            return jnp.exp(x @ w)
    with pytest.warns(UserWarning, match=r"the scope 'router' of rules matched no op.*'body'"):
        jax.make_jaxpr(jaxamp.autocast(f, rules={"router": {"exp": "compute"},
                                                 "body": {"exp": "compute"}}))(W, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.make_jaxpr(jaxamp.autocast(f, rules={"body": {"exp": "compute"}}))(W, X)


@pytest.mark.parametrize("rules,error,match", [
    ({"head": {"exp": "fast"}}, ValueError, r"unknown autocast rule 'fast' for primitive 'exp' "
                                            r"in scope 'head'"),
    ({"head": {"Exp": "compute"}}, ValueError, r"primitive names .* got 'Exp' in scope 'head'"),
    ({"head": {"exp": "fp8"}}, ValueError, r"'fp8' is for 'dot_general' only.*in scope 'head'"),
    ({"": {"exp": "compute"}}, TypeError, r"non-empty name scope"),
    ({"exp": 3}, ValueError, r"unknown autocast rule 3 for primitive 'exp'"),
])
def test_bad_rules_by_scope_are_refused_with_the_scope_named(rules, error, match):
    with pytest.raises(error, match=match):
        jaxamp.autocast(lambda x: x, rules=rules)


def test_full_precision_outside_autocast_is_the_function_under_a_name_scope():
    def f(a, b):
        return jnp.tanh(a @ b)

    jaxpr = jax.make_jaxpr(jaxamp.full_precision(f))(X, W)
    assert [(e.primitive.name, str(e.source_info.name_stack)) for e in jaxpr.eqns] == [
        ("dot_general", "jaxamp_full_precision"), ("tanh", "jaxamp_full_precision")]
    np.testing.assert_array_equal(jaxamp.full_precision(f)(X, W), f(X, W))


# --------------------------------------------------------------------------------------------
# Nested jaxprs
# --------------------------------------------------------------------------------------------

def test_jit_remat_custom_jvp_inside_are_entered():
    @jax.jit
    def inner(w, x):
        return jax.nn.relu(x @ w)        # relu is a custom_jvp

    def f(w, x):
        h = jax.checkpoint(inner)(w, x)
        return jax.nn.softmax(h @ w.T, axis=-1)

    ac = jaxamp.autocast(f)
    assert matmul_dtypes(ac, W, X) == {"bfloat16"}
    assert matmul_dtypes(grad_of(ac), W, X) == {"bfloat16"}
    assert any(e.primitive.name in ("remat2", "checkpoint") for e in eqns(ac, W, X))
    np.testing.assert_allclose(ac(W, X), f(W, X), atol=2e-2)


def test_a_scan_over_layers_keeps_its_fp32_carry_and_runs_bf16_matmuls():
    ws = jnp.stack([jnp.eye(16) * 0.9] * 3)

    def f(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w) + h, None
        h, _ = lax.scan(layer, x, ws)   # the carry starts in fp32
        return h

    ac = jaxamp.autocast(f)
    scan = next(e for e in eqns(ac, ws, X) if e.primitive.name == "scan")
    carry = scan.outvars[0].aval
    assert carry.dtype == F32  # invariant: the carry keeps its initial dtype
    assert matmul_dtypes(ac, ws, X) == {"bfloat16"}
    assert matmul_dtypes(grad_of(ac), ws, X) == {"bfloat16"}
    np.testing.assert_allclose(ac(ws, X), f(ws, X), atol=5e-2)


def _scanned_tanh(w, x):
    h, _ = lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
    return h.sum()


def _fori_tanh(w, x):  # static bounds: a scan with the loop counter in its carry
    return lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w[i % 2]), x).sum()


def _scan_with_consts(w, x):  # a closed-over array and an integer in the carry
    c = jnp.full((8, 8), 0.05)

    def step(carry, wi):
        h, k = carry
        return (jnp.tanh(h @ wi @ c), k + 1), h.sum()
    (h, k), ys = lax.scan(step, (x, 0), w, reverse=True, unroll=2)
    return h.sum() + ys.sum() + k


@pytest.mark.parametrize("fn", [_scanned_tanh, _fori_tanh, _scan_with_consts])
def test_a_jitted_scan_and_fori_loop_run_their_matmuls_in_the_compute_dtype(fn):
    """The scan's operands are read as constants, carry and xs on every JAX version (the
    params that say how many of each changed in jax 0.11)."""
    w, x = jnp.ones((2, 8, 8)) * 0.1, jnp.ones((4, 8))
    ac = jax.jit(jaxamp.autocast(fn, "mixed_bfloat16"))
    np.testing.assert_allclose(ac(w, x), fn(w, x), rtol=1e-2)
    assert matmul_dtypes(jaxamp.autocast(fn), w, x) == {"bfloat16"}
    assert matmul_dtypes(grad_of(jaxamp.autocast(fn)), w, x) == {"bfloat16"}
    np.testing.assert_allclose(jax.jit(jax.grad(ac))(w, x), jax.grad(fn)(w, x), rtol=5e-2,
                               atol=5e-2)
    assert jaxamp.audit(ac, w, x).matmul_flops_by_operands.keys() == {"bfloat16"}


def test_while_and_cond_agree_on_dtypes():
    def f(w, x):
        h = x @ w
        h = lax.cond(jnp.sum(h) > 0, lambda t: t * 2.0, lambda t: t.astype(F32) - 1.0, h)
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5),
                              (jnp.int32(0), h))[1]

    out = jaxamp.autocast(f, "p=f32,c=bf16,o=bf16")(W, X)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), f(W, X), atol=5e-2)


def test_a_user_custom_vjp_runs_in_the_dtypes_it_was_written_for():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        assert g.dtype == F32, g.dtype   # written for fp32: it gets fp32
        return (jnp.clip(g, -0.1, 0.1),)
    clip_grad.defvjp(fwd, bwd)

    def f(w, x):
        return jnp.sum(clip_grad(x @ w) ** 2)

    g = jax.grad(jaxamp.autocast(f))(W, X)
    ref = jax.grad(f)(W, X)
    np.testing.assert_allclose(g, ref, rtol=5e-2, atol=1e-2)


def test_effects_pass_through(capsys):
    def f(w, x):
        h = x @ w
        jax.debug.print("mean {m}", m=jnp.mean(h))
        return h
    jax.block_until_ready(jaxamp.autocast(f)(W, X))
    assert "mean" in capsys.readouterr().out


def test_cond_and_switch_promote_their_branches_and_a_while_carry_takes_its_bodys_fp32():
    def f(w, x):
        h = x @ w                                                            # bf16
        c = lax.cond(jnp.sum(h) > 0, lambda t: t * 2.0, jnp.exp, h)          # bf16 | fp32
        s = lax.switch(1, [lambda t: t, jnp.exp, lambda t: -t], h)
        loop = lax.while_loop(lambda a: a[0] < 3, lambda a: (a[0] + 1, jnp.exp(a[1]) * 0.1),
                              (0, h))[1]                                     # starts in bf16
        return c, s, loop

    found = sorted((e.primitive.name, jnp.dtype(e.outvars[-1].aval.dtype).name,
                    tuple({jnp.dtype(v.aval.dtype).name for b in e.params.get("branches", ())
                           for v in b.jaxpr.outvars}))
                   for e in eqns(jaxamp.autocast(f), W, X) if e.primitive.name in ("cond", "while"))
    assert found == [("cond", "float32", ("float32",)), ("cond", "float32", ("float32",)),
                     ("while", "float32", ())]


def _closed_call(fn, *args):
    """``fn`` bound as one ``closed_call`` equation (what JAX's partial evaluation makes of a
    scan's known part)."""
    import jax.extend.core as jex
    inner = jax.make_jaxpr(fn)(*args)
    outer = jax.make_jaxpr(fn)(*args)    # its variables, for the outer jaxpr
    eqn = jex.new_jaxpr_eqn(list(outer.jaxpr.invars), list(outer.jaxpr.outvars),
                            jex.primitives.closed_call_p, {"call_jaxpr": inner},
                            jex.no_effects)
    jaxpr = jex.Jaxpr([], list(outer.jaxpr.invars), list(outer.jaxpr.outvars), [eqn],
                      debug_info=outer.jaxpr.debug_info)
    return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, []))


def test_jit_and_closed_call_are_inlined():
    call = _closed_call(lambda w, x: jnp.tanh(x @ w), W, X)

    def f(w, x):
        return jax.jit(lambda h: h @ w.T)(call(w, x)[0])

    calls = {"closed_call", "eval_jaxpr", "pjit", "jit"}  # eval_jaxpr: closed_call from jax 0.11
    plain = {e.primitive.name for e in jax.make_jaxpr(f)(W, X).eqns}
    assert len(plain & calls) == 2, plain
    ac = jaxamp.autocast(f)
    names = {e.primitive.name for e in eqns(ac, W, X)}
    assert not names & calls
    assert matmul_dtypes(ac, W, X) == {"bfloat16"}
    np.testing.assert_allclose(ac(W, X), f(W, X), atol=2e-2)


def test_pmap_bodies_and_callbacks_run_in_the_dtypes_fn_was_written_for():
    """Given bf16 arguments (as the train step's working params), a ``pmap`` body and a
    callback inside an autocast function see fp32, the dtype ``fn`` is traced with, where
    the ops around them run in bf16."""
    seen = []

    def record(h):
        seen.append(("pure", jnp.dtype(h.dtype).name))
        return h

    def f(w, xs):
        mapped = jax.pmap(lambda x, w: x @ w, in_axes=(0, None))(xs, w)
        h = xs[0] @ w                                            # bf16 under autocast
        jax.debug.callback(lambda v: seen.append(("debug", jnp.dtype(v.dtype).name)), h)
        return mapped, jax.pure_callback(record, jax.ShapeDtypeStruct(h.shape, h.dtype), h)

    w = W.astype(BF16)
    xs = jnp.asarray(np.random.default_rng(2).normal(size=(jax.device_count(), 2, 16)), BF16)
    ac = jaxamp.autocast(f)
    assert operand_dtypes(ac, w, xs) == {("dot_general", "float32"),   # the pmap body's
                                         ("dot_general", "bfloat16")}  # and h's
    mapped, _ = jax.block_until_ready(ac(w, xs))
    jax.effects_barrier()
    assert sorted(seen) == [("debug", "float32"), ("pure", "float32")]
    np.testing.assert_allclose(mapped, f(w.astype(F32), xs.astype(F32))[0], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# The fp32 contract in the train step: nothing computed in fp32 is rounded to half on its way
# --------------------------------------------------------------------------------------------

D_LARGE = 256


def _rms(h):
    """A hand-written RMS norm: its sum of squares (~2e5 at activations near 30) is past
    fp16's 65504."""
    return h * lax.rsqrt(jnp.sum(h * h, -1, keepdims=True) / D_LARGE + 1e-6)


def _reused_statistic(h):
    s = jnp.sum(h * h, -1, keepdims=True)
    return h * lax.rsqrt(s / D_LARGE + 1e-6) + 0.0 * s


def _statistic_through_a_custom_jvp(h):
    """The sum of squares leaves its fp32 region for ``jax.nn.relu`` (a ``custom_jvp``)."""
    return h * lax.rsqrt(jax.nn.relu(jnp.sum(h * h, -1, keepdims=True)) / D_LARGE + 1e-6)


def _loss_of_large_activations(h):
    return _rms(h), jnp.mean(h * h) / 900.0  # a mean of squares of ~2e5 values near 900


@pytest.mark.parametrize("model", ["rms norm", "reused statistic", "custom_jvp",
                                   "mean of squares"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_values_computed_in_fp32_reach_the_next_fp32_op_unrounded(model, policy):
    """The train step hands the model half-precision working params; JAX's own casts in that
    trace (a ``jnp.sum`` of a half array sums in fp32 and rounds the sum back) used to round
    the fp32 statistics to fp16: zeros (rsqrt of inf), nan, or an inf loss, each applied as a
    finite step. Autocast traces the model as written, in fp32."""
    norm = {"rms norm": _rms, "reused statistic": _reused_statistic,
            "custom_jvp": _statistic_through_a_custom_jvp, "mean of squares": None}[model]

    def loss_fn(params, batch):
        h = batch["x"] @ params["w1"]  # activations near 30
        if norm is None:
            h, extra = _loss_of_large_activations(h)
        else:
            h, extra = norm(h), 0.0
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2) + extra

    k = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k[0], (64, D_LARGE)) * 30 / 8,
              "w2": jax.random.normal(k[1], (D_LARGE, 1)) / 16}
    batch = {"x": jax.random.normal(k[2], (32, 64)), "y": jnp.ones((32, 1))}
    fp32 = float(loss_fn(params, batch))
    tx = jaxamp.mixed_precision(optax.adam(1e-3), policy,
                                loss_scale=jaxamp.StaticLossScale(1.0))
    state = jaxamp.TrainState.create(params=params, tx=tx)
    _, m = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))(state, batch)
    assert bool(m["grads_finite"])
    np.testing.assert_allclose(float(m["loss"]), fp32, rtol=2e-2)


def test_a_custom_vjp_and_a_full_precision_region_run_in_fp32_in_the_train_step():
    """The train step's working params are bf16; the custom derivative and the
    full_precision region still get the fp32 they were written for."""
    seen = []

    @jax.custom_vjp
    def sqrt_bound(x):
        seen.append(("primal", jnp.dtype(x.dtype).name))
        return jnp.sqrt(x)

    def fwd(x):
        return sqrt_bound(x), x

    def bwd(x, g):
        seen.append(("bwd", jnp.dtype(g.dtype).name))
        return (g / (2 * jnp.sqrt(jnp.maximum(x, 0.1))),)
    sqrt_bound.defvjp(fwd, bwd)

    def loss_fn(params, batch):
        a = jax.nn.sigmoid(batch["x"] @ params["w"])
        gate = sqrt_bound(1 - a ** 2)
        head = jaxamp.full_precision(lambda h, w: h @ w)(gate, params["v"])
        seen.append(("head", jnp.dtype(head.dtype).name))
        return jnp.mean(head ** 2)

    params = {"w": W, "v": W.T * 0.1}
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True, warn_fp32_matmuls=False))
    jaxpr = jax.make_jaxpr(step)(state, {"x": X})
    assert set(seen) == {("primal", "float32"), ("bwd", "float32"), ("head", "float32")}
    heads = [e for e, _ in _jaxpr.walk(jaxpr) if e.primitive.name == "dot_general"
             and "jaxamp_full_precision" in str(e.source_info.name_stack)]
    assert heads and all(v.aval.dtype == F32 for e in heads for v in e.invars)


GEMMA_MASK = -2.3819763e38  # the logits' mask constant of Google DeepMind's gemma


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_mask_constant_past_the_half_range_becomes_its_finite_extreme(policy):
    """fp16 turned Gemma's mask into -inf, and a fully masked row into nan. An infinity the
    model writes stays one."""
    def f(w, x, mask):
        logits = jnp.where(mask, x @ w, GEMMA_MASK)
        return jax.nn.log_softmax(logits, -1), jnp.where(mask, x @ w, -jnp.inf)

    mask = jnp.array([[True, False, True, True], [False] * 4, [True] * 4])
    w, x = jnp.ones((8, 4)) * 0.1, jnp.ones((3, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning from inside jax or numpy
        logp, inf_masked = jax.jit(jaxamp.autocast(f, policy))(w, x, mask)
    ref, _ = f(w, x, mask)
    assert np.isfinite(np.asarray(logp)).all()
    np.testing.assert_allclose(np.asarray(logp)[1:], np.asarray(ref)[1:], rtol=1e-2)
    half = jaxamp.get_policy(policy).compute_dtype
    assert float(logp[0, 1]) <= 0.99 * max(GEMMA_MASK, -float(jnp.finfo(half).max))
    assert float(inf_masked[0, 1]) == -np.inf


# --------------------------------------------------------------------------------------------
# A model's own remat is kept
# --------------------------------------------------------------------------------------------

D_BLOCK, N_TOKENS = 64, 32


def _post_norm_block(p, x):
    h = jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    y = x + h
    return y * lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)


def _blocks(remat):
    k = jax.random.split(jax.random.key(3), 8)
    params = [{"w1": jax.random.normal(k[2 * i], (D_BLOCK, 4 * D_BLOCK)) / 8,
               "w2": jax.random.normal(k[2 * i + 1], (4 * D_BLOCK, D_BLOCK)) / 16}
              for i in range(4)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *params)
    block = {"none": _post_norm_block,
             "checkpoint": jax.checkpoint(_post_norm_block),
             "scan + dots policy": jax.checkpoint(
                 _post_norm_block, policy=jax.checkpoint_policies.dots_saveable),
             "scan": jax.checkpoint(_post_norm_block),
             "scan, no remat": _post_norm_block}[remat]

    def model(params, x):
        if remat.startswith("scan"):
            x = lax.scan(lambda h, p: (block(p, h), None), x, params)[0]
        else:
            for p in params:
                x = block(p, x)
        return jnp.mean(x ** 2)
    scanned = remat.startswith("scan")
    return model, (stacked if scanned else params)


@pytest.mark.parametrize("recompute", [None, True])
@pytest.mark.parametrize("remat", ["none", "checkpoint", "scan", "scan + dots policy"])
def test_a_models_own_remat_is_kept_and_autocast_saves_less_than_fp32(remat, recompute):
    """Autocast's recompute policy used to reach inside a model's ``jax.checkpoint`` (JAX applies
    the outermost policy to nested remats): it saved every matmul output the model's remat had
    given up, 3.4x fp32's bytes on four checkpointed blocks. By default (``None``) a model that
    remats keeps what its remat keeps; under ``recompute=True`` too."""
    model, params = _blocks(remat)
    x = jax.random.normal(jax.random.key(4), (N_TOKENS, D_BLOCK))
    fp32 = jaxamp.audit_grad(model, params, x).saved_bytes
    ac = jaxamp.audit_grad(jaxamp.autocast(model, recompute=recompute), params, x.astype(BF16))
    assert ac.saved_bytes <= 0.6 * fp32, (ac.saved_bytes, fp32)
    assert ac.saved_bytes_by_dtype.get("float32", 0) == 0
    if remat in ("checkpoint", "scan"):  # only the blocks' inputs and the last one's output, in
        # bf16 (x is an argument; a scan stacks its 4 carries and keeps its final one)
        boundaries = 4 if remat == "checkpoint" else 5
        assert ac.saved_bytes == boundaries * N_TOKENS * D_BLOCK * 2, ac.saved_bytes_by_dtype
        # and no block runs more often than under the model's remat alone
        assert ac.total_matmul_flops == jaxamp.audit_grad(model, params, x).total_matmul_flops
    if remat == "checkpoint":  # 3.44x fp32's bytes when autocast's policy reached inside
        assert ac.saved_bytes == 0.5 * fp32


def _scans_stacking(jaxpr, leading: tuple) -> int:
    """The scans (nested ones included) with an output stacked as ``leading + (...)``."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "scan" and any(
            tuple(v.aval.shape[:len(leading)]) == leading for v in eqn.outvars)
        count += sum(_scans_stacking(j, leading) for j, _ in _jaxpr.sub_jaxprs(eqn))
    return count


@pytest.mark.parametrize("remat", ["scan, no remat", "scan"])
def test_a_scan_is_recomputed_step_by_step_in_the_backward_pass(remat):
    """Under ``recompute=True`` a scan's steps are recomputed in the backward scan, one step at
    a time: only the forward scan stacks activations (4 steps of ``[N_TOKENS, ...]``). Autocast
    used to run the whole forward scan a second time before the backward one, stacking every
    step's recomputed values (on an H200, 3 attention-sized stacks of 12 layers where fp32
    keeps 2)."""
    model, params = _blocks(remat)
    x = jax.random.normal(jax.random.key(4), (N_TOKENS, D_BLOCK)).astype(BF16)
    grad = jax.make_jaxpr(jax.grad(jaxamp.autocast(model)))(params, x)
    assert _scans_stacking(grad.jaxpr, (4, N_TOKENS)) == 1
    np.testing.assert_allclose(  # the same gradient as without recompute
        jax.tree.leaves(jax.jit(jax.grad(jaxamp.autocast(model)))(params, x))[0].astype(
            jnp.float32),
        jax.tree.leaves(jax.jit(jax.grad(jaxamp.autocast(model, recompute=False)))(
            params, x))[0].astype(jnp.float32), rtol=1e-2, atol=1e-3)


def test_a_models_remat_policy_decides_what_is_kept_inside_it():
    model, params = _blocks("scan + dots policy")
    nothing, _ = _blocks("scan")
    x = jax.random.normal(jax.random.key(4), (N_TOKENS, D_BLOCK)).astype(BF16)
    with_dots = jaxamp.audit_grad(jaxamp.autocast(model), params, x).saved_bytes
    without = jaxamp.audit_grad(jaxamp.autocast(nothing), params, x).saved_bytes
    # dots_saveable keeps the block's two matmul outputs (4 + 1 activations wide) per block
    assert with_dots - without == 4 * N_TOKENS * 5 * D_BLOCK * 2


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_an_nnx_remat_model_trains_under_autocast_like_fp32(policy):
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)
            self.norm = nnx.RMSNorm(32, rngs=rngs)

        def __call__(self, x):
            return self.norm(x + self.down(jax.nn.gelu(self.up(x))))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(3)]) if hasattr(nnx, "List") \
                else [Block(rngs) for _ in range(3)]
            self.head = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            for b in self.blocks:
                x = nnx.remat(lambda b, x: b(x))(b, x)
            return self.head(x)

    graphdef, params = nnx.split(Net(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    batch = {"x": jax.random.normal(jax.random.key(1), (16, 32)), "y": jnp.arange(16) % 4}
    losses = {}
    for name in ("float32", policy):
        tx = jaxamp.mixed_precision(optax.adam(1e-3), name)
        state = jaxamp.TrainState.create(params=params, tx=tx)
        step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=name != "float32"))
        for _ in range(10):
            state, m = step(state, batch)
        losses[name] = float(m["loss"])
    working = jaxamp.get_policy(policy).cast_params_to_compute(params)
    fp32 = jaxamp.audit_grad(loss_fn, params, batch).saved_bytes
    ac = jaxamp.audit_grad(jaxamp.autocast(loss_fn, policy), working,
                           jaxamp.get_policy(policy).cast_to_compute(batch))
    assert ac.saved_bytes <= 0.6 * fp32
    np.testing.assert_allclose(losses[policy], losses["float32"], rtol=0.05)


# --------------------------------------------------------------------------------------------
# Users' models, as users write them: fp32 layers, no dtype=
# --------------------------------------------------------------------------------------------

def _gpt_loss():
    from train.models import nnx_gpt
    loss_fn, params = nnx_gpt.loss_and_params(vocab=64, width=32, depth=2, heads=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 17)), jnp.int32)
    return loss_fn, params, {"tokens": tokens}


def _linen_encoder_loss():
    from train.models.linen_encoder import variants
    name, loss, params, tokens = variants(vocab=64, width=32, depth=1, heads=2, mlp=64, batch=2,
                                          seq_len=8)[0]  # fp32
    return loss, params, tokens


def _equinox_loss():
    import equinox as eqx
    model = eqx.nn.MLP(in_size=4, out_size=1, width_size=32, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, batch):
        pred = jax.vmap(eqx.combine(params, static))(batch["x"])[:, 0]
        return jnp.mean((pred - batch["y"]) ** 2)
    return loss_fn, params, make_batch()


def _linen_resnet_loss():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.Conv(8, (3, 3))(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
            x = nn.Conv(8, (3, 3), strides=2)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
            return nn.Dense(10)(x.mean((1, 2)))

    net = Net()
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
    variables = net.init(jax.random.key(0), x)

    def loss_fn(params, batch):
        logits, _ = net.apply({"params": params, "batch_stats": variables["batch_stats"]},
                              batch["x"], mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss_fn, variables["params"], {"x": x, "y": jnp.arange(4) % 10}


def _nnx_scan_loss():
    """Layers stacked with ``nnx.vmap`` and run with ``nnx.scan``: flax's scan-over-layers."""
    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.linear = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            return x + jax.nn.gelu(self.linear(self.norm(x)))

    class Stack(nnx.Module):
        def __init__(self, depth: int, rngs: nnx.Rngs):
            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return Block(rngs)
            self.blocks = create(rngs)
            self.head = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)
            return self.head(body(x, self.blocks))[:, 0]

    graphdef, params = nnx.split(Stack(3, nnx.Rngs(0)), nnx.Param)
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def loss_fn(params, batch):
        return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)
    return loss_fn, params, {"x": x, "y": jnp.sin(x[:, 0])}


def _linen_scan_loss():
    """Linen ``nn.scan`` over encoder blocks, the carry starting in fp32."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            h = nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
            x = x + h
            return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))), None

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 16)(tokens)
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=3)()(x, None)
            return nn.Dense(64)(nn.LayerNorm()(x))

    net = Encoder()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)
    params = net.init(jax.random.key(0), tokens)["params"]

    def loss_fn(params, tokens):
        logits = net.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
    return loss_fn, params, tokens


def _equinox_transformer_loss():
    """An Equinox transformer block on one sequence, vmapped over the batch."""
    import equinox as eqx

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, width, heads, key):
            k1, k2 = jax.random.split(key)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
            self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
            self.mlp = eqx.nn.MLP(width, width, 4 * width, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x_LxD):
            h = jax.vmap(self.norm1)(x_LxD)
            x_LxD = x_LxD + self.attention(h, h, h)
            return x_LxD + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x_LxD))

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(64, 16, key=keys[0])
            self.blocks = [Block(16, 2, k) for k in keys[1:3]]
            self.head = eqx.nn.Linear(16, 64, key=keys[3])

        def __call__(self, tokens_L):
            x = jax.vmap(self.embed)(tokens_L)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(x)

    params, static = eqx.partition(Model(jax.random.key(0)), eqx.is_inexact_array)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)

    def loss_fn(params, tokens):
        logits = jax.vmap(eqx.combine(params, static))(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
    return loss_fn, params, tokens


MODELS = {"nnx_gpt": _gpt_loss, "linen_encoder": _linen_encoder_loss,
          "equinox_mlp": _equinox_loss, "linen_resnet_bn": _linen_resnet_loss,
          "nnx_scan_over_layers": _nnx_scan_loss, "linen_scan_over_layers": _linen_scan_loss,
          "equinox_transformer": _equinox_transformer_loss}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_users_models_run_every_matmul_in_bf16_with_close_values_and_grads(name):
    loss_fn, params, batch = MODELS[name]()  # the trap without autocast: tests/benchmarks
    ac = jaxamp.autocast(loss_fn)
    report = jaxamp.audit_grad(ac, params, batch)
    assert report.share("bfloat16") >= 0.99
    assert report.half_sensitive_ops == []
    # Jitted, as users run them (op by op, these 7 models took 140 s of the suite).
    l32, g32 = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    lac, gac = jax.jit(jax.value_and_grad(ac))(params, batch)
    np.testing.assert_allclose(float(lac), float(l32), rtol=3e-2)
    num = sum(float(jnp.sum((a.astype(F32) - b) ** 2)) for a, b in
              zip(jax.tree.leaves(gac), jax.tree.leaves(g32), strict=True))
    den = sum(float(jnp.sum(b ** 2)) for b in jax.tree.leaves(g32))
    assert (num / den) ** 0.5 < 0.05  # relative error of the whole gradient


def test_make_train_step_autocast_trains_the_nnx_gpt_in_bf16():
    loss_fn, params, batch = _gpt_loss()
    tx = jaxamp.mixed_precision(optax.adam(3e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))
    with pytest.warns(UserWarning, match="run in float32"):   # without autocast: the trap
        jax.jit(jaxamp.make_train_step(loss_fn)).lower(state, batch)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # with autocast: no fp32 matmul left to warn about
        losses = []
        for _ in range(15):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    assert losses[-1] < 0.7 * losses[0]
    report = jaxamp.audit(step, state, batch)
    assert report.share("bfloat16") >= 0.99


# --------------------------------------------------------------------------------------------
# Parallel layouts
# --------------------------------------------------------------------------------------------

def test_pmap_and_an_8_way_sharded_jit_equal_one_device():
    ac = jaxamp.autocast(mse_loss)
    params, batch = init_params(), make_batch()
    one = jax.grad(ac)(params, batch)
    pmapped = jax.pmap(lambda p, b: lax.pmean(jax.grad(ac)(p, b), "d"), axis_name="d")(
        jaxamp.parallel.replicate(params), jaxamp.parallel.shard_batch(batch))
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    sharded = jax.jit(jax.grad(ac))(jax.device_put(params, NamedSharding(mesh, P())),
                                    jaxamp.parallel.put_sharded(
                                        batch, NamedSharding(mesh, P("batch"))))
    for a, b, c in zip(jax.tree.leaves(one), jax.tree.leaves(jaxamp.parallel.unreplicate(pmapped)),
                       jax.tree.leaves(sharded), strict=True):
        # bf16 matmuls over 8 shards round their partial sums differently: 1% of the scale.
        tol = 1e-2 * float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(b, a, atol=tol)
        np.testing.assert_allclose(c, a, atol=tol)


def test_vmap_of_an_autocast_function():
    ac = jaxamp.autocast(lambda w, x: x @ w)
    out = jax.vmap(ac, in_axes=(None, 0))(W, jnp.stack([X, 2 * X]))
    assert out.shape == (2, 4, 8) and out.dtype == F32
    np.testing.assert_allclose(out[1], 2 * (X @ W), rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,error,words", [
    (lambda: jaxamp.autocast(3), TypeError, ["autocast needs a callable fn", "int"]),
    (lambda: jaxamp.autocast(jnp.sin, rules={"exp": "fp4"}), ValueError,
     ["unknown autocast rule 'fp4'", "'exp'", "compute, float32, promote, original, fp8"]),
    (lambda: jaxamp.autocast(jnp.sin, rules={"exp": "fp8"}), ValueError,
     ["rule 'fp8' is for 'dot_general' only", "'exp'"]),
    (lambda: jaxamp.autocast(jnp.sin, rules={"Exp!": "compute"}), ValueError,
     ["primitive names", "'Exp!'"]),
    (lambda: jaxamp.autocast(jnp.sin, rules=["exp"]), TypeError, ["rules must be a dict"]),
    (lambda: jaxamp.autocast(jnp.sin, "p=f32,c=i32"), ValueError, ["unknown compute dtype"]),
    (lambda: jaxamp.autocast(jnp.sin, fp32_scopes=("",)), TypeError, ["fp32_scopes"]),
    (lambda: jaxamp.full_precision(None), TypeError, ["full_precision needs a callable"]),
])
def test_bad_input_is_a_clear_error(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --------------------------------------------------------------------------------------------
# Memory: fp32 regions keep only half-precision tensors for the backward pass
# --------------------------------------------------------------------------------------------

def test_an_fp32_norm_region_saves_only_its_half_precision_input():
    ln = nnx.LayerNorm(64, rngs=nnx.Rngs(0))           # flax upcasts to fp32 inside
    graphdef, params = nnx.split(ln, nnx.Param)
    params = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(params)
    x = jax.random.normal(jax.random.key(0), (4, 32, 64)).astype(BF16)

    def f(p, x):
        return nnx.merge(graphdef, p)(x)
    saved = jaxamp.audit_grad(jaxamp.autocast(f), params, x).saved_bytes_by_dtype
    assert saved.get("float32", 0) == 0, saved
    plain = jaxamp.audit_grad(f, params, x).saved_bytes_by_dtype
    assert plain["float32"] >= 4 * x.size  # without autocast: an fp32 copy of x, at least
    # The region is computed in fp32: the same value as flax's own LayerNorm, to bf16 rounding.
    np.testing.assert_allclose(np.asarray(jaxamp.autocast(f, "p=f32,c=bf16,o=f32")(params, x)),
                               np.asarray(f(params, x), np.float32), atol=2e-2)


def test_bias_and_broadcast_gradients_sum_in_fp32():
    def f(w, b, x):
        return jnp.sum((x @ w + b).astype(F32))

    w, b = W.astype(BF16), jnp.ones((8,), BF16)
    grad = jax.grad(jaxamp.autocast(f), argnums=1)
    sums = [jnp.dtype(e.invars[0].aval.dtype).name for e in eqns(grad, w, b, X)
            if e.primitive.name == "reduce_sum"]
    assert sums and set(sums) == {"float32"}
    np.testing.assert_allclose(np.asarray(grad(w, b, X), F32), np.full(8, 4.0))


def test_a_param_row_taken_by_index_and_broadcast_has_its_gradient_summed_in_fp32():
    """Griffin's Conv1D: ``x_window * w[i][None, None, :]`` for each tap ``i``."""
    def conv1d(w, x):
        width = w.shape[0]
        y = 0.0
        for shift in range(width):
            window = x[:, : x.shape[1] - shift]
            window = jnp.pad(window, ((0, 0), (shift, 0), (0, 0)))
            y = y + window * w[width - shift - 1][None, None, :]
        return jnp.sum(y.astype(F32) ** 2)

    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), BF16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 64, 16)), BF16)
    grad = jax.grad(jaxamp.autocast(conv1d))
    sums = [e for e in eqns(grad, w, x) if e.primitive.name == "reduce_sum"]
    summing = [e for e in sums if any(e.invars[0].aval.shape[a] > 1 for a in e.params["axes"])]
    assert summing and all(e.invars[0].aval.dtype == F32 for e in summing)
    assert jaxamp.audit_grad(jaxamp.autocast(conv1d), w, x).half_sensitive_ops == []
    np.testing.assert_allclose(np.asarray(grad(w, x), F32),
                               jax.grad(conv1d)(w.astype(F32), x.astype(F32)), rtol=2e-2,
                               atol=2e-2)


def test_the_transpose_of_a_broadcast_that_adds_unit_axes_stays_in_half_unlisted():
    """``w[None, :]`` adds a unit axis: its transpose sums one value, exactly, in bf16; the
    broadcast over the batch that follows sums in fp32."""
    def f(w, x, v):
        return jnp.sum(((x * w[None, :]) @ v).astype(F32))

    w, x, v = jnp.ones((16,), BF16), jnp.ones((4, 16), BF16), jnp.ones((16, 8), BF16)
    grad = jax.grad(jaxamp.autocast(f))
    sums = [e for e in eqns(grad, w, x, v) if e.primitive.name == "reduce_sum"]
    one_value = [e.invars[0].aval for e in sums
                 if all(e.invars[0].aval.shape[a] == 1 for a in e.params["axes"])]
    many = [e.invars[0].aval for e in sums
            if not all(e.invars[0].aval.shape[a] == 1 for a in e.params["axes"])]
    assert one_value and all(a.dtype == BF16 for a in one_value)
    assert many and all(a.dtype == F32 for a in many)
    assert jaxamp.audit_grad(jaxamp.autocast(f), w, x, v).half_sensitive_ops == []
    np.testing.assert_allclose(np.asarray(grad(w, x, v), F32), np.full(16, 32.0))


@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_a_step_whose_loss_is_not_finite_is_skipped_under_autocast(value):
    def loss_fn(params, batch):  # finite gradients, the loss inf or nan through ``blind``
        return mse_loss(params, batch) + lax.stop_gradient(jnp.mean(batch["blind"]))

    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))
    batch = {**make_batch(), "blind": np.zeros((16,), np.float32)}
    state, m = step(state, batch)
    assert bool(m["grads_finite"])
    before = state
    state, m = step(state, {**batch, "blind": batch["blind"].copy() + value})
    assert not np.isfinite(float(m["loss"])) and not bool(m["grads_finite"])
    assert_tree_bitwise_equal(state.params, before.params)


def test_under_recompute_the_arguments_and_their_casts_are_not_saved():
    """Neither as a matmul's operands (their bf16 casts) nor as the inputs of a model's own
    remat: the backward pass casts them again. With ``recompute=False`` JAX's default saves
    the casts too (``x`` and ``w`` in bf16 here, 384 bytes)."""
    def f(w, x):
        h = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x)
        return jnp.mean(h ** 2) + jnp.mean(jnp.tanh(x @ w))

    saved = jaxamp.audit_grad(jaxamp.autocast(f, recompute=True), W, X,
                              argnums=(0, 1)).saved_bytes_by_dtype
    # x @ w outside the remat and the remat's output (kept, not run again), nothing else
    assert saved == {"bfloat16": 2 * 4 * 8 * 2}


def test_by_default_recompute_defers_to_a_models_own_remat():
    """``recompute=None`` (the default) is ``True`` for a function with no remat of its own,
    and ``False`` for one that holds a ``jax.checkpoint`` anywhere (here inside a scan): the
    model's remat decides what is kept, and what lies outside it keeps JAX's default."""
    def plain(w, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2)

    def remat(w, x):
        def layer(h, _):
            return jax.checkpoint(lambda h: jnp.tanh(h @ w) @ w.T)(h), None
        h = lax.scan(layer, jnp.tanh(x @ w) @ w.T, None, length=2)[0]
        return jnp.mean(jnp.tanh(h) ** 2)

    def saved(f, **kw):
        return jaxamp.audit_grad(jaxamp.autocast(f, **kw), W, X,
                                 argnums=(0, 1)).saved_bytes_by_dtype
    assert saved(plain) == saved(plain, recompute=True) != saved(plain, recompute=False)
    assert saved(remat) == saved(remat, recompute=False) != saved(remat, recompute=True)


@pytest.mark.parametrize("op", ["sort", "pooling window", "cumsum", "none"])
def test_recompute_keeps_the_outputs_of_sorts_pooling_windows_and_cumulative_ops(op):
    """Beside the first matmul's output (2 bytes an element), each such op's output is kept,
    not run again in the backward pass."""
    kept = {"sort": {"bfloat16": 2 + 2, "uint32": 4},   # the values, and the order they had
            "pooling window": {"bfloat16": 2 + 2},
            "cumsum": {"bfloat16": 2, "float32": 4},    # an fp32 op: its output in fp32
            "none": {"bfloat16": 2}}[op]
    w1 = jax.random.normal(jax.random.key(0), (16, 64)) * 0.1
    w2 = jax.random.normal(jax.random.key(1), (64, 8)) * 0.1
    middle = {"sort": lambda h: jnp.sort(h, -1), "cumsum": lambda h: jnp.cumsum(h, -1),
              "pooling window": lambda h: lax.reduce_window(h, -jnp.inf, lax.max, (1, 2),
                                                            (1, 1), "SAME"),
              "none": lambda h: h}[op]

    def f(w1, w2, x):
        return jnp.mean(jnp.tanh(middle(jnp.tanh(x @ w1))) @ w2)

    saved = jaxamp.audit_grad(jaxamp.autocast(f), w1, w2, X, argnums=(0, 1))
    assert saved.saved_bytes_by_dtype == {d: n * 4 * 64 for d, n in kept.items()}


def test_recompute_is_the_default_under_a_half_compute_dtype_only():
    w1 = jax.random.normal(jax.random.key(0), (16, 64)) * 0.1
    w2 = jax.random.normal(jax.random.key(1), (64, 8)) * 0.1

    def f(w1, w2, x):
        return jnp.mean(jax.nn.gelu(x @ w1) @ w2)

    def saved(fn):
        return jaxamp.audit_grad(fn, w1, w2, X, argnums=(0, 1)).saved_bytes_by_dtype
    assert saved(jaxamp.autocast(f)) == {"bfloat16": 4 * 64 * 2}          # recomputed
    # fp32: JAX's default, several [4, 64] tensors of the GELU (6 on jax 0.10, 5 on 0.11)
    assert saved(jaxamp.autocast(f, "float32")) == saved(f)
    assert set(saved(f)) == {"float32"} and saved(f)["float32"] >= 4 * 4 * 64 * 4


def test_the_users_gpt_saves_less_than_fp32_and_almost_nothing_in_fp32():
    loss_fn, params, batch = _gpt_loss()
    working = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(params)
    fp32 = jaxamp.audit_grad(loss_fn, params, batch)
    trap = jaxamp.audit_grad(loss_fn, working, batch)
    ac = jaxamp.audit_grad(jaxamp.autocast(loss_fn), working, batch)
    assert trap.saved_bytes > fp32.saved_bytes          # the promotion trap saves more
    assert ac.saved_bytes < 0.85 * fp32.saved_bytes
    assert ac.saved_bytes_by_dtype.get("float32", 0) < 0.01 * ac.saved_bytes


def test_explain_overflow_and_audit_see_through_an_autocast_loss():
    def loss_fn(params, batch):
        with jax.named_scope("layer1"):
            h = batch["x"] @ params["w1"]
        with jax.named_scope("layer2"):
            h = jnp.exp(h) @ params["w2"]
        return jnp.mean(h)

    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    state = jaxamp.TrainState.create(params={"w1": jnp.full((4, 4), 8.0), "w2": jnp.ones((4, 1))},
                                     tx=tx)
    batch = {"x": jnp.ones((2, 4))}
    report = jaxamp.explain_overflow(state, batch, jaxamp.autocast(loss_fn, state.policy))
    # exp runs in fp32 under autocast (e^32 is finite there); its fp16 result overflows.
    assert report.first_forward is not None
    assert report.first_forward.layer == "layer2"
    assert jaxamp.audit(jaxamp.autocast(loss_fn, "mixed_float16"), state.params,
                        batch).share("float16") == 1.0


@pytest.mark.parametrize("name", ["nnx_scan_over_layers", "linen_scan_over_layers"])
def test_scan_over_layers_stays_a_scan_with_an_fp32_carry(name):
    loss_fn, params, batch = MODELS[name]()
    jaxpr = jax.make_jaxpr(jaxamp.autocast(loss_fn))(params, batch)
    scans = [e for e, _ in _jaxpr.walk(jaxpr) if e.primitive.name == "scan"]
    assert scans, "the layers were unrolled"
    _, num_carry = _jaxpr.scan_layout(scans[0])
    carry_dtypes = {jnp.dtype(v.aval.dtype) for v in scans[0].outvars[:num_carry]
                    if jnp.issubdtype(v.aval.dtype, jnp.floating)}
    assert carry_dtypes == {jnp.dtype(F32)}   # the residual stream, as the user wrote it
    body = scans[0].params["jaxpr"]
    assert {d for e, _ in _jaxpr.walk(body) if e.primitive.name == "dot_general"
            for d in (jnp.dtype(v.aval.dtype).name for v in e.invars)} == {"bfloat16"}


def test_recompute_keeps_only_the_matmul_outputs_for_the_backward_pass():
    w1 = jax.random.normal(jax.random.key(0), (16, 64)) * 0.1
    w2 = jax.random.normal(jax.random.key(1), (64, 8)) * 0.1

    def f(w1, w2, x):   # a tanh GELU alone saves six tensors of its input's size
        return jnp.mean(jax.nn.gelu(x @ w1) @ w2)

    saved = jaxamp.audit_grad(jaxamp.autocast(f), w1, w2, X, argnums=(0, 1)).saved_bytes_by_dtype
    # x @ w1 alone, in bf16: the second matmul's operand gelu(x @ w1) is recomputed from it
    # with GELU's intermediates, and x and the weights are arguments (their casts recomputed).
    assert saved == {"bfloat16": X.shape[0] * 64 * 2}
    kept = jaxamp.audit_grad(jaxamp.autocast(f, recompute=False), w1, w2, X,
                             argnums=(0, 1)).saved_bytes
    assert kept >= 5 * X.shape[0] * 64 * 2
    g = jax.grad(jaxamp.autocast(f), argnums=(0, 1))(w1, w2, X)
    g_kept = jax.grad(jaxamp.autocast(f, recompute=False), argnums=(0, 1))(w1, w2, X)
    for a, b in zip(g, g_kept, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_recompute_keeps_the_scores_not_the_probabilities():
    """Attention saves its scores (a matmul's output) and recomputes the softmax from them: one
    [L, L] tensor per head instead of two (on an H200 the GPT's temporaries shrink by a
    quarter)."""
    q, k, v = (jax.random.normal(jax.random.key(i), (4, 32, 16)) for i in range(3))

    def f(q, k, v):
        scores = jnp.einsum("hld,hmd->hlm", q, k) / 4.0
        mask = jnp.tril(jnp.ones((32, 32), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        return jnp.mean(jnp.einsum("hlm,hmd->hld", probs, v) ** 2)

    saved = jaxamp.audit_grad(jaxamp.autocast(f), q, k, v, argnums=(0, 1, 2))
    assert saved.saved_bytes_by_dtype == {"bfloat16": 4 * 32 * 32 * 2 + 4 * 32 * 16 * 2}
    g = jax.grad(jaxamp.autocast(f), argnums=(0, 1, 2))(q, k, v)
    g_kept = jax.grad(jaxamp.autocast(f, recompute=False), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g_kept, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_attention_calls_are_found_where_jax_traced_them():
    """``jax.nn.dot_product_attention``'s calls, found in the jaxpr by where JAX traced them and
    confirmed by tracing JAX's function again: the options read back (scale, causal, a bias and
    a mask), a function imported by name, two calls in a row from one line, 3-d operands. Not a
    call that names its implementation, a ``vmap`` of the call, sequence lengths, a local
    window or the residual: those run as they are."""
    from jax.nn import dot_product_attention as imported

    from jaxamp._autocast import _attention
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 4, 16)) for i in range(3))
    mask, bias = jnp.tril(jnp.ones((8, 8), bool))[None, None], jnp.zeros((1, 4, 8, 8))
    lengths = jnp.array([3, 8], jnp.int32)

    def f(q, k, v):
        o = imported(q * 2, k, v, is_causal=True)
        o = jax.nn.dot_product_attention(o, k, v, scale=0.5) + 1
        o = jax.nn.dot_product_attention(o, k, v, bias, mask)
        o = jax.nn.dot_product_attention(o, k, v, implementation="xla")
        for _ in range(2):
            o = jax.nn.dot_product_attention(o, k, v)
        o = jax.vmap(jax.nn.dot_product_attention)(o, k, v)
        o = jax.nn.dot_product_attention(o, k, v, key_value_seq_lengths=lengths)
        o = jax.nn.dot_product_attention(o, k, v, local_window_size=(2, 2))
        o = jax.nn.dot_product_attention(o, k, v, return_residual=True)[0]
        return jax.nn.dot_product_attention(o[0], k[0], v[0])

    calls = _attention.find_calls(jax.make_jaxpr(f)(q, k, v).jaxpr)
    found = [(c.options, [tuple(x.aval.shape) for x in c.inputs]) for c in calls.values()]
    plain = {"scale": 0.25, "is_causal": False, "bias": False, "mask": False}
    qkv = [(2, 8, 4, 16)] * 3
    assert found == [
        ({**plain, "is_causal": True}, qkv),
        ({**plain, "scale": 0.5}, qkv),
        ({**plain, "bias": True, "mask": True}, [*qkv, (1, 4, 8, 8), (1, 1, 8, 8)]),
        (plain, qkv), (plain, qkv),
        (plain, [(1, 8, 4, 16)] * 3)]  # 3-d operands: the call on their 4-d views
    for call in calls.values():  # JAX's function on the call's inputs, equation for equation
        assert len(call.body.jaxpr.eqns) == len(call.indices)


def test_attention_calls_given_one_array_for_several_inputs_are_found():
    """One array given as the key and the value (``k is v``), or as all three inputs
    (self-attention's ``q is k is v``), is read where the first of them is: the call is found
    all the same, with the array at each of its places, as are distinct arrays."""
    from jaxamp._autocast import _attention
    x, y, z = (jax.random.normal(jax.random.key(i), (2, 8, 4, 16)) for i in range(3))
    bias = jnp.zeros((1, 4, 8, 8))

    def f(x, y, z, bias):
        o = jax.nn.dot_product_attention(x, y, z)                  # distinct
        o = jax.nn.dot_product_attention(o, y, y, scale=0.5)       # k is v
        o = jax.nn.dot_product_attention(o, o, o, is_causal=True)  # q is k is v
        o = jax.nn.dot_product_attention(o, y, y, bias)            # k is v, and a bias
        return jax.nn.dot_product_attention(o, o, o, bias)         # q is k is v, and a bias

    jaxpr = jax.make_jaxpr(f)(x, y, z, bias).jaxpr
    calls = list(_attention.find_calls(jaxpr).values())
    plain = {"scale": 0.25, "is_causal": False, "bias": False, "mask": False}
    assert [c.options for c in calls] == [
        plain, {**plain, "scale": 0.5}, {**plain, "is_causal": True}, {**plain, "bias": True},
        {**plain, "bias": True}]
    # Which of the call's places (query, key, value, bias) hold one array.
    same = [[[i for i, u in enumerate(c.inputs) if u is w] for w in c.inputs] for c in calls]
    assert same == [[[0], [1], [2]], [[0], [1, 2], [1, 2]], [[0, 1, 2]] * 3,
                    [[0], [1, 2], [1, 2], [3]], [[0, 1, 2]] * 3 + [[3]]]
    x_, y_, z_, bias_ = jaxpr.invars
    assert calls[0].inputs == (x_, y_, z_) and calls[1].inputs[1:] == (y_, y_)
    assert calls[3].inputs[1:] == (y_, y_, bias_) and calls[4].inputs[3] is bias_
    for call in calls:  # JAX's function on the call's inputs, equation for equation
        assert len(call.body.jaxpr.eqns) == len(call.indices)


def test_the_limitations_page_says_which_attention_calls_are_found():
    """docs/limitations.md's fused-attention bullet, against the finder (and the autocast
    page): a call of the function imported by name, and one inside a function jitted before
    autocast traces it (its jaxpr cached, the call found in the nested jaxpr), are found."""
    from jax.nn import dot_product_attention

    from jaxamp._autocast import _attention
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 4, 16)) for i in range(3))
    by_name = jax.make_jaxpr(lambda q, k, v: dot_product_attention(q, k, v))(q, k, v)
    assert len(_attention.find_calls(by_name.jaxpr)) == 1
    jitted = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
    jitted(q, k, v)
    (call,) = jax.make_jaxpr(lambda q, k, v: jitted(q, k, v))(q, k, v).jaxpr.eqns
    assert len(_attention.find_calls(call.params["jaxpr"].jaxpr)) == 1
    text = (pathlib.Path(ROOT) / "docs" / "limitations.md").read_text()
    bullets = [" ".join(b.split()) for b in re.split(r"^- ", text, flags=re.M)]
    (bullet,) = [b for b in bullets if b.startswith("The fused attention covers")]
    for found in ("imported by name (`from jax.nn import dot_product_attention`)",
                  "inside a function jitted before autocast traces it"):
        assert found in bullet, found
    autocast_page = " ".join((pathlib.Path(ROOT) / "docs" / "concepts" / "autocast.md")
                             .read_text().split())
    assert ("a function imported by name (`from jax.nn import dot_product_attention`) is "
            "found too") in autocast_page


def test_autocast_leaves_jax_as_it_is_and_runs_attention_as_jax_does():
    """Nothing of JAX's is replaced while autocast traces (``jax.nn.dot_product_attention`` is
    JAX's own in the model), on an error too. Without cuDNN (this CPU lane) a found call runs
    JAX's XLA implementation under the rules: the values and gradients of the call that asks
    for it by name."""
    original = jax.nn.dot_product_attention
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 16)) for i in range(3))
    seen = []

    def f(q, k, v, implementation=None):
        seen.append(jax.nn.dot_product_attention is original)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=implementation)
        return jnp.mean(out ** 2)

    found = jaxamp.autocast(f)(q, k, v)
    as_asked = jaxamp.autocast(functools.partial(f, implementation="xla"))(q, k, v)
    assert seen == [True, True] and found.dtype == jnp.float32
    np.testing.assert_allclose(float(found), float(as_asked), rtol=1e-6)
    grads = jax.grad(jaxamp.autocast(f), argnums=(0, 1, 2))(q, k, v)
    grads_as_asked = jax.grad(jaxamp.autocast(functools.partial(f, implementation="xla")),
                              argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, grads_as_asked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)

    def fails(q):
        raise ValueError("boom")
    with pytest.raises(ValueError, match="boom"):
        jaxamp.autocast(fails)(q)
    assert jax.nn.dot_product_attention is original


def test_two_autocast_traces_racing_in_threads_leave_jax_as_it_was():
    """Two threads trace autocast functions with attention at once, the second finishing last:
    each gets the values of a trace made alone, and ``jax.nn.dot_product_attention`` is JAX's
    own afterwards (a function swapped in while tracing and put back by each thread would be
    left as the first thread's)."""
    import threading
    import time
    original = jax.nn.dot_product_attention
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 16)) for i in range(3))
    both_tracing = threading.Barrier(2, timeout=60)

    def model(delay):
        def f(q, k, v):
            both_tracing.wait()
            time.sleep(delay)
            return jnp.mean(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)
        return f

    alone = float(jax.jit(jaxamp.autocast(
        lambda q, k, v: jnp.mean(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)))(
        q, k, v))
    results, errors = {}, []

    def run(name, delay):
        try:
            results[name] = float(jax.jit(jaxamp.autocast(model(delay)))(q, k, v))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(n, d)) for n, d in (("a", 0.0), ("b", 0.5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {"a": alone, "b": alone}
    assert jax.nn.dot_product_attention is original


def test_an_attention_call_with_sequence_lengths_or_a_residual_runs_as_asked():
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 16)) for i in range(3))
    lengths = jnp.array([3, 8], jnp.int32)

    def f(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
        again, residual = jax.nn.dot_product_attention(q, k, v, return_residual=True)
        return out, again, residual

    out, again, residual = jax.jit(jaxamp.autocast(f))(q, k, v)
    ref, ref_again, _ = jax.jit(f)(q, k, v)
    np.testing.assert_allclose(out, ref, atol=3e-2)   # the first row's 5 keys masked, still
    assert float(jnp.max(jnp.abs(ref - again))) > 0.5  # as they are without the lengths
    assert again.shape == (2, 8, 2, 16) and residual.shape == (2, 8, 2)
    np.testing.assert_allclose(again, ref_again, atol=3e-2)


def test_the_audit_counts_the_default_backends_branch_of_a_platform_dependent_choice():
    def chosen(w, x):   # on CPU one matmul; elsewhere three
        return lax.platform_dependent(w, x, cpu=lambda w, x: x @ w,
                                      default=lambda w, x: (x @ w) @ (w.T @ w))

    def either(w, x):   # a plain cond may run either branch: it counts both
        return lax.cond(x[0, 0] > 0, lambda w, x: x @ w, lambda w, x: (x @ w) @ (w.T @ w), w, x)

    one = jaxamp.audit(lambda w, x: x @ w, W, X).total_matmul_flops
    assert jax.default_backend() == "cpu"
    assert jaxamp.audit(chosen, W, X).total_matmul_flops == one
    assert jaxamp.audit(either, W, X).total_matmul_flops > 4 * one


def test_recompute_keeps_the_fused_heads_gradients():
    """``jaxamp.ops.linear_softmax_cross_entropy`` under autocast: its chunk loop runs once,
    in the forward pass (its gradients are kept, not recomputed by a second loop)."""
    import re

    from jaxamp import ops
    labels = jnp.arange(256) % 100

    def loss(x, w):
        return ops.linear_softmax_cross_entropy(jnp.tanh(x), w, labels, chunk_rows=64)[0]
    x, w = jnp.ones((256, 32)), jnp.ones((100, 32))
    for f in (loss, jaxamp.autocast(loss)):
        text = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w).compile().as_text()
        assert len(re.findall(r" while\(", text)) == 1


def test_recompute_saves_an_operand_a_long_chain_away_from_the_saved_values():
    """An elementwise chain longer than 16 ops is not run again in the backward pass: its end,
    a matmul's operand, is saved."""
    w1 = jax.random.normal(jax.random.key(0), (16, 64)) * 0.1
    w2 = jax.random.normal(jax.random.key(1), (64, 8)) * 0.1

    def f(w1, w2, x, steps):
        h = x @ w1
        for _ in range(steps):
            h = jnp.sin(h) * 1.01
        return jnp.mean(h @ w2)

    def saved(steps):
        return jaxamp.audit_grad(jaxamp.autocast(lambda a, b, x: f(a, b, x, steps)), w1, w2, X,
                                 argnums=(0, 1)).saved_bytes_by_dtype
    one = X.shape[0] * 64 * 2
    assert saved(8) == {"bfloat16": one}  # 16 ops: recomputed
    assert saved(9) == {"bfloat16": 2 * one}  # 18: the operand is saved beside x @ w1


def test_a_function_with_an_io_callback_is_not_recomputed():
    calls = []

    def f(w, x):
        jax.experimental.io_callback(lambda: calls.append(1), None, ordered=True)
        return jnp.mean(jnp.tanh(x @ w))
    jax.block_until_ready(jax.grad(jaxamp.autocast(f))(W, X))
    assert len(calls) == 1


def test_an_fp32_scope_that_matches_nothing_is_warned_about():
    class Net(nnx.Module):     # NNX modules open no name scope of their own
        def __init__(self):
            self.body = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
            self.head = nnx.Linear(8, 1, rngs=nnx.Rngs(1))

        def __call__(self, x, scoped=False):
            h = self.body(x)
            if scoped:
                with jax.named_scope("head"):
                    return self.head(h)
            return self.head(h)

    graphdef, params = nnx.split(Net(), nnx.Param)

    def f(p, x, scoped):
        return jnp.mean(nnx.merge(graphdef, p)(x, scoped))
    with pytest.warns(UserWarning, match=r"fp32_scopes=\('head',\) matched no op.*named_scope"):
        jax.make_jaxpr(jaxamp.autocast(f, fp32_scopes=("head",)), static_argnums=2)(
            params, X, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = jaxamp.audit_grad(jaxamp.autocast(lambda p, x: f(p, x, True),
                                                   fp32_scopes=("head",)), params, X)
    assert 0 < report.share("float32") < 0.5     # the head's matmuls, forward and backward


@pytest.mark.parametrize("recompute", [True, False])
def test_a_model_with_ffts_trains_under_autocast_as_in_fp32(recompute):
    """An FFT runs in fp32 (`lax.fft` takes no half precision), and its complex output is not
    a value autocast's checkpoint keeps (jax 0.10 cannot differentiate that): it runs again."""
    def f(w, x):
        h = x @ w
        return (jnp.mean(jnp.abs(jnp.fft.rfft(h, axis=-1)))
                + jnp.mean(jnp.real(jnp.fft.ifft(jnp.fft.fft(h, axis=-1))) ** 2))

    got = jax.value_and_grad(jaxamp.autocast(f, recompute=recompute))(W, X)
    want = jax.value_and_grad(f)(W, X)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-2)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=5e-2, atol=5e-3)
    ffts = operand_dtypes(grad_of(jaxamp.autocast(f, recompute=recompute)), W, X,
                          names=("fft",))
    assert {dtype for _, dtype in ffts} <= {"float32", "complex64"} and ffts


def test_a_cast_to_fp32_of_a_value_computed_in_fp32_leaves_the_rules_to_decide():
    """`fn` is traced in fp32, where `(x @ w).astype(float32)` is no op: the mul after it runs
    in the matmul's bf16 (torch's `.float()` would keep it fp32); `full_precision` keeps it."""
    def f(w, x):
        return (x @ w).astype(F32) * 3.0

    def kept(w, x):
        return jaxamp.full_precision(lambda h: h.astype(F32) * 3.0)(x @ w)

    muls = [dict(operand_dtypes(jaxamp.autocast(g, "p=f32,c=bf16,o=f32"), W, X, names=("mul",)))
            for g in (f, kept)]
    assert muls == [{"mul": "bfloat16"}, {"mul": "float32"}]


def test_equinox_layers_open_a_scope_named_after_their_class_a_users_module_none():
    import equinox as eqx

    class Net(eqx.Module):                          # a user's module: no scope of its own
        body: eqx.nn.Linear
        scale: jax.Array

        def __call__(self, x):
            return jax.vmap(self.body)(x) @ self.scale

    net = Net(eqx.nn.Linear(16, 8, key=jax.random.key(0)), jnp.ones((8, 4)))
    params, static = eqx.partition(net, eqx.is_inexact_array)

    def f(p, x):
        return jnp.mean(eqx.combine(p, static)(x))
    report = jaxamp.audit_grad(jaxamp.autocast(f, fp32_scopes=("eqx.nn.Linear",)), params, X)
    assert 0 < report.share("float32") < 1     # the Linear's matmuls, not `@ self.scale`
    with pytest.warns(UserWarning, match="matched no op"):
        jax.make_jaxpr(jaxamp.autocast(f, fp32_scopes=("Net",)))(params, X)


def test_shard_map_inside_and_outside_an_autocast_function():
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    x = jnp.tile(X, (2, 1))   # 8 rows: one per device

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def per_device(w, x):        # the mean over devices of per-shard means
        return lax.pmean(loss(w, x), "batch")
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
    one = jax.grad(jaxamp.autocast(loss))(W, x)
    # autocast inside each shard, and a shard_map inside an autocast function (run as written).
    inside_fn = jax.grad(jax.shard_map(
        lambda w, x: lax.pmean(jaxamp.autocast(loss)(w, x), "batch"), mesh=mesh,
        in_specs=(P(), P("batch")), out_specs=P()))
    inside = inside_fn(W, x)
    assert matmul_dtypes(inside_fn, W, x) == {"bfloat16"}
    ops = operand_dtypes(jax.grad(jaxamp.autocast(sharded)), W, x)
    np.testing.assert_allclose(inside, one, rtol=2e-2, atol=1e-3)
    assert {d for _, d in ops} == {"float32"}   # the shard_map body's rules are its author's
    np.testing.assert_allclose(jax.grad(jaxamp.autocast(sharded))(W, x), jax.grad(sharded)(W, x),
                               rtol=1e-5)


def test_a_constant_the_function_returns_comes_back_an_array_in_its_dtype():
    """A constant output is a literal of the jaxpr (BatchNorm's first-call flag in the state it
    returns): an array, as the function returns it, never a Python scalar that a skipped
    step's per-leaf select would let through."""
    for wrap in (lambda f: f, jax.jit):
        out = wrap(jaxamp.autocast(lambda x: (x * 2, jnp.array(False), jnp.array(1.5))))(
            jnp.ones(2))
        assert [str(np.asarray(o).dtype) for o in out] == ["float32", "bool", "float32"]
        assert all(hasattr(o, "dtype") for o in out) and bool(out[1]) is False


# --------------------------------------------------------------------------------------------
# docs/concepts/autocast.md: every claim has a test
# --------------------------------------------------------------------------------------------

AC = "tests/test_autocast.py::"
AS = "tests/test_attention_structure.py::"
GPU = "tests/gpu_memory/test_compiled.py::"   # XLA:GPU's compiler, `make test-gpu-memory`
PAGE_EXAMPLES = "tests/test_docs.py::test_page_examples_run[concepts/autocast.md]"

PAGE_CLAIMS = {
    # How it works
    "returns a function with `fn`'s signature": (
        AC + "test_the_function_keeps_fns_signature_and_passes_non_arrays_through_as_static",),
    "evaluates that jaxpr again, equation by equation, under per-primitive dtype rules, with the "
    "rules' casts inserted": (
        AC + "test_the_program_is_fns_own_ops_with_the_rules_casts_inserted",),
    "it works under `jax.grad`, `jit`, `vmap`, `pmap` and `shard_map`": (
        AC + "test_matmuls_run_in_the_compute_dtype_forward_and_backward",
        AC + "test_a_jitted_scan_and_fori_loop_run_their_matmuls_in_the_compute_dtype",
        AC + "test_vmap_of_an_autocast_function",
        AC + "test_pmap_and_an_8_way_sharded_jit_equal_one_device",
        AC + "test_shard_map_inside_and_outside_an_autocast_function"),
    "(Flax NNX, Linen, Equinox, plain jnp)": (
        AC + "test_users_models_run_every_matmul_in_bf16_with_close_values_and_grads",
        AC + "test_a_model_with_ffts_trains_under_autocast_as_in_fp32"),
    "costs nothing at run time beyond its casts": (
        AC + "test_the_program_is_fns_own_ops_with_the_rules_casts_inserted",),
    "Array arguments are traced; others (Python numbers, strings, flags) pass through as static "
    "values": (
        AC + "test_the_function_keeps_fns_signature_and_passes_non_arrays_through_as_static",),
    "The interpretation happens at trace time, so call it under `jit`": (
        AC + "test_fn_is_interpreted_once_under_jit_and_on_every_eager_call",),
    # The rules: the table
    "operands cast to the compute dtype, and the output too (`preferred_element_type`), so that "
    "the backward pass's transposed matmuls meet a half-precision cotangent": (
        AC + "test_matmuls_run_in_the_compute_dtype_forward_and_backward",
        AC + "test_convolutions_and_ragged_dots_run_in_the_compute_dtype_forward_and_backward"),
    "Accumulation is fp32 inside the kernel where the backend does that": (
        AC + "test_a_half_precision_matmul_accumulates_in_fp32_on_xla_cpu",),
    "the reductions `reduce_sum` and `reduce_prod` behind softmax": (
        AC + "test_each_primitive_of_the_float32_rule_runs_in_fp32_on_a_half_input",
        AC + "test_precision_sensitive_ops_run_in_fp32_on_half_inputs"),
    "they run in fp32 so that the sums in their derivatives do too": (
        AC + "test_reduce_max_and_min_run_in_fp32_so_their_derivatives_sum_in_fp32",),
    "floating inputs cast to the widest of them": (
        AC + "test_constants_follow_and_the_widest_traced_input_wins",
        AC + "test_promoted_ops_take_the_widest_input_and_single_input_ops_follow_theirs"),
    "a weakly typed constant (`x * 0.5`) adopts the others' dtype": (
        AC + "test_constants_follow_and_the_widest_traced_input_wins",),
    "a single-input op follows its input": (
        AC + "test_promoted_ops_take_the_widest_input_and_single_input_ops_follow_theirs",),
    "quantized to e4m3 with current scaling, the gradient to e5m2; the output in the compute "
    "dtype": (
        "tests/test_fp8.py::test_current_scaling_dense_matches_the_dequantized_reference",
        "tests/test_fp8.py::test_gradients_keep_their_operands_dtypes_and_output_follows_preferred",
        "tests/test_fp8.py::test_mixed_fp8_autocast_runs_a_user_nnx_models_matmuls_in_fp8_but_"
        "head_and_attention",
        AC + "test_the_fp8_rule_quantizes_a_dot_general_under_any_half_policy"),
    "the embeddings' and the head's matmuls and the attention's batched ones stay in the compute "
    "dtype": (
        "tests/test_fp8.py::test_an_fp8_recipe_keeps_the_head_and_attention_in_bf16_by_argument_"
        "path",),
    "Convolutions keep the `compute` rule": (
        "tests/test_fp8.py::test_mixed_fp8_keeps_convolutions_in_bf16_and_linen_dense_in_fp8",),
    "`custom_vjp` functions (primal and rule), `shard_map` and `pmap` bodies, callbacks": (
        "tests/test_autocast_programs.py::"
        "test_a_custom_vjp_is_differentiated_by_its_own_rule_in_fp32",
        AC + "test_fp32_scopes_and_full_precision_regions",
        AC + "test_a_user_custom_vjp_runs_in_the_dtypes_it_was_written_for",
        AC + "test_shard_map_inside_and_outside_an_autocast_function",
        AC + "test_pmap_bodies_and_callbacks_run_in_the_dtypes_fn_was_written_for"),
    "`fn` is traced with its bf16 and fp16 arguments as fp32": (
        AC + "test_a_custom_vjp_and_a_full_precision_region_run_in_fp32_in_the_train_step",
        AC + "test_pmap_bodies_and_callbacks_run_in_the_dtypes_fn_was_written_for",
        "tests/test_jax_apis.py::test_make_jaxpr_takes_a_type_from_typeof_with_another_dtype"),
    # More of the contract
    "Integer, boolean and PRNG-key values are never touched": (
        AC + "test_integers_booleans_and_keys_are_never_touched",),
    "JAX's own promotions) are kept": (
        AC + "test_a_half_cast_fn_makes_and_jaxs_own_promotions_are_kept",),
    "a cast to fp32 of a value `fn` computes in fp32 (`(x @ w).astype(jnp.float32)`) leaves "
    "nothing to keep": (
        AC + "test_a_cast_to_fp32_of_a_value_computed_in_fp32_leaves_the_rules_to_decide",),
    "an fp32 op returns fp32, which the next matmul casts back to the compute dtype": (
        AC + "test_an_fp32_op_returns_fp32_and_the_next_matmul_casts_it_back",
        AC + "test_explain_overflow_and_audit_see_through_an_autocast_loss"),
    "What `fn` returns is cast to `policy.output_dtype`": (
        AC + "test_matmuls_run_in_the_compute_dtype_forward_and_backward",
        AC + "test_constants_follow_and_the_widest_traced_input_wins",
        PAGE_EXAMPLES),
    "No value computed in fp32 is rounded to half on its way to the next fp32 op": (
        AC + "test_values_computed_in_fp32_reach_the_next_fp32_op_unrounded",),
    "(a `custom_jvp` such as `jax.nn.relu` included)": (
        AC + "test_values_computed_in_fp32_reach_the_next_fp32_op_unrounded[mixed_float16-"
             "custom_jvp]",),
    "its full-size results go to the matmuls, elementwise ops and remat'd blocks that read them "
    "in the compute dtype": (
        AC + "test_an_fp32_norm_region_saves_only_its_half_precision_input",
        AC + "test_a_models_own_remat_is_kept_and_autocast_saves_less_than_fp32"),
    "A hand-written RMS norm on activations near 30 in fp16, whose sum of squares is past 65504, "
    "gives fp32's loss": (
        AC + "test_values_computed_in_fp32_reach_the_next_fp32_op_unrounded[mixed_float16-"
             "rms norm]",),
    "A step whose loss is inf or nan is skipped": (
        AC + "test_a_step_whose_loss_is_not_finite_is_skipped_under_autocast",
        "tests/test_train_step.py::test_a_nonfinite_loss_with_finite_gradients_skips_the_step"),
    "Ops whose params hold a function traced for their operands' dtypes keep those dtypes": (
        "tests/test_autocast_programs.py::"
        "test_scatters_and_reductions_with_a_combiner_lower_and_match_fp32",
        "tests/test_autocast_programs.py::test_reduce_windows_with_a_body_lower_and_match_fp32",
        "tests/test_autocast_programs.py::test_a_graph_network_trains_through_the_step_under_autocast"),
    "An embedding lookup's gradient (a `gather`'s transpose, a scatter-add over the batch) is "
    "summed in fp32": (
        "tests/test_autocast_programs.py::test_an_embeddings_gradient_is_summed_in_fp32",),
    "Bias and broadcast gradients are summed in fp32": (
        AC + "test_bias_and_broadcast_gradients_sum_in_fp32",),
    "a param row taken by index and broadcast (`x * w[i][None, None, :]`) included": (
        AC + "test_a_param_row_taken_by_index_and_broadcast_has_its_gradient_summed_in_fp32",),
    "The transpose of a broadcast that only adds unit axes stays in half precision: it sums one "
    "value, exactly, and the audit does not list it": (
        AC + "test_the_transpose_of_a_broadcast_that_adds_unit_axes_stays_in_half_unlisted",),
    "`jit`/`pjit` and `closed_call` inline": (
        AC + "test_jit_and_closed_call_are_inlined",
        AC + "test_jit_remat_custom_jvp_inside_are_entered"),
    "`remat`/`checkpoint` (re-wrapped with its policy, which alone decides what is kept inside "
    "it": (
        AC + "test_jit_remat_custom_jvp_inside_are_entered",
        AC + "test_a_models_remat_policy_decides_what_is_kept_inside_it"),
    "`scan` and `while` (the carry as wide as its initial value or what the body computes": (
        AC + "test_a_scan_over_layers_keeps_its_fp32_carry_and_runs_bf16_matmuls",
        AC + "test_scan_over_layers_stays_a_scan_with_an_fp32_carry",
        AC + "test_cond_and_switch_promote_their_branches_and_a_while_carry_takes_its_bodys_fp32",
        "tests/test_autocast_programs.py::test_a_recurrence_keeps_its_fp32_carry_and_matches_fp32"),
    "`cond`/`switch` (the branches' outputs promoted to one dtype)": (
        AC + "test_cond_and_switch_promote_their_branches_and_a_while_carry_takes_its_bodys_fp32",
        AC + "test_while_and_cond_agree_on_dtypes"),
    "whose primal body and JVP rule are each evaluated under the rules, so that its own rule "
    "differentiates it": (
        AC + "test_jit_remat_custom_jvp_inside_are_entered",
        "tests/test_autocast_programs.py::test_a_custom_jvp_is_differentiated_by_its_own_rule",
        AC + "test_values_computed_in_fp32_reach_the_next_fp32_op_unrounded"),
    # Memory
    "is computed under `jax.checkpoint` from its half-precision inputs": (
        AC + "test_an_fp32_norm_region_saves_only_its_half_precision_input",),
    "so it keeps no fp32 tensor for the backward pass. Its statistics stay fp32, which costs "
    "almost no memory": (
        AC + "test_an_fp32_norm_region_saves_only_its_half_precision_input",
        AC + "test_the_users_gpt_saves_less_than_fp32_and_almost_nothing_in_fp32"),
    "(the default under a half compute dtype, for a function with no remat of its own": (
        AC + "test_recompute_is_the_default_under_a_half_compute_dtype_only",
        AC + "test_by_default_recompute_defers_to_a_models_own_remat"),
    "**A model that remats decides what is kept.**": (
        AC + "test_by_default_recompute_defers_to_a_models_own_remat",
        AC + "test_a_models_own_remat_is_kept_and_autocast_saves_less_than_fp32"),
    "On MaxText's llama2 the step then needs 5–7% less GPU memory than under autocast's "
    "recompute": (
        GPU + "test_a_model_that_remats_keeps_what_its_remat_keeps_in_less_memory",),
    "keeps only the matmuls' operands and outputs": (
        AC + "test_recompute_keeps_only_the_matmul_outputs_for_the_backward_pass",
        AC + "test_recompute_keeps_the_scores_not_the_probabilities"),
    # Collectives: no test of their outputs here (they need a mapped axis).
    "pooling windows and cumulative ops)": (
        AC + "test_recompute_keeps_the_outputs_of_sorts_pooling_windows_and_cumulative_ops",),
    "`recompute=False` keeps JAX's default: every intermediate the derivative reads": (
        AC + "test_recompute_keeps_only_the_matmul_outputs_for_the_backward_pass",),
    "A `jax.debug.print` or `jax.debug.callback` does not change what is recomputed": (
        "tests/test_autocast_programs.py::test_a_debug_print_does_not_change_what_is_recomputed",),
    "Functions with other side effects (`io_callback`, state) are not recomputed": (
        AC + "test_a_function_with_an_io_callback_is_not_recomputed",),
    "**A model's own remat is kept under `recompute=True` too.**": (
        AC + "test_a_models_own_remat_is_kept_and_autocast_saves_less_than_fp32",
        AC + "test_a_models_remat_policy_decides_what_is_kept_inside_it",
        AC + "test_an_nnx_remat_model_trains_under_autocast_like_fp32"),
    "Four checkpointed post-norm blocks save their three block inputs in bf16, 0.375× fp32's "
    "bytes": (
        AC + "test_a_models_own_remat_is_kept_and_autocast_saves_less_than_fp32[checkpoint]",),
    "a scanned, remat'd stack its stacked carries in bf16": (
        AC + "test_a_models_own_remat_is_kept_and_autocast_saves_less_than_fp32[scan]",),
    "**A value fp32 only in the trace is saved in the compute dtype.**": (
        "tests/test_autocast_programs.py::"
        "test_a_value_fp32_only_in_the_trace_is_saved_in_the_compute_dtype",),
    "**A scan is recomputed one step at a time.**": (
        AC + "test_a_scan_is_recomputed_step_by_step_in_the_backward_pass",
        GPU + "test_memory_goal_of_a_scanned_transformer_under_autocast"),
    "Under `recompute=True` the arguments and their casts are never saved": (
        AC + "test_under_recompute_the_arguments_and_their_casts_are_not_saved",),
    # Fused attention
    "as cuDNN's fused flash attention wherever the step is compiled for an NVIDIA GPU": (
        GPU + "test_autocast_gives_a_users_nnx_attention_cudnns_kernel",),
    "and as written under the rules above everywhere else": (
        AC + "test_autocast_leaves_jax_as_it_is_and_runs_attention_as_jax_does",
        AS + "test_autocast_runs_a_found_chain_as_written_off_the_gpu",
        GPU + "test_autocast_gives_a_users_nnx_attention_cudnns_kernel"),
    "and so `nnx.MultiHeadAttention` with its defaults, makes one": (
        GPU + "test_autocast_gives_a_users_nnx_attention_cudnns_kernel",),
    "The probabilities' matmul reads a softmax": (
        AS + "test_each_spelling_is_found_with_its_options",),
    "a query's extra free axis is its group of a key's head": (
        AS + "test_each_spelling_is_found_with_its_options",
        AS + "test_the_arranged_call_gives_the_chains_values_and_gradients"),
    "A mask that is a compile-time lower triangle (from `iota` or `jnp.tril`) becomes "
    "`is_causal`": (AS + "test_each_spelling_is_found_with_its_options",),
    "the arranged call, run with JAX's XLA implementation, gives the chain's values and "
    "gradients": (AS + "test_the_arranged_call_gives_the_chains_values_and_gradients",),
    "each become one `__cudnn$fmha` call forward and one backward": (
        GPU + "test_attention_found_by_its_structure_compiles_to_cudnn",),
    "leave the chain as written": (AS + "test_look_alikes_are_not_matched",),
    "list each such matmul with the reason": (
        AS + "test_the_audit_lists_attention_it_does_not_fuse_with_the_reason",),
    "so it finds the call in the traced program and makes the choice itself": (
        AC + "test_attention_calls_are_found_where_jax_traced_them",
        GPU + "test_the_reference_transformers_lower_attention_to_cudnn"),
    "autocast confirms them by tracing JAX's function again on the same inputs": (
        AC + "test_attention_calls_are_found_where_jax_traced_them",),
    "so a function imported by name (`from jax.nn import dot_product_attention`) is found too": (
        AC + "test_attention_calls_are_found_where_jax_traced_them",
        GPU + "test_attention_imported_by_name_and_traced_in_two_threads_compiles_to_cudnn"),
    "One array given for several inputs (`k is v`, self-attention's `q is k is v`) is found as "
    "well": (
        AC + "test_attention_calls_given_one_array_for_several_inputs_are_found",),
    "two threads tracing at once do not see each other's work": (
        AC + "test_two_autocast_traces_racing_in_threads_leave_jax_as_it_was",
        GPU + "test_attention_imported_by_name_and_traced_in_two_threads_compiles_to_cudnn"),
    "so `jaxamp.memory.gpu_memory` (a GPU compile on a machine without one) sees the GPU's "
    "program": (
        GPU + "test_autocast_gives_a_users_nnx_attention_cudnns_kernel",),
    "not the `[batch, heads, length, length]` probabilities": (
        GPU + "test_autocast_gives_a_users_nnx_attention_cudnns_kernel",
        GPU + "test_memory_goal[nnx_gpt-autocast_bf16]"),
    # Untested here (XLA:GPU only, the CPU lane has no cuDNN to choose): a call inside an fp32
    # region, an fp32 scope or full_precision, under an FP8 policy, or of a head size, dtype or
    # mask cuDNN refuses keeps the XLA implementation.
    "A call with an explicit `implementation`, sequence lengths, a local window or "
    "`return_residual`, and a `vmap` of the call, run as asked": (
        AC + "test_attention_calls_are_found_where_jax_traced_them",
        AC + "test_autocast_leaves_jax_as_it_is_and_runs_attention_as_jax_does",
        AC + "test_an_attention_call_with_sequence_lengths_or_a_residual_runs_as_asked"),
    "counts the fused kernel's matmul FLOPs": (
        GPU + "test_the_audit_counts_cudnns_attention_flops",),
    "of a platform-dependent choice only the branch of JAX's default backend": (
        AC + "test_the_audit_counts_the_default_backends_branch_of_a_platform_dependent_choice",),
    # Overrides
    '`rules={"exp": "compute"}`': (
        AC + "test_per_primitive_rules_override_the_defaults",
        AC + "test_each_rule_runs_an_op_as_documented"),
    "a rule is `compute`, `float32`, `promote`, `original` or `fp8` (`dot_general` only)": (
        AC + "test_each_rule_runs_an_op_as_documented",
        AC + "test_the_fp8_rule_quantizes_a_dot_general_under_any_half_policy",
        AC + "test_bad_input_is_a_clear_error"),
    'every op inside a name scope or module path (`"head"`, `"Encoder/router"`), matmuls '
    "included, in fp32": (
        AC + "test_fp32_scopes_and_full_precision_regions",
        AC + "test_linen_modules_open_a_scope_each_and_fp32_scopes_match_a_module_path"),
    "a region that runs exactly as written": (
        AC + "test_fp32_scopes_and_full_precision_regions",
        AC + "test_a_custom_vjp_and_a_full_precision_region_run_in_fp32_in_the_train_step"),
    "keep every intermediate instead of recomputing the elementwise chains": (
        AC + "test_recompute_keeps_only_the_matmul_outputs_for_the_backward_pass",),
    "A small model to try them on": (PAGE_EXAMPLES,),
    "outside autocast it is the function itself, under a name scope": (
        AC + "test_full_precision_outside_autocast_is_the_function_under_a_name_scope",),
    "Linen modules open one per module (named after the module)": (
        AC + "test_linen_modules_open_a_scope_each_and_fp32_scopes_match_a_module_path",),
    "Equinox's own layers open one named after their class (`eqx.nn.Linear`)": (
        AC + "test_equinox_layers_open_a_scope_named_after_their_class_a_users_module_none",),
    "so use `jax.named_scope` in the model or `full_precision` there": (
        AC + "test_an_fp32_scope_that_matches_nothing_is_warned_about",),
    "A scope that matches no op is warned about": (
        AC + "test_an_fp32_scope_that_matches_nothing_is_warned_about",),
    "The training CLI takes `python -m train --autocast`": (
        "tests/train/test_cli.py::test_autocast_flag_trains_under_jaxamp_autocast",),
}
"""A short verbatim phrase of each claim of docs/concepts/autocast.md, and the tests that
check it. The page's measured figures (compile times, GB on an H200) are the benchmarks'."""


def _page_parts() -> tuple[str, dict[str, list[str]]]:
    """The page's text with its whitespace collapsed, and the claims that must have a phrase:
    the rows of the rules table and the bullets of "More of the contract", "Memory" and "Fused
    attention", each collapsed too."""
    text = (pathlib.Path(ROOT) / "docs" / "concepts" / "autocast.md").read_text()
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))

    def bullets(body: str) -> list[str]:
        items: list[str] = []
        inside = False   # a bullet goes on over its indented lines
        for line in body.splitlines():
            if line.startswith("- "):
                items.append(line[2:])
                inside = True
            elif inside and line.startswith("  "):
                items[-1] += " " + line
            else:
                inside = False
        return [" ".join(b.split()) for b in items]

    rules = sections["The rules"]
    table, contract = rules.split("More of the contract:", 1)
    rows = [" ".join(r.split()) for r in table.splitlines() if re.match(r"\| `\w+` \|", r)]
    parts = {"rules table": rows, "More of the contract": bullets(contract),
             "Memory": bullets(sections["Memory"]),
             "Fused attention": bullets(sections["Fused attention"])}
    return " ".join(text.split()), parts


def _defined_tests(path: str) -> set[str]:
    tree = ast.parse((pathlib.Path(ROOT) / path).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_claim_of_the_autocast_page_has_a_test():
    page, parts = _page_parts()
    # (a) every phrase is on the page, once: editing a claim means editing its entry here
    missing = [p for p in PAGE_CLAIMS if page.count(" ".join(p.split())) != 1]
    assert missing == [], missing
    # (b) every row of the rules table and every bullet of the three lists has a phrase
    assert all(parts.values()) and len(parts["rules table"]) == 5, parts
    uncovered = [(k, item[:60]) for k, items in parts.items() for item in items
                 if not any(" ".join(p.split()) in item for p in PAGE_CLAIMS)]
    assert uncovered == [], uncovered
    # (c) every test named exists (a parametrized one by its function's name)
    files: dict[str, set[str]] = {}
    for node in {n for nodes in PAGE_CLAIMS.values() for n in nodes}:
        path, name = node.split("::")
        if path not in files:
            files[path] = _defined_tests(path)
        assert name.split("[")[0] in files[path], node
    # and the float32 row names exactly the primitives its test runs
    row = next(r for r in parts["rules table"] if r.startswith("| `float32` |"))
    assert set(re.findall(r"`(\w+)`", row.split("|")[2])) == set(FP32_RULE_OPS)
