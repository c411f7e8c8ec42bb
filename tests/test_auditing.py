"""Tests of the precision audit: ``jaxamp.audit``, ``jaxamp.audit_grad`` and ``AuditReport``."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

import jaxamp
from train.models.linen_encoder import variants

# Under pytest-xdist, the tests sharing a module-scoped fixture run on one worker.
pytestmark = pytest.mark.xdist_group("encoder_reports")

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
N_DEVICES = 8


def line_of(fn, offset):
    """``test_auditing.py:N:`` for the line ``offset`` lines below ``fn``'s ``def``."""
    return f"test_auditing.py:{fn.__code__.co_firstlineno + offset}:"


# --------------------------------------------------------------------------------------------
# The promotion trap on a Flax Linen encoder
# --------------------------------------------------------------------------------------------

# Batch 4 x 64 tokens, 2 blocks of width 64 (2 heads of 32), MLP 256, vocabulary 256.
B, L, W, H, DH, M, V, DEPTH = 4, 64, 64, 2, 32, 256, 256, 2
ENCODER = dict(vocab=V, width=W, depth=DEPTH, heads=H, mlp=M, batch=B, seq_len=L)
# Forward matmul FLOPs: per block, the q/k/v/out projections (4 x 2·B·L·W·W), the two
# attention contractions q·k and p·v (2 x 2·B·H·L·L·DH) and the MLP (2 x 2·B·L·W·M); then the
# head (2·B·L·W·V). The embedding is a gather, not a matmul.
ENCODER_FWD_FLOPS = (DEPTH * (4 * 2 * B * L * W * W + 2 * 2 * B * H * L * L * DH
                              + 2 * 2 * B * L * W * M)
                     + 2 * B * L * W * V)
# Backward: every matmul needs the gradient of both operands (the activations depend on the
# embedding), each costing the forward FLOPs again.
ENCODER_GRAD_FLOPS = 3 * ENCODER_FWD_FLOPS


@pytest.fixture(scope="module")
def encoder_reports():
    """``{name: (audit_grad report, audit report)}`` for the fp32, jmp and bf16 encoders."""
    return {name: (jaxamp.audit_grad(loss, params, tokens), jaxamp.audit(loss, params, tokens))
            for name, loss, params, tokens in variants(**ENCODER)}


def test_encoder_flops_equal_the_hand_count(encoder_reports):
    assert ENCODER_FWD_FLOPS == 2**26
    for grad, fwd in encoder_reports.values():
        assert fwd.total_matmul_flops == ENCODER_FWD_FLOPS
        assert grad.total_matmul_flops == ENCODER_GRAD_FLOPS


def test_fp32_encoder_runs_every_matmul_in_fp32(encoder_reports):
    for report in encoder_reports["fp32"]:
        assert report.matmul_flops_by_operands == {"float32": report.total_matmul_flops}
        assert report.fp32_matmul_share == 1.0
        assert report.share("float32") == 1.0
        assert report.share("bfloat16") == 0.0


@pytest.mark.parametrize("which", [0, 1], ids=["audit_grad", "audit"])
def test_jmp_recipe_runs_the_matmuls_in_fp32(encoder_reports, which):
    """Params cast to bf16, LayerNorm(dtype=float32): each fp32 LayerNorm output promotes the
    next Dense back to fp32, and the attention and MLP follow."""
    report = encoder_reports["jmp recipe"][which]
    assert report.fp32_matmul_share >= 0.99
    assert report.share("bfloat16") <= 0.01
    assert report.fp32_matmuls
    assert sum(s.flops for s in report.fp32_matmuls) >= 0.99 * report.total_matmul_flops
    # Largest first.
    flops = [s.flops for s in report.fp32_matmuls]
    assert flops == sorted(flops, reverse=True)
    # The sites point at the model's own lines that call each layer, not into flax ...
    for site in report.fp32_matmuls:
        assert "train/models/linen_encoder.py" in site.where, site.where
        assert site.primitive == "dot_general"
    # ... and their name stacks name the modules: the Dense after each LayerNorm, the
    # attention projections and the head.
    stacks = {s.name_stack.removesuffix(" [backward]") for s in report.fp32_matmuls}
    for i in range(DEPTH):
        assert f"Encoder/layer{i}/mlp_in" in stacks
        assert f"Encoder/layer{i}/mlp_out" in stacks
        for proj in ("query", "key", "value", "out"):
            assert f"Encoder/layer{i}/attention/{proj}" in stacks
    assert "Encoder/head" in stacks


