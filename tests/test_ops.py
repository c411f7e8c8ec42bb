"""jaxamp.ops: gradients equal plain autodiff; half precision in, half precision out, to
half-precision accuracy; the bytes saved for backward are the half-precision tensors plus small
fp32 statistics; an fp32 input is the plain fp32 formula; the gradient reductions run in fp32.
Everything under strict dtype promotion."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import _jaxpr
from jaxamp import ops
from jaxamp._autocast import _ops

pytestmark = pytest.mark.usefixtures("strict_promotion")

F32, BF16 = jnp.float32, jnp.bfloat16

# The tests check dtypes and values, not speed: compile at XLA's lowest backend optimization
# level, which halves the compile time of these small graphs.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


def normal(seed, shape, scale=1.0, shift=0.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale + shift, F32)


# --------------------------------------------------------------------------------------------
# Plain fp32 references, written with jnp and differentiated by autodiff
# --------------------------------------------------------------------------------------------

def ref_batch_norm(x, scale, bias, residual, relu, eps=1e-5):
    axes = tuple(range(x.ndim - 1))
    mean = x.mean(axes)
    y = (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(axes) + eps) * scale + bias
    y = y if residual is None else y + residual
    return jax.nn.relu(y) if relu else y


def ref_batch_norm_eval(x, scale, bias, mean, var, residual, relu, eps=1e-5):
    y = (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias
    y = y if residual is None else y + residual
    return jax.nn.relu(y) if relu else y


def ref_layer_norm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


MASK = jnp.tril(jnp.ones((6, 6), bool))
IDS = jnp.array([[1, 1, 2], [3, 1, 7]])
LABELS = jnp.array([[0, 4, 4], [2, 1, 0]])
BN_STATS = [jnp.abs(normal(30, (5,))), jnp.abs(normal(31, (5,))) + 0.5]   # mean, var
# case -> (op, fp32 reference, args)
CASES = {
    "batch_norm": (lambda x, s, b: ops.batch_norm_train(x, s, b)[0],
                   lambda x, s, b: ref_batch_norm(x, s, b, None, False),
                   [normal(0, (4, 3, 3, 5), 3.0, 1.0), normal(1, (5,)), normal(2, (5,))]),
    "batch_norm_residual_relu": (
        lambda x, s, b, r: ops.batch_norm_train(x, s, b, residual=r, relu=True)[0],
        lambda x, s, b, r: ref_batch_norm(x, s, b, r, True),
        [normal(3, (4, 3, 3, 5), 3.0, 1.0), normal(4, (5,)), normal(5, (5,)),
         normal(6, (4, 3, 3, 5))]),
    "batch_norm_eval": (
        lambda x, s, b, m, v: ops.batch_norm_eval(x, s, b, m, v),
        lambda x, s, b, m, v: ref_batch_norm_eval(x, s, b, m, v, None, False),
        [normal(16, (4, 3, 3, 5), 1.0, 0.5), normal(17, (5,)), normal(18, (5,)), *BN_STATS]),
    "batch_norm_eval_residual_relu": (
        lambda x, s, b, m, v, r: ops.batch_norm_eval(x, s, b, m, v, residual=r, relu=True),
        lambda x, s, b, m, v, r: ref_batch_norm_eval(x, s, b, m, v, r, True),
        [normal(19, (4, 3, 3, 5), 1.0, 0.5), normal(20, (5,)), normal(21, (5,)), *BN_STATS,
         normal(22, (4, 3, 3, 5))]),
    "layer_norm": (ops.layer_norm, ref_layer_norm,
                   [normal(7, (2, 3, 16), 2.0, 0.5), normal(8, (16,)), normal(9, (16,))]),
    "attention_softmax": (
        lambda s: ops.attention_softmax(s, MASK, scale=0.3),
        lambda s: jax.nn.softmax(jnp.where(MASK, s * 0.3, -1e30), axis=-1),
        [normal(10, (2, 3, 6, 6), 2.0)]),
    "gelu": (ops.gelu, jax.nn.gelu, [normal(11, (40,), 3.0)]),
    "cross_entropy": (lambda x: ops.softmax_cross_entropy(x, LABELS),
                      lambda x: optax.softmax_cross_entropy_with_integer_labels(x, LABELS),
                      [normal(12, (2, 3, 5), 3.0)]),
    "embed_lookup": (lambda t: ops.embed_lookup(t, IDS), lambda t: t[IDS],
                     [normal(13, (8, 4))]),
    "bias_add": (ops.bias_add, jnp.add, [normal(14, (2, 3, 4)), normal(15, (3, 4))]),
}


def vjp_of(f, cotangent, argnums):
    return jit(jax.value_and_grad(lambda *a: jnp.vdot(f(*a).astype(F32), cotangent), argnums))


@pytest.mark.parametrize("case", CASES)
def test_matches_autodiff(case):
    fn, ref, args = CASES[case]
    out_shape = jax.eval_shape(ref, *args).shape
    cotangent = normal(99, out_shape)
    argnums = tuple(range(len(args)))

    (value, grads) = vjp_of(fn, cotangent, argnums)(*args)
    (ref_value, ref_grads) = vjp_of(ref, cotangent, argnums)(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * float(jnp.abs(r).max()))

    # Half-precision inputs: the output and the gradients keep the input dtypes, and agree
    # with the fp32 reference to half-precision accuracy (the math inside is fp32).
    half = [a.astype(BF16) for a in args]
    out = jit(fn)(*half)
    if case != "cross_entropy":
        assert out.dtype == BF16
    else:
        assert out.dtype == F32
    ref_out = jit(ref)(*args)
    err = float(jnp.abs(out.astype(F32) - ref_out).max()) / float(jnp.abs(ref_out).max())
    assert err < 2e-2, (case, err)
    _, grads = vjp_of(fn, cotangent, argnums)(*half)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == BF16
        err = float(jnp.abs(g.astype(F32) - r).max()) / float(jnp.abs(r).max())
        assert err < 3e-2, (case, err)


# --------------------------------------------------------------------------------------------
# fp32 in: the plain fp32 formula, no cast
# --------------------------------------------------------------------------------------------

def plain_batch_norm(x, scale, bias, residual=None, relu=False, eps=1e-5):
    axes = tuple(range(x.ndim - 1))
    mean = x.mean(axes)
    var = jnp.square(x - mean).mean(axes)
    y = (x - mean) * (jax.lax.rsqrt(var + eps) * scale) + bias
    y = y if residual is None else y + residual
    return jnp.maximum(y, 0.0) if relu else y


def plain_batch_norm_eval(x, scale, bias, mean, var, residual=None, relu=False, eps=1e-5):
    y = (x - mean) * (jax.lax.rsqrt(var + eps) * scale) + bias
    y = y if residual is None else y + residual
    return jnp.maximum(y, 0.0) if relu else y


def plain_layer_norm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def plain_cross_entropy(logits, labels):
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


# case -> the op's forward, written as the usual fp32 jnp expression
PLAIN = {
    "batch_norm": lambda x, s, b: plain_batch_norm(x, s, b),
    "batch_norm_residual_relu": lambda x, s, b, r: plain_batch_norm(x, s, b, r, relu=True),
    "batch_norm_eval": plain_batch_norm_eval,
    "batch_norm_eval_residual_relu":
        lambda x, s, b, m, v, r: plain_batch_norm_eval(x, s, b, m, v, r, relu=True),
    "layer_norm": plain_layer_norm,
    "attention_softmax":
        lambda s: jax.nn.softmax(jnp.where(MASK, s * 0.3, jnp.finfo(F32).min), axis=-1),
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "cross_entropy": lambda x: plain_cross_entropy(x, LABELS),
    "embed_lookup": lambda t: t[IDS],
    "bias_add": jnp.add,
}


@pytest.mark.parametrize("case", CASES)
def test_fp32_input_is_the_plain_formula(case):
    fn, _, args = CASES[case]
    out, plain = jit(fn)(*args), jit(PLAIN[case])(*args)
    assert out.dtype == plain.dtype == F32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    # Not one cast to or from half precision, forward or backward.
    casts = jaxamp.audit_grad(lambda *a: fn(*a).sum(), *args).casts
    assert not [c for c in casts if "16" in c], casts


# --------------------------------------------------------------------------------------------
# The bytes saved for backward under a bf16 input
# --------------------------------------------------------------------------------------------

def act(x):
    """Makes an argument an activation: ``audit_grad`` does not count arguments as saved
    residuals (the caller keeps them alive anyway), but a layer's input usually is one."""
    return x * 2


def upcast(ref):
    """The usual recipe: cast every float input to fp32, run the jnp formula, cast back."""
    def fn(*args):
        return ref(*[a.astype(F32) for a in args]).astype(args[0].dtype)
    return fn


X_BN = normal(40, (4, 3, 3, 5)).astype(BF16)   # 180 elements, 5 channels
X_LN = normal(41, (2, 3, 16)).astype(BF16)     # 96 elements, 6 rows
SCORES = normal(42, (2, 3, 6, 6)).astype(BF16)
LOGITS = normal(43, (2, 3, 5)).astype(BF16)    # 30 elements, 6 rows
P5, P16 = normal(44, (5,)), normal(45, (16,))  # fp32 params: arguments, never counted
# case -> (op, usual fp32-upcast recipe, args, expected residual bytes of the op)
SAVED = {
    "batch_norm": (
        lambda x, s, b: ops.batch_norm_train(act(x), s, b)[0],
        upcast(lambda x, s, b: ref_batch_norm(act(x), s, b, None, False)),
        [X_BN, P5, P5], {"bfloat16": 2 * 180, "float32": 4 * 2 * 5}),
    "batch_norm_residual_relu": (  # the output too: it masks the ReLU's gradient
        lambda x, s, b, r: ops.batch_norm_train(act(x), s, b, residual=act(r), relu=True)[0],
        upcast(lambda x, s, b, r: ref_batch_norm(act(x), s, b, act(r), True)),
        [X_BN, P5, P5, X_BN], {"bfloat16": 2 * 2 * 180, "float32": 4 * 2 * 5}),
    "batch_norm_eval": (
        lambda x, s, b, m, v: ops.batch_norm_eval(act(x), s, b, m, v),
        upcast(lambda x, s, b, m, v: ref_batch_norm_eval(act(x), s, b, m, v, None, False)),
        [X_BN, P5, P5, *BN_STATS], {"bfloat16": 2 * 180, "float32": 4 * 5}),
    "batch_norm_eval_residual_relu": (
        lambda x, s, b, m, v, r: ops.batch_norm_eval(act(x), s, b, m, v, residual=act(r),
                                                     relu=True),
        upcast(lambda x, s, b, m, v, r: ref_batch_norm_eval(act(x), s, b, m, v, act(r), True)),
        [X_BN, P5, P5, *BN_STATS, X_BN], {"bfloat16": 2 * 2 * 180, "float32": 4 * 5}),
    "layer_norm": (
        lambda x, s, b: ops.layer_norm(act(x), s, b),
        upcast(lambda x, s, b: ref_layer_norm(act(x), s, b)),
        [X_LN, P16, P16], {"bfloat16": 2 * 96, "float32": 4 * 2 * 6}),
    "attention_softmax": (  # the bf16 probabilities alone
        lambda s: ops.attention_softmax(act(s), MASK, scale=0.3),
        upcast(lambda s: jax.nn.softmax(jnp.where(MASK, act(s) * 0.3, -1e30), axis=-1)),
        [SCORES], {"bfloat16": 2 * 216}),
    "gelu": (lambda x: ops.gelu(act(x)), upcast(lambda x: jax.nn.gelu(act(x))),
             [X_LN], {"bfloat16": 2 * 96}),
    "cross_entropy": (  # the bf16 logits and one log-sum-exp per row
        lambda x: ops.softmax_cross_entropy(act(x), LABELS),
        lambda x: optax.softmax_cross_entropy_with_integer_labels(act(x).astype(F32), LABELS),
        [LOGITS], {"bfloat16": 2 * 30, "float32": 4 * 6}),
}