def test_jmp_recipe_fp32_operands_come_from_the_layernorms(encoder_reports):
    report = encoder_reports["jmp recipe"][1]
    by_stack = {s.name_stack: s for s in report.fp32_matmuls}
    for i in range(DEPTH):
        mlp_in = by_stack[f"Encoder/layer{i}/mlp_in"]
        assert (mlp_in.lhs, mlp_in.rhs, mlp_in.out) == ("float32", "float32", "float32")
        assert (mlp_in.lhs_shape, mlp_in.rhs_shape) == ((B, L, W), (W, M))
        assert mlp_in.flops == 2 * B * L * W * M
        assert mlp_in.fp32_source == f"Encoder/layer{i}/norm2"
        assert by_stack[f"Encoder/layer{i}/attention/query"].fp32_source == (
            f"Encoder/layer{i}/norm1")
    assert by_stack["Encoder/head"].fp32_source == "Encoder/final_norm"
    # Forward: the final LayerNorm promotes the head, norm2 the MLP input.
    assert report.fp32_sources["Encoder/final_norm"] == 2 * B * L * W * V
    assert report.fp32_sources["Encoder/layer0/norm2"] == 2 * B * L * W * M


@pytest.mark.parametrize("which", [0, 1], ids=["audit_grad", "audit"])
def test_bfloat16_encoder_runs_the_matmuls_in_bfloat16(encoder_reports, which):
    report = encoder_reports["dtype=bfloat16"][which]
    assert report.share("bfloat16") >= 0.99
    assert report.fp32_matmul_share == 0.0
    assert report.fp32_matmuls == []
    assert report.fp32_sources == {}


def test_encoder_saved_activation_bytes(encoder_reports):
    fp32 = encoder_reports["fp32"][0].saved_bytes
    jmp_recipe = encoder_reports["jmp recipe"][0].saved_bytes
    bf16 = encoder_reports["dtype=bfloat16"][0].saved_bytes
    assert fp32 > 0
    # The jmp recipe keeps fp32 activations and, in addition, the fp32 casts of the bf16 params.
    assert jmp_recipe > fp32
    assert bf16 < 0.75 * fp32
    assert set(encoder_reports["fp32"][0].saved_bytes_by_dtype) <= {"float32", "int32"}
    # The forward audit reports the residuals that differentiating it would keep: the same.
    for grad, fwd in encoder_reports.values():
        assert fwd.saved_bytes == grad.saved_bytes


# --------------------------------------------------------------------------------------------
# FLOP counts
# --------------------------------------------------------------------------------------------

def dense(x, w):
    return x @ w


def test_dense_flops():
    b, i, o = 4, 6, 10
    x, w = jnp.ones((b, i)), jnp.ones((i, o))
    fwd = 2 * b * i * o
    assert jaxamp.audit(dense, x, w).total_matmul_flops == fwd
    # argnums defaults to 0: the gradient wrt x alone is one more matmul (g @ w.T) ...
    assert jaxamp.audit_grad(dense, x, w).total_matmul_flops == 2 * fwd
    # ... wrt w alone (x.T @ g) too, and wrt both two more.
    assert jaxamp.audit_grad(dense, x, w, argnums=1).total_matmul_flops == 2 * fwd
    assert jaxamp.audit_grad(dense, x, w, argnums=(0, 1)).total_matmul_flops == 3 * fwd
    sites = jaxamp.audit_grad(dense, x, w, argnums=(0, 1)).matmuls
    assert [s.flops for s in sites] == [fwd, fwd, fwd]
    assert sites[0].lhs_shape == (b, i) and sites[0].rhs_shape == (i, o)


def test_ragged_dot_flops_in_every_ragged_mode():
    """A mixture of experts' grouped matmul: the forward (ragged rows), the gradient of the
    rows (ragged rows again) and of the experts' weights (ragged contraction) each cost
    2 × m × k × n, whatever the group sizes."""
    m, k, n, groups = 12, 4, 5, 3
    sizes = jnp.array([5, 0, 7], jnp.int32)
    x, w = jnp.ones((m, k)), jnp.ones((groups, k, n))

    def moe(x, w):
        return jax.lax.ragged_dot(x, w, sizes)
    fwd = 2 * m * k * n
    assert jaxamp.audit(moe, x, w).total_matmul_flops == fwd
    sites = jaxamp.audit_grad(moe, x, w, argnums=(0, 1)).matmuls
    assert [s.flops for s in sites] == [fwd, fwd, fwd]
    assert {s.primitive for s in sites} <= {"ragged_dot", "ragged_dot_general"}


def test_batched_matmul_einsum_flops():
    b, i, j, k = 3, 5, 7, 4
    x, y = jnp.ones((b, i, j)), jnp.ones((b, j, k))
    report = jaxamp.audit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), x, y)
    assert report.total_matmul_flops == 2 * b * i * j * k
    grad = jaxamp.audit_grad(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), x, y,
                             argnums=(0, 1))
    assert grad.total_matmul_flops == 3 * 2 * b * i * j * k


def test_attention_scores_einsum_flops():
    b, h, q, m, d = 2, 3, 5, 6, 8
    x, y = jnp.ones((b, h, q, d)), jnp.ones((b, h, m, d))
    report = jaxamp.audit(lambda x, y: jnp.einsum("bhld,bhmd->bhlm", x, y), x, y)
    assert report.total_matmul_flops == 2 * b * h * q * m * d
    # Two contracting dimensions at once.
    report = jaxamp.audit(lambda x, y: jnp.einsum("bhld,bhld->b", x, y), x, x)
    assert report.total_matmul_flops == 2 * b * h * q * d


def conv(x, k, groups):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=groups)