def saved_bytes(fn, args):
    report = jaxamp.audit_grad(fn, *args, argnums=tuple(range(len(args))))
    return {k: v for k, v in report.saved_bytes_by_dtype.items() if v}


@pytest.mark.parametrize("case", SAVED)
def test_saved_bytes_are_half_precision(case):
    fn, upcast_ref, args, expected = SAVED[case]
    assert saved_bytes(fn, args) == expected
    # The same math written with jnp in fp32 saves fp32 intermediates: at least one fp32 copy
    # of the activation, and more bytes in all. (How many more is jax's autodiff's business:
    # jax 0.12.1 saves 1.76x the op's bytes for optax's cross entropy, 0.10.2 2.12x.)
    ref = saved_bytes(upcast_ref, args)
    assert ref.get("float32", 0) >= 4 * args[0].size, ref
    assert sum(ref.values()) > sum(expected.values()), ref


def test_bias_add_and_embed_lookup_sum_gradients_in_fp32():
    x, bias = X_LN, normal(46, (16,)).astype(BF16)
    ours = jaxamp.audit_grad(lambda x, b: ops.bias_add(act(x), b).astype(F32), x, bias,
                             argnums=(0, 1))
    plain = jaxamp.audit_grad(lambda x, b: (act(x) + b).astype(F32), x, bias, argnums=(0, 1))
    # Plain autodiff sums the bias gradient over the batch in bf16.
    assert [(s.primitive, s.dtype, s.shape) for s in plain.half_sensitive_ops][0] == (
        "reduce_sum", "bfloat16", (2, 3, 16))
    assert {(s.primitive, s.dtype) for s in plain.half_sensitive_ops} == {
        ("reduce_sum", "bfloat16")}
    assert ours.half_sensitive_ops == []
    assert sum(ours.saved_bytes_by_dtype.values()) == 0 == plain.saved_bytes

    table = normal(47, (8, 4)).astype(BF16)

    def scatter_dtypes(lookup):
        jaxpr = jax.make_jaxpr(jax.grad(lambda t: lookup(act(t)).astype(F32).sum()))(table)
        return [str(e.invars[0].aval.dtype) for e in jaxpr.eqns
                if e.primitive.name == "scatter-add"]

    assert scatter_dtypes(lambda t: ops.embed_lookup(t, IDS)) == ["float32"]
    assert scatter_dtypes(lambda t: t[IDS]) == ["bfloat16"]
    # Only the ids are kept, not the table (a zero-byte array carries its shape and dtype).
    assert saved_bytes(lambda t: ops.embed_lookup(act(t), IDS), [table]) == {}
    grad = jax.grad(lambda t: ops.embed_lookup(t, IDS).astype(F32).sum())(table)
    assert grad.dtype == BF16
    np.testing.assert_array_equal(np.asarray(grad[:, 0], np.float32),
                                  [0, 3, 1, 1, 0, 0, 0, 1])