@pytest.mark.parametrize("n, h, w, cin, cout, kh, kw, groups", [
    (2, 8, 8, 3, 5, 3, 3, 1),
    (2, 7, 9, 4, 6, 3, 1, 1),
    (2, 8, 8, 4, 6, 3, 3, 2),  # grouped
    (2, 7, 9, 6, 6, 3, 3, 6),  # depthwise
])
def test_stride_one_same_conv_flops(n, h, w, cin, cout, kh, kw, groups):
    x, k = jnp.ones((n, h, w, cin)), jnp.ones((kh, kw, cin // groups, cout))
    # Multiply-adds on real data: each output element is a dot over the kernel taps that land
    # inside the input (SAME pads lo = (k-1)//2, hi = k-1-lo; the taps on padding are dropped)
    # and the group's input features.
    fwd = 2 * n * same_taps(h, kh) * same_taps(w, kw) * cout * (cin // groups)
    grouped = functools.partial(conv, groups=groups)
    report = jaxamp.audit(grouped, x, k)
    assert report.total_matmul_flops == fwd
    assert [s.primitive for s in report.matmuls] == ["conv_general_dilated"]
    # The input gradient (a conv of the cotangent with the flipped kernel) and the kernel
    # gradient (a conv of the input with the cotangent) each cost the forward FLOPs.
    for argnums in (0, 1):
        grad = jaxamp.audit_grad(grouped, x, k, argnums=argnums)
        assert [s.flops for s in grad.matmuls] == [fwd, fwd]
    grad = jaxamp.audit_grad(grouped, x, k, argnums=(0, 1))
    assert grad.total_matmul_flops == 3 * fwd


def same_taps(size, k):
    """Kernel taps landing inside the input, summed over a stride-1 SAME output axis."""
    lo, hi = (k - 1) // 2, k - 1 - (k - 1) // 2
    return size * k - lo * (lo + 1) // 2 - hi * (hi + 1) // 2


def test_same_taps_by_hand():
    # 8 outputs × 3 taps, minus the one tap on padding at each edge.
    assert same_taps(8, 3) == 22
    assert same_taps(9, 1) == 9


@pytest.mark.parametrize("stride, padding", [
    ((2, 2), "SAME"), ((2, 2), "VALID"), ((3, 2), "SAME"), ((2, 2), ((2, 1), (0, 2)))])
def test_strided_conv_gradients_cost_the_forward(stride, padding):
    x, k = jnp.ones((2, 15, 16, 8)), jnp.ones((3, 3, 8, 4))

    def f(x, k):
        return lax.conv_general_dilated(x, k, stride, padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    fwd = jaxamp.audit(f, x, k).total_matmul_flops
    # The input gradient convolves a dilated cotangent: its inserted zeros are not data.
    for argnums in (0, 1):
        grad = jaxamp.audit_grad(f, x, k, argnums=argnums)
        assert [s.flops for s in grad.matmuls] == [fwd, fwd]


def test_valid_conv_flops_by_hand():
    x, k = jnp.ones((2, 9, 9, 3)), jnp.ones((3, 3, 3, 5))
    report = jaxamp.audit(lambda x, k: lax.conv_general_dilated(
        x, k, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")), x, k)
    # 4 × 4 outputs, every tap on real data.
    assert report.total_matmul_flops == 2 * 2 * 4 * 4 * 5 * 3 * 3 * 3


def test_batch_grouped_conv_flops():
    n, h, w, cin, cout, g = 4, 5, 5, 3, 6, 2
    x, k = jnp.ones((n, h, w, cin)), jnp.ones((3, 3, cin, cout))
    report = jaxamp.audit(
        lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                              dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                              batch_group_count=g), x, k)
    # Output (n / g, h, w, cout): each output feature group reads one batch group.
    assert report.total_matmul_flops == 2 * (n // g) * same_taps(h, 3) * same_taps(w, 3) \
        * cout * cin


# --------------------------------------------------------------------------------------------
# Grouping by dtype
# --------------------------------------------------------------------------------------------

def test_mixed_operands_are_grouped_under_both_dtypes():
    a, b = jnp.ones((4, 8), BF16), jnp.ones((8, 3), F32)
    report = jaxamp.audit(dense, a, b)
    assert report.matmul_flops_by_operands == {"bfloat16 x float32": 2 * 4 * 8 * 3}
    assert report.matmul_flops_by_output == {"float32": 2 * 4 * 8 * 3}
    assert report.share("bfloat16 x float32") == 1.0
    assert report.fp32_matmul_share == 1.0
    (site,) = report.fp32_matmuls
    assert (site.lhs, site.rhs, site.out) == ("bfloat16", "float32", "float32")
    assert site.fp32_source == "input"
    # The key is sorted: the same for float32 x bfloat16.
    assert jaxamp.audit(dense, b.T, a.T).matmul_flops_by_operands == {
        "bfloat16 x float32": 2 * 3 * 8 * 4}


def test_preferred_element_type_groups_by_operands_and_output():
    a, b = jnp.ones((4, 8), BF16), jnp.ones((8, 3), BF16)
    report = jaxamp.audit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32), a, b)
    assert report.matmul_flops_by_operands == {"bfloat16": 192.0}
    assert report.matmul_flops_by_output == {"float32": 192.0}
    assert report.fp32_matmuls == []
    assert report.share("bfloat16") == 1.0 and report.fp32_matmul_share == 0.0


def test_by_output_is_keyed_by_the_output_dtype():
    def two(a, b, c):
        return (a @ b).astype(F32) + (c @ c.T)[:4, :3]

    report = jaxamp.audit(two, jnp.ones((4, 8), F16), jnp.ones((8, 3), F16),
                          jnp.ones((5, 2), F32))
    assert report.matmul_flops_by_operands == {"float16": 192.0, "float32": 100.0}
    assert report.matmul_flops_by_output == {"float16": 192.0, "float32": 100.0}
    assert report.share("float16") == 192 / 292


# --------------------------------------------------------------------------------------------
# Nested transforms
# --------------------------------------------------------------------------------------------

D_B, D_I = 4, 8
ONE = 2 * D_B * D_I * D_I  # one D_B x D_I @ D_I x D_I matmul


def tanh_layer(w, x):
    return jnp.tanh(x @ w)


def test_scan_body_counts_length_times():
    def scanned(ws, x):
        return lax.scan(lambda h, w: (tanh_layer(w, h), None), x, ws)[0]

    ws, x = jnp.ones((5, D_I, D_I)), jnp.ones((D_B, D_I))
    assert jaxamp.audit(scanned, ws, x).total_matmul_flops == 5 * ONE
    # Backward: dW and the cotangent of each layer's input, 5 times.
    assert jaxamp.audit_grad(scanned, ws, x).total_matmul_flops == 3 * 5 * ONE


def test_fori_loop_with_static_bounds_counts_each_trip():
    w, x = jnp.ones((D_I, D_I)), jnp.ones((D_B, D_I))
    report = jaxamp.audit(lambda w, x: lax.fori_loop(0, 3, lambda i, h: h @ w, x), w, x)
    assert report.total_matmul_flops == 3 * ONE


def test_while_loop_body_counts_once():
    w, x = jnp.ones((D_I, D_I)), jnp.ones((D_B, D_I))

    def loop(w, x, n):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    assert jaxamp.audit(loop, w, x, 3).total_matmul_flops == ONE


def test_remat_recomputes_the_forward_in_the_gradient():
    w, x = jnp.ones((D_I, D_I)), jnp.ones((D_B, D_I))
    assert jaxamp.audit(jax.checkpoint(tanh_layer), w, x).total_matmul_flops == ONE
    # Forward, the recomputed forward, and dW.
    assert jaxamp.audit_grad(jax.checkpoint(tanh_layer), w, x).total_matmul_flops == 3 * ONE
    assert jaxamp.audit_grad(tanh_layer, w, x).total_matmul_flops == 2 * ONE


def test_cond_counts_every_branch():
    w, x = jnp.ones((D_I, D_I)), jnp.ones((D_B, D_I))

    def branchy(pred, w, x):
        return lax.cond(pred, lambda: x @ w, lambda: (x @ w) @ w)

    # One matmul in the first branch, two in the second: the report is the sum, 3.
    for pred in (True, False):
        assert jaxamp.audit(branchy, pred, w, x).total_matmul_flops == 3 * ONE


def test_custom_vjp_primal_and_rules_are_counted():
    @jax.custom_vjp
    def matmul(w, x):
        return x @ w

    def fwd(w, x):
        return x @ w, (w, x)

    def bwd(res, g):
        w, x = res
        return x.T @ g, g @ w.T

    matmul.defvjp(fwd, bwd)
    w, x = jnp.ones((D_I, D_I)), jnp.ones((D_B, D_I))
    assert jaxamp.audit(matmul, w, x).total_matmul_flops == ONE
    # The fwd rule's matmul, then the two of the bwd rule.
    assert jaxamp.audit_grad(matmul, w, x).total_matmul_flops == 3 * ONE


def test_custom_jvp_primal_is_counted():
    @jax.custom_jvp
    def matmul(w, x):
        return x @ w

    matmul.defjvp(lambda p, t: (matmul(*p), t[1] @ p[0] + p[1] @ t[0]))
    w, x = jnp.ones((D_I, D_I)), jnp.ones((D_B, D_I))
    assert jaxamp.audit(matmul, w, x).total_matmul_flops == ONE


def test_jit_nested_function_is_counted_once_per_call():
    inner = jax.jit(dense)
    w, x = jnp.ones((D_I, D_I)), jnp.ones((D_B, D_I))
    assert jaxamp.audit(lambda w, x: inner(x, w), w, x).total_matmul_flops == ONE
    assert jaxamp.audit(lambda w, x: inner(inner(x, w), w), w, x).total_matmul_flops == 2 * ONE
    assert jaxamp.audit(jax.jit(lambda w, x: inner(x, w)), w, x).total_matmul_flops == ONE


def test_shard_map_body_counts_once_per_device():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    n = 2 * N_DEVICES
    w, x = jnp.ones((D_I, D_I)), jnp.ones((n, D_I))
    sharded = jax.shard_map(dense, mesh=mesh, in_specs=(PartitionSpec("d"), PartitionSpec()),
                            out_specs=PartitionSpec("d"))
    report = jaxamp.audit(sharded, x, w)
    (site,) = report.matmuls
    assert site.lhs_shape == (n // N_DEVICES, D_I)
    # The body's FLOPs (2 rows per device) times 8 devices: the unsharded total.
    assert site.flops == N_DEVICES * 2 * (n // N_DEVICES) * D_I * D_I
    assert report.total_matmul_flops == jaxamp.audit(dense, x, w).total_matmul_flops


def test_pmap_body_counts_once_per_device():
    w, x = jnp.ones((D_I, D_I)), jnp.ones((N_DEVICES, 2, D_I))
    report = jaxamp.audit(jax.pmap(dense, in_axes=(0, None)), x, w)
    assert report.total_matmul_flops == 2 * (N_DEVICES * 2) * D_I * D_I
    assert report.total_matmul_flops == jaxamp.audit(
        jax.vmap(dense, in_axes=(0, None)), x, w).total_matmul_flops


# --------------------------------------------------------------------------------------------
# Precision-sensitive ops, saved activations, casts
# --------------------------------------------------------------------------------------------

def softplus(x):
    e = jnp.exp(x)
    return jnp.log(e + 1)


def test_exp_and_log_in_half_precision_are_listed_with_their_line():
    x = jnp.ones((4, 8), BF16)
    report = jaxamp.audit(softplus, x)
    ops = {op.primitive: op for op in report.half_sensitive_ops}
    assert set(ops) == {"exp", "log"}
    assert (ops["exp"].dtype, ops["exp"].shape, ops["exp"].count) == ("bfloat16", (4, 8), 1.0)
    assert (ops["log"].dtype, ops["log"].shape, ops["log"].count) == ("bfloat16", (4, 8), 1.0)
    assert line_of(softplus, 1) in ops["exp"].where
    assert line_of(softplus, 2) in ops["log"].where
    assert "(softplus)" in ops["exp"].where


def test_exp_and_log_in_fp32_are_not_listed():
    assert jaxamp.audit(softplus, jnp.ones((4, 8), F32)).half_sensitive_ops == []


def test_sensitive_ops_in_a_scan_count_per_iteration():
    def scanned(x):
        return lax.scan(lambda h, _: (softplus(h), None), x, None, length=3)[0]

    report = jaxamp.audit(scanned, jnp.ones((4,), F16))
    assert sorted((op.primitive, op.dtype, op.count) for op in report.half_sensitive_ops) == [
        ("exp", "float16", 3.0), ("log", "float16", 3.0)]


MLP_B, MLP_DIMS = 8, (16, 32, 24, 4)


def mlp(params, x):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return h


def mlp_args(dtype):
    params = [(jnp.ones((i, o), dtype), jnp.ones((o,), dtype))
              for i, o in zip(MLP_DIMS[:-1], MLP_DIMS[1:], strict=False)]
    return params, jnp.ones((MLP_B, MLP_DIMS[0]), dtype)


@pytest.mark.parametrize("dtype, name, itemsize", [(F32, "float32", 4), (BF16, "bfloat16", 2)])
def test_mlp_saved_activation_bytes(dtype, name, itemsize):
    # Each tanh layer saves its output t and 1 - t**2 (8x32 and 8x24); the weights and the
    # input are arguments, and the last layer is linear.
    hand = itemsize * 2 * MLP_B * (MLP_DIMS[1] + MLP_DIMS[2])
    assert jaxamp.audit(mlp, *mlp_args(dtype)).saved_bytes_by_dtype == {name: hand}
    assert jaxamp.audit_grad(mlp, *mlp_args(dtype)).saved_bytes == hand


def test_bfloat16_mlp_saves_half_the_bytes_of_fp32():
    f32 = jaxamp.audit_grad(mlp, *mlp_args(F32)).saved_bytes
    bf16 = jaxamp.audit_grad(mlp, *mlp_args(BF16)).saved_bytes
    assert bf16 == pytest.approx(f32 / 2, rel=0.05)


def test_remat_saves_no_activations():
    params, x = mlp_args(F32)
    assert jaxamp.audit(jax.checkpoint(mlp), params, x).saved_bytes == 0


def test_casts_count_and_bytes():
    def round_trip(x):
        y = x.astype(BF16)
        return (y * 2).astype(F32)

    report = jaxamp.audit(round_trip, jnp.ones((4, 8), F32))
    n = 4 * 8
    assert report.casts == {
        "float32 -> bfloat16": {"count": 1.0, "bytes": n * 4 + n * 2},
        "bfloat16 -> float32": {"count": 1.0, "bytes": n * 2 + n * 4},
    }


def test_casts_in_a_scan_count_per_iteration():
    def scanned(x):
        return lax.scan(lambda h, _: (h.astype(F16).astype(F32) * 2, None), x, None,
                        length=4)[0]

    report = jaxamp.audit(scanned, jnp.ones((10,), F32))
    assert report.casts == {"float32 -> float16": {"count": 4.0, "bytes": 4 * 60.0},
                            "float16 -> float32": {"count": 4.0, "bytes": 4 * 60.0}}


# --------------------------------------------------------------------------------------------
# What can be audited
# --------------------------------------------------------------------------------------------

def test_plain_jnp_function():
    report = jaxamp.audit(dense, jnp.ones((2, 8), BF16), jnp.ones((8, 4), BF16))
    assert report.title == "dense"
    assert report.matmul_flops_by_operands == {"bfloat16": 128.0}
    grad = jaxamp.audit_grad(dense, jnp.ones((2, 8), BF16), jnp.ones((8, 4), BF16))
    assert grad.title == "dense (value and grad)"


def test_audit_grad_of_a_non_floating_output_raises():
    with pytest.raises(ValueError, match="floating"):
        jaxamp.audit_grad(lambda x: jnp.argmax(x), jnp.ones(3))


class NnxMlp(nnx.Module):
    def __init__(self, dtype, rngs):
        # Params stored in the compute dtype: no casts inside the layers.
        param_dtype = F32 if dtype is None else dtype
        self.layer0 = nnx.Linear(8, 16, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layer1 = nnx.Linear(16, 4, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.layer1(jnp.tanh(self.layer0(x)))


NNX_FLOPS = 2 * 2 * 8 * 16 + 2 * 2 * 16 * 4  # batch 2


@pytest.mark.parametrize("dtype, operands", [(None, "float32"), (BF16, "bfloat16")])
def test_nnx_module_called_directly(dtype, operands):
    model = NnxMlp(dtype, nnx.Rngs(0))
    report = jaxamp.audit(model, jnp.ones((2, 8)))
    assert report.title == "NnxMlp"
    assert report.matmul_flops_by_operands == {operands: NNX_FLOPS}
    # Each site is the model's own line that calls the nnx.Linear, not flax's source.
    calls = {line_of(NnxMlp.__call__, 1)}
    for site in report.matmuls:
        assert "flax/nnx/" not in site.where
        assert any(c in site.where for c in calls), site.where


def test_nnx_module_as_an_argument_and_split_merge():
    model = NnxMlp(BF16, nnx.Rngs(0))
    x = jnp.ones((2, 8), BF16)
    as_arg = jaxamp.audit(lambda m, x: m(x), model, x)
    assert as_arg.matmul_flops_by_operands == {"bfloat16": NNX_FLOPS}
    graphdef, params = nnx.split(model)

    def apply(params, x):
        return nnx.merge(graphdef, params)(x)

    assert jaxamp.audit(apply, params, x).matmul_flops_by_operands == {"bfloat16": NNX_FLOPS}
    # Gradient wrt the params: dW for both layers, and dx for the second one's input.
    grad = jaxamp.audit_grad(apply, params, x)
    assert grad.total_matmul_flops == NNX_FLOPS * 2 + 2 * 2 * 16 * 4
    # The tanh output and 1 - tanh**2 (2x16 each, bf16) are the saved activations.
    assert grad.saved_bytes_by_dtype == {"bfloat16": 2 * 2 * 16 * 2}


def test_nnx_module_called_directly_saves_only_activations():
    """The module's params are closed over, not arguments: they are no activations, and what
    only their gradients would read is not saved either. Called directly, the module is
    differentiated with respect to ``x`` alone: exactly what the params as arguments give
    with ``argnums`` on ``x``, and exactly the tensors tanh saves for its own derivative
    (``1 - tanh**2``, one 2x16 bf16 tensor from jax 0.11; jax 0.10's rule also kept the tanh
    output). The tanh output as layer1's operand is for layer1's kernel gradient only."""
    model = NnxMlp(BF16, nnx.Rngs(0))
    x = jnp.ones((2, 8), BF16)
    as_arg = jaxamp.audit(lambda m, x: m(x), model, x)
    assert as_arg.saved_bytes_by_dtype == {"bfloat16": 2 * 2 * 16 * 2}  # tanh, 1 - tanh**2
    direct = jaxamp.audit(model, x).saved_bytes_by_dtype
    wrt_x = jaxamp.audit_grad(lambda m, x: m(x), model, x, argnums=1).saved_bytes_by_dtype
    assert direct == wrt_x
    tanh_alone = jaxamp.audit(jnp.tanh, jnp.ones((2, 16), BF16)).saved_bytes_by_dtype
    assert direct == tanh_alone
    assert tanh_alone["bfloat16"] in (2 * 16 * 2, 2 * 2 * 16 * 2)  # no kernel (384 bytes)


class LinenMlp(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(dtype=F32, name="norm")(x)
        x = jnp.tanh(nn.Dense(16, dtype=self.dtype, name="hidden")(x))
        return nn.Dense(4, dtype=self.dtype, name="out")(x)


def test_linen_apply():
    model = LinenMlp(dtype=BF16)
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    report = jaxamp.audit(model.apply, variables, x)
    assert report.title == "apply"
    assert report.matmul_flops_by_operands == {"bfloat16": NNX_FLOPS}
    assert [s.name_stack for s in report.matmuls] == ["LinenMlp/hidden", "LinenMlp/out"]
    # Without dtype the fp32 LayerNorm promotes the bf16-cast params' matmul to fp32.
    fp32_model = LinenMlp()
    bf16_params = jax.tree.map(lambda p: p.astype(BF16), variables)
    promoted = jaxamp.audit(fp32_model.apply, bf16_params, x)
    assert promoted.fp32_matmul_share == 1.0
    assert promoted.fp32_matmuls[0].name_stack in ("LinenMlp/hidden", "LinenMlp/out")
    hidden = next(s for s in promoted.fp32_matmuls if s.name_stack == "LinenMlp/hidden")
    assert hidden.fp32_source == "LinenMlp/norm"


class RematNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(nn.Dense)(8, name="remat_dense")(x)
        x = nn.Dense(8, name="dense")(x)
        with jax.named_scope("gram"):
            return jax.jit(lambda x: x @ x.T)(x)


def test_name_stacks_inside_nested_jaxprs_keep_the_enclosing_scopes():
    """A remat'd Linen module and a jitted helper trace to nested jaxprs: their sites keep
    the full module path and scope, like the others."""
    model = RematNet()
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    fwd = jaxamp.audit(model.apply, variables, x)
    assert [s.name_stack for s in fwd.matmuls] == [
        "RematNet/remat_dense", "RematNet/dense", "RematNet/gram"]
    grad = jaxamp.audit_grad(model.apply, variables, x)
    stacks = [s.name_stack for s in grad.matmuls]
    # Forward: three matmuls. Backward: dW of both Dense layers, dx of the second one, and
    # both operands' cotangents of the Gram matrix.
    assert len(stacks) == 8
    assert sum(s.endswith(" [backward]") for s in stacks) == 5
    assert all(s.startswith("RematNet/") for s in stacks), stacks
    layers = [s.removesuffix(" [backward]").rsplit("/", 1)[-1] for s in stacks]
    assert sorted(layers) == sorted(["remat_dense"] * 2 + ["dense"] * 3 + ["gram"] * 3)


def mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["layer0"]["kernel"] + params["layer0"]["bias"])
    out = h @ params["layer1"]["kernel"] + params["layer1"]["bias"]
    return jnp.mean((out[:, 0].astype(F32) - batch["y"].astype(F32)) ** 2)


def test_train_step_of_a_clean_bfloat16_model_runs_its_matmuls_in_bfloat16():
    rng = np.random.default_rng(0)
    params = {"layer0": {"kernel": jnp.asarray(rng.normal(size=(4, 8)), F32),
                         "bias": jnp.zeros(8, F32)},
              "layer1": {"kernel": jnp.asarray(rng.normal(size=(8, 1)), F32),
                         "bias": jnp.zeros(1, F32)}}
    batch = {"x": np.ones((16, 4), np.float32), "y": np.ones((16,), np.float32)}
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    step = jaxamp.make_train_step(mlp_loss)
    for fn in (step, jax.jit(step)):
        report = jaxamp.audit(fn, state, batch)
        assert report.share("bfloat16") == 1.0
        assert report.fp32_matmuls == []
        # The model's matmuls, forward and backward: x @ W0 and h @ W1, then dW1, dh and dW0.
        model = [s for s in report.matmuls if "test_auditing.py" in s.where]
        assert sum(s.flops for s in model) == (
            2 * 16 * 4 * 8 + 2 * 16 * 8 * 1 + 2 * 16 * 8 * 1 + 2 * 16 * 1 * 8 + 2 * 16 * 4 * 8)
        assert len(model) == 5


def test_the_audit_of_a_step_reports_what_its_loss_saves_and_the_states_bytes_apart():
    """A step is never differentiated: what differentiating the whole step would keep (the
    state, the optimizer's arrays) was reported as saved for the backward pass."""
    params = {"w1": jnp.ones((64, 256), F32) * 0.01, "w2": jnp.ones((256, 8), F32) * 0.01}
    batch = np.ones((32, 64), np.float32)

    def loss(p, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)
    tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    for autocast, accum in ((False, 1), (True, 1), (True, 2)):
        step = jaxamp.make_train_step(loss, autocast=autocast, accum_steps=accum)
        report = jaxamp.audit(jax.jit(step), state, batch)
        working = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(params)
        half_batch = batch[: 32 // accum]
        fn = jaxamp.autocast(loss) if autocast else loss
        x = half_batch if autocast else half_batch.astype(jnp.bfloat16)
        want = jaxamp.audit_grad(lambda p, fn=fn, x=x: fn(p, x), working).saved_bytes_by_dtype
        assert report.saved_bytes_by_dtype == want, (autocast, accum)
        state_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(state))
        assert sum(report.state_bytes_by_dtype.values()) == state_bytes
        assert "the train state's bytes" in str(report)
    plain = jaxamp.audit(loss, params, batch)
    assert plain.state_bytes_by_dtype == {} and "train state" not in str(plain)


def dropout_loss(params, x, rng):
    h = x @ params["w"]
    keep = jax.random.bernoulli(rng, 0.5, h.shape)
    return jnp.mean(jnp.where(keep, h, 0.0) ** 2)


def test_train_step_with_dropout_on_the_step_rng():
    """``has_rng=True`` under autocast: the step's folded key is a residual of the step, a
    ``key<fry>`` that is no NumPy dtype. It is counted by its key data (two uint32 words), and
    the matmuls are reported as for any step."""
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params={"w": jnp.ones((4, 3))}, tx=tx,
                                     rng=jax.random.key(0))
    step = jaxamp.make_train_step(dropout_loss, has_rng=True, autocast=True)
    for fn in (step, jax.jit(step)):
        report = jaxamp.audit(fn, state, jnp.ones((2, 4)))
        assert report.share("bfloat16") == 1.0
        # x @ w and dW = g.T @ x (x is the batch: no gradient).
        model = [s.flops for s in report.matmuls if "test_auditing.py" in s.where]
        assert model == [2 * 2 * 4 * 3, 2 * 2 * 4 * 3]
        assert report.saved_bytes_by_dtype["key<fry>"] == 8


@jax.custom_vjp
def saved_key_dropout(x, key):
    return jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0)


def _saved_key_dropout_fwd(x, key):
    return saved_key_dropout(x, key), key  # the key alone is saved


def _saved_key_dropout_bwd(key, g):
    return jnp.where(jax.random.bernoulli(key, 0.5, g.shape), g, 0.0), None


saved_key_dropout.defvjp(_saved_key_dropout_fwd, _saved_key_dropout_bwd)


@pytest.mark.parametrize("impl, nbytes", [("threefry2x32", 8), ("rbg", 16)])
def test_a_saved_prng_key_counts_its_key_data(impl, nbytes):
    def f(w, x, key):
        return saved_key_dropout(x @ w, jax.random.fold_in(key, 1))
    w, x, key = jnp.ones((4, 3)), jnp.ones((2, 4)), jax.random.key(0, impl=impl)
    name = str(key.dtype)
    forward = jaxamp.audit(f, w, x, key)
    assert forward.saved_bytes_by_dtype == {name: nbytes}
    assert forward.matmul_flops_by_operands == {"float32": 2 * 2 * 4 * 3}
    grad = jaxamp.audit_grad(f, w, x, key)
    assert grad.saved_bytes_by_dtype == {name: nbytes}
    assert grad.matmul_flops_by_operands == {"float32": 2 * 2 * 2 * 4 * 3}


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------

def promoted_dense(x, w):
    return x @ w


@pytest.fixture
def promoted_report():
    return jaxamp.audit(promoted_dense, jnp.ones((2, 8), BF16), jnp.ones((8, 4), F32))


def test_str_has_the_headings_and_the_fp32_sites(promoted_report):
    text = str(promoted_report)
    assert text.startswith("jaxamp precision audit: promoted_dense")
    for heading in ("matmul/conv FLOPs by operand dtypes", "matmul/conv FLOPs by output dtype",
                    "matmuls with an fp32 operand", "fp32-preferred ops running in half precision",
                    "activation bytes saved for backward", "casts (convert_element_type)"):
        assert heading in text
    assert "100.0% with an fp32 operand" in text
    (site,) = promoted_report.fp32_matmuls
    assert line_of(promoted_dense, 1) in site.where
    site_lines = [line for line in text.splitlines() if site.where in line]
    assert len(site_lines) == 1
    assert "bfloat16[2, 8] x float32[8, 4]" in site_lines[0]
    assert "dot_general" in site_lines[0]


def test_html_has_tables(promoted_report):
    page = promoted_report._repr_html_()
    assert page.startswith("<h4>")
    assert page.count("<table>") == page.count("</table>") >= 5
    assert "bfloat16 x float32" in page
    assert "<tr><td>" in page


def test_to_dict_is_plain_python(promoted_report):
    def check(value):
        if isinstance(value, dict):
            for k, v in value.items():
                assert isinstance(k, str)
                check(v)
        elif isinstance(value, list | tuple):
            for v in value:
                check(v)
        else:
            assert value is None or type(value) in (str, int, float, bool), type(value)

    d = promoted_report.to_dict()
    check(d)
    assert json.loads(json.dumps(d))["total_matmul_flops"] == 128.0
    assert d["matmul_flops_by_operands"] == {"bfloat16 x float32": 128.0}
    assert d["fp32_matmul_share"] == 1.0
    assert d["fp32_matmuls"][0]["lhs_shape"] == (2, 8)
    assert d["saved_bytes"] == 0


def test_saved_bytes_follow_argnums():
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))

    def f(w, x):
        return jnp.sum(jnp.sin(x) @ w)
    # d/dw needs sin(x) (4×8 fp32 = 128 bytes); d/dx needs cos(x) as well.
    assert jaxamp.audit_grad(f, w, x, argnums=0).saved_bytes_by_dtype == {"float32": 128}
    assert jaxamp.audit_grad(f, w, x, argnums=(0, 1)).saved_bytes_by_dtype == {"float32": 256}