# --------------------------------------------------------------------------------------------
# Statistics, errors
# --------------------------------------------------------------------------------------------

def test_batch_norm_train_statistics_are_fp32_and_carry_no_gradient():
    x = normal(50, (6, 2, 2, 3), 2.0, 1.0).astype(BF16)
    scale, bias = jnp.ones(3), jnp.zeros(3)
    _, mean, var = ops.batch_norm_train(x, scale, bias)
    x32 = np.asarray(x.astype(F32))
    assert mean.dtype == var.dtype == F32
    np.testing.assert_allclose(mean, x32.mean((0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(var, x32.var((0, 1, 2)), rtol=1e-5)
    grad = jax.grad(lambda x: sum(ops.batch_norm_train(x, scale, bias)[1:]).sum())(x)
    assert grad.dtype == BF16
    np.testing.assert_array_equal(np.asarray(grad, np.float32), 0)


def test_bias_add_refuses_mixed_dtypes():
    with pytest.raises(TypeError, match=r"bias is float32 but x is bfloat16; expected the same "
                                        r"dtype\. Cast the bias first: "
                                        r"bias_add\(x, bias\.astype\(x\.dtype\)\)"):
        ops.bias_add(jnp.ones((2, 3), BF16), jnp.ones(3))


def test_ops_module_is_exported():
    assert jaxamp.ops is ops
    assert "ops" in jaxamp.__all__
    assert sorted(ops.__all__) == list(ops.__all__)
    assert {"layer_norm", "gelu"}.isdisjoint(jaxamp.__all__)
    for name in ops.__all__:
        assert ">>>" in getattr(ops, name).__doc__, name


@pytest.mark.parametrize("dtype,guarded", [(jnp.bfloat16, True), (jnp.float32, False)],
                         ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ["gelu", "layer_norm", "attention_softmax", "batch_norm_train",
                                "softmax_cross_entropy"])
def test_half_precision_residuals_are_read_behind_a_barrier(op, dtype, guarded):
    """In half precision each backward rule reads its residuals through an optimization barrier,
    so that XLA cannot merge the backward's fp32 recomputation with the forward's and keep the
    forward's fp32 tensors (what a GPU compile showed: BERT-Large's step 82 GB without, 45 GB
    with). In fp32 the rules run as written."""
    x = jax.random.normal(jax.random.key(0), (4, 8)).astype(dtype)
    one = jnp.ones(8)
    losses = {
        "gelu": lambda x: ops.gelu(x),
        "layer_norm": lambda x: ops.layer_norm(x, one, one * 0),
        "attention_softmax": lambda x: ops.attention_softmax(x),
        "batch_norm_train": lambda x: ops.batch_norm_train(x, one, one * 0, relu=True)[0],
        "softmax_cross_entropy": lambda x: ops.softmax_cross_entropy(x, jnp.arange(4)),
    }

    def loss(x):
        return (losses[op](x).astype(jnp.float32) ** 2).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(x)
    names = {e.primitive.name for e, _ in _jaxpr.walk(jaxpr)}
    assert ("optimization_barrier" in names) == guarded


# --------------------------------------------------------------------------------------------
# The fused output projection and cross-entropy
# --------------------------------------------------------------------------------------------

def _head(dtype, rows=37, features=16, classes=50):
    k = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(k[0], (rows, features)).astype(dtype)
    w = (0.3 * jax.random.normal(k[1], (classes, features))).astype(dtype)
    b = jax.random.normal(k[2], (classes,)).astype(dtype)
    labels = jax.random.randint(k[3], (rows,), 0, classes)
    weights = (jax.random.uniform(k[4], (rows,)) > 0.3).astype(jnp.float32)
    return x, w, b, labels, weights


def _plain_head(x, w, b, labels, weights):
    logits = jnp.einsum("nd,vd->nv", x, w, preferred_element_type=jnp.float32)
    logits = logits + b.astype(jnp.float32)
    losses = ops.softmax_cross_entropy(logits, labels)
    return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0), logits.argmax(-1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_rows", [8, 37, None])  # 8 leaves a partial chunk
def test_linear_softmax_cross_entropy_is_the_head_and_its_loss(dtype, chunk_rows):
    """The loss, the argmax and the gradients of x, w and bias are the plain head's (to fp32
    rounding in fp32, to bf16 rounding of the gradients in bf16), under any cotangent."""
    x, w, b, labels, weights = _head(dtype)

    def fused(x, w, b):
        loss, predicted = ops.linear_softmax_cross_entropy(x, w, labels, bias=b,
                                                           weights=weights,
                                                           chunk_rows=chunk_rows)
        return 3.0 * loss, predicted

    def plain(x, w, b):
        loss, predicted = _plain_head(x, w, b, labels, weights)
        return 3.0 * loss, predicted
    (lf, pf), gf = jax.value_and_grad(fused, argnums=(0, 1, 2), has_aux=True)(x, w, b)
    (lp, pp), gp = jax.value_and_grad(plain, argnums=(0, 1, 2), has_aux=True)(x, w, b)
    np.testing.assert_allclose(float(lf), float(lp), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(pf), np.asarray(pp))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for a, c in zip(gf, gp, strict=True):
        assert a.dtype == c.dtype == dtype
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        np.testing.assert_allclose(a / np.abs(c).max(), c / np.abs(c).max(), atol=tol)


def test_linear_softmax_cross_entropy_keeps_no_logits():
    """Saved for backward: the gradients of x, w and the bias, not the (rows, classes)
    logits a plain head keeps; the default chunk holds at most 2**26 logits."""
    x, w, b, labels, weights = _head(jnp.bfloat16, rows=512, features=64, classes=4096)
    saved = jaxamp.audit_grad(
        lambda x, w: ops.linear_softmax_cross_entropy(x, w, labels, bias=b)[0], x, w,
        argnums=(0, 1)).saved_bytes
    plain = jaxamp.audit_grad(lambda x, w: _plain_head(x, w, b, labels, jnp.ones(512))[0], x,
                              w, argnums=(0, 1)).saved_bytes
    assert saved <= 512 * 64 * 2 + 4096 * 64 * 2 + 4096 * 2 + 1024  # dx, dw, dbias
    assert plain >= 512 * 4096 * 2
    assert _ops._chunk_rows(32768, 30522) == 2185  # 15 chunks, 7 rows of padding
    assert _ops._chunk_rows(4096, 30522) == 2048 and _ops._chunk_rows(100, 8192) == 100


def test_linear_softmax_cross_entropy_refuses_bad_shapes():
    x, w, b, labels, weights = _head(jnp.float32)
    with pytest.raises(ValueError, match="x must be"):
        ops.linear_softmax_cross_entropy(x, w.T, labels)
    with pytest.raises(ValueError, match="labels must be"):
        ops.linear_softmax_cross_entropy(x, w, labels[:3])
    with pytest.raises(TypeError, match="cast the param"):
        ops.linear_softmax_cross_entropy(x, w.astype(jnp.bfloat16), labels)
    with pytest.raises(ValueError, match="weights must be"):
        ops.linear_softmax_cross_entropy(x, w, labels, weights=weights[:3])
    with pytest.raises(ValueError, match="chunk_rows"):
        ops.linear_softmax_cross_entropy(x, w, labels, chunk_rows=0)


def test_linear_softmax_cross_entropy_inside_shard_map():
    """Each device's rows inside ``jax.shard_map`` (the data-parallel step's layout): the
    chunk loop's carry takes the rows' manual axis, and the reduced gradients are those of
    the whole batch."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    x, w, b, labels, _ = _head(jnp.float32, rows=64)
    mesh = Mesh(np.array(jax.devices()[:8]), ("batch",))

    def per_device(x, w, b, labels):
        loss, _ = ops.linear_softmax_cross_entropy(x, w, labels, bias=b, chunk_rows=3)
        return jax.lax.pmean(loss, "batch")
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P("batch"), P(), P(), P("batch")),
                            out_specs=P())
    got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(x, w, b, labels)
    want = jax.value_and_grad(lambda x, w, b: ops.linear_softmax_cross_entropy(
        x, w, labels, bias=b)[0], argnums=(0, 1, 2))(x, w, b)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)
