"""FP8 matmuls (``jaxamp.fp8``): the quantizer against ml_dtypes bit for bit, the matmul and its
gradients against the dequantized reference, and the delayed-scaling metadata inside the train
step (rolled, merged by max over micro-batches and devices, untouched by the loss scale and by
a skipped step, checkpointed)."""

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen
from flax import nnx
from helpers import assert_tree_bitwise_equal
from helpers import bits
from helpers import covering_grid
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import _fp8
from jaxamp import fp8

F32 = jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
REFERENCE = {jnp.dtype(E4M3): ml_dtypes.float8_e4m3fn, jnp.dtype(E5M2): ml_dtypes.float8_e5m2}
DIMS = (((1,), (0,)), ((), ()))


# --------------------------------------------------------------------------------------------
# The numpy/ml_dtypes reference
# --------------------------------------------------------------------------------------------

def ref_scale(amax, dtype, margin=0, previous=1.0):
    amax = np.float32(amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = np.float32(np.float32(ml_dtypes.finfo(REFERENCE[jnp.dtype(dtype)]).max) / amax)
        scale = np.float32(scale / np.float32(2.0 ** margin))
    ok = amax > 0 and np.isfinite(amax) and np.isfinite(scale)
    return scale if ok else np.float32(previous)


def ref_quantize(x, dtype, scale):
    m = np.float32(ml_dtypes.finfo(REFERENCE[jnp.dtype(dtype)]).max)
    return np.clip(np.asarray(x, np.float32) * np.float32(scale), -m, m).astype(
        REFERENCE[jnp.dtype(dtype)])


def ref_dequantized(x, dtype):
    """``x`` as the FP8 matmul sees it, current scaling: quantized with its own amax, back in
    float64."""
    x = np.asarray(x, np.float32)
    scale = ref_scale(np.abs(x).max(), dtype)
    return ref_quantize(x, dtype, scale).astype(np.float64) / np.float64(scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("spread", [1.0, 1e3, 1e-4])
def test_quantize_matches_ml_dtypes_bit_for_bit(dtype, spread):
    rng = np.random.default_rng(0)
    # Normal values, values past the format's max (saturation), and values far below its
    # smallest normal (subnormals and underflow to zero) in one tensor.
    x = np.concatenate([rng.normal(size=4000) * spread,
                        rng.normal(size=500) * 1e6,
                        rng.normal(size=2000) * float(jnp.finfo(dtype).smallest_normal)]
                       ).astype(np.float32)
    for scale in (1.0, 3.7, 2.0 ** -7):
        got = jax.jit(_fp8.quantize, static_argnums=1)(x, dtype, scale)
        ref = ref_quantize(x, dtype, scale)
        np.testing.assert_array_equal(bits(got), ref.view(np.uint8))
    assert np.abs(ref_quantize(x, dtype, 1.0).astype(np.float32)).max() == _fp8.fp8_max(dtype)
    sub = ref_quantize(x, dtype, 1.0).astype(np.float32)
    assert ((sub != 0) & (np.abs(sub) < float(jnp.finfo(dtype).smallest_normal))).any()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_matches_reference_bit_for_bit(dtype, margin):
    amaxes = np.abs(np.random.default_rng(1).normal(size=200) * 10.0 ** np.linspace(-30, 30,
                                                                                   200))
    amaxes = amaxes.astype(np.float32)
    got = np.asarray(_fp8.compute_scale(amaxes, dtype, margin))
    ref = np.array([ref_scale(a, dtype, margin) for a in amaxes], np.float32)
    np.testing.assert_array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("bad", [0.0, np.inf, np.nan, 1e-45], ids=["zero", "inf", "nan",
                                                                    "subnormal"])
def test_bad_amax_keeps_the_previous_scale(bad):
    # A subnormal amax makes fp8_max / amax overflow fp32 (Transformer Engine #825).
    assert float(_fp8.compute_scale(jnp.float32(bad), E4M3, previous=7.5)) == 7.5
    state = fp8.Fp8State(jnp.full((3, 2), bad, F32), jnp.array([3.0, 5.0, 7.0], F32),
                         fp8.DelayedScaling(history_length=2, amax_algo="most_recent"))
    new = state.update(jnp.array([bad, 2.0, bad], F32))
    assert new.scale.tolist() == [3.0, 224.0, 7.0]


# --------------------------------------------------------------------------------------------
# The matmul, forward and backward, against the dequantized reference
# --------------------------------------------------------------------------------------------

def _data(shapes, seed=0, scales=None):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    scales = scales or [1.0] * len(shapes)
    return [jax.random.normal(k, s, F32) * c for k, s, c in zip(keys, shapes, scales,
                                                                  strict=True)]


def test_current_scaling_dense_matches_the_dequantized_reference():
    x, w, g = _data([(32, 64), (64, 16), (32, 16)], scales=[3.0, 0.05, 1e-3])
    out, vjp = jax.vjp(lambda a, b: fp8.fp8_dot_general(a, b, DIMS), x, w)
    dx, dw = vjp(g)
    xr, wr, gr = ref_dequantized(x, E4M3), ref_dequantized(w, E4M3), ref_dequantized(g, E5M2)
    # The same 8-bit values, accumulated in fp32 instead of float64: fp32 rounding only.
    np.testing.assert_allclose(out, xr @ wr, rtol=1e-5, atol=1e-6 * np.abs(xr @ wr).max())
    np.testing.assert_allclose(dx, gr @ wr.T, rtol=1e-5, atol=1e-6 * np.abs(gr @ wr.T).max())
    np.testing.assert_allclose(dw, xr.T @ gr, rtol=1e-5, atol=1e-6 * np.abs(xr.T @ gr).max())
    # And within FP8 tolerance of the exact fp32 matmul: e4m3 has 3 mantissa bits, e5m2 two.
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.abs(out - exact).max() < 0.1 * np.abs(exact).max()
    exact_dw = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
    assert np.abs(dw - exact_dw).max() < 0.2 * np.abs(exact_dw).max()


def test_delayed_scaling_dense_uses_the_states_scales():
    x, w, g = _data([(8, 16), (16, 4), (8, 4)], seed=3)
    scales = np.array([20.0, 100.0, 3000.0], np.float32)
    state = fp8.Fp8State(jnp.ones((3, 4), F32), jnp.asarray(scales),
                         fp8.DelayedScaling(history_length=4))
    out, vjp = jax.vjp(lambda a, b, s: fp8.delayed_dot_general(a, b, DIMS, s), x, w, state)
    dx, dw, seen = vjp(g)
    xr = ref_quantize(x, E4M3, scales[0]).astype(np.float64) / scales[0]
    wr = ref_quantize(w, E4M3, scales[1]).astype(np.float64) / scales[1]
    gr = ref_quantize(g, E5M2, scales[2]).astype(np.float64) / scales[2]
    np.testing.assert_allclose(out, xr @ wr, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, gr @ wr.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, xr.T @ gr, rtol=1e-5, atol=1e-6)
    # The cotangent of the state: the amax each tensor had, at the scale's place.
    np.testing.assert_array_equal(seen.scale, [np.abs(x).max(), np.abs(w).max(),
                                               np.abs(g).max()])
    np.testing.assert_array_equal(seen.amax_history, np.zeros((3, 4)))


def test_an_empty_history_scales_by_the_tensors_own_amax_not_by_one():
    x, w, g = _data([(8, 16), (16, 4), (8, 4)], seed=4, scales=[1.0, 0.01, 1e-6])
    fresh = fp8.Fp8State.create(fp8.DelayedScaling(history_length=4))
    out, vjp = jax.vjp(lambda a, b: fp8.delayed_dot_general(a, b, DIMS, fresh), x, w)
    current, current_vjp = jax.vjp(lambda a, b: fp8.fp8_dot_general(a, b, DIMS), x, w)
    assert_tree_bitwise_equal((out, vjp(g)), (current, current_vjp(g)))
    # Scale 1 would flush these gradients (1e-6, below e5m2's smallest subnormal) to zero.
    assert float(jnp.abs(vjp(g)[0]).max()) > 0


@pytest.mark.parametrize("spec", ["blhd,bmhd->bhlm", "bhlm,bmhd->blhd", "ij,kj->ik",
                                  "bij,bjk->bik"])
def test_batched_and_transposed_contractions_match_the_reference(spec):
    a_shape, b_shape = {"blhd,bmhd->bhlm": ((2, 5, 3, 4), (2, 6, 3, 4)),
                        "bhlm,bmhd->blhd": ((2, 3, 5, 6), (2, 6, 3, 4)),
                        "ij,kj->ik": ((5, 7), (3, 7)),
                        "bij,bjk->bik": ((2, 5, 7), (2, 7, 3))}[spec]
    a, b = _data([a_shape, b_shape], seed=5)

    def fp8_einsum(x, y):
        return jnp.einsum(spec, x, y, _dot_general=fp8.fp8_dot_general)
    out, vjp = jax.vjp(fp8_einsum, a, b)
    g = jax.random.normal(jax.random.key(9), out.shape)
    da, db = vjp(g)
    ar, br, gr = ref_dequantized(a, E4M3), ref_dequantized(b, E4M3), ref_dequantized(g, E5M2)
    ref_out, ref_vjp = jax.vjp(lambda x, y: jnp.einsum(spec, x, y), jnp.asarray(ar, F32),
                               jnp.asarray(br, F32))
    ref_da, ref_db = ref_vjp(jnp.asarray(gr, F32))
    for got, ref in ((out, ref_out), (da, ref_da), (db, ref_db)):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_gradients_keep_their_operands_dtypes_and_output_follows_preferred():
    x, w = (t.astype(jnp.bfloat16) for t in _data([(4, 8), (8, 2)]))
    out = fp8.fp8_dot_general(x, w, DIMS, preferred_element_type=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    dx, dw = jax.grad(lambda a, b: fp8.fp8_dot_general(a, b, DIMS).astype(F32).sum(),
                      argnums=(0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16


def test_tiny_gradients_with_large_scales_do_not_overflow_to_zero():
    # amax 1e-30: the gradient's scale is 5.7e34; times the kernel's it would overflow fp32.
    x, w = _data([(4, 8), (8, 2)], scales=[1.0, 0.01])
    g = jnp.full((4, 2), 1e-30, F32)
    _, vjp = jax.vjp(lambda a, b: fp8.fp8_dot_general(a, b, DIMS), x, w)
    dx, _ = vjp(g)
    ref = ref_dequantized(g, E5M2) @ ref_dequantized(w, E4M3).T
    assert np.all(np.abs(ref) > 0)
    np.testing.assert_allclose(dx, ref, rtol=1e-5)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_saturation_never_hides_a_non_finite_value(where):
    x, w = _data([(4, 8), (8, 2)])
    if where == "forward":
        x = x.at[0, 0].set(jnp.inf)
        assert np.isnan(fp8.fp8_dot_general(x, w, DIMS)).all()
    else:
        _, vjp = jax.vjp(lambda a, b: fp8.fp8_dot_general(a, b, DIMS), x, w)
        dx, dw = vjp(jnp.ones((4, 2)).at[1, 1].set(jnp.inf))
        assert np.isnan(dx).all() and np.isnan(dw).all()


# --------------------------------------------------------------------------------------------
# Autocast's mixed_fp8 and the audit
# --------------------------------------------------------------------------------------------

def test_mixed_fp8_autocast_runs_a_user_nnx_models_matmuls_in_fp8_but_head_and_attention():
    from train.models import nnx_gpt
    loss_fn, params = nnx_gpt.loss_and_params(width=32, depth=1, heads=2, max_len=16)
    batch = {"tokens": jax.random.randint(jax.random.key(0), (2, 17), 0, 256)}
    report = jaxamp.audit_grad(jaxamp.autocast(loss_fn, "mixed_fp8"), params, batch)
    # The head (vocab 256 x width 32) and the attention's two batched matmuls stay in bf16.
    fp8_rows = [m for m in report.matmuls if "float8" in m.lhs]
    bf16_rows = [m for m in report.matmuls if m.lhs == "bfloat16"]
    assert fp8_rows and bf16_rows and len(fp8_rows) + len(bf16_rows) == len(report.matmuls)
    assert 0.5 < report.fp8_matmul_share < 0.6
    assert report.to_dict()["fp8_matmul_share"] == report.fp8_matmul_share
    assert "in FP8" in str(report) and "FP8 matmul FLOPs" in str(report)
    # Everything else follows bf16: no fp32 matmul, no half-precision exp or sum.
    assert report.fp32_matmul_share == 0.0 and report.half_sensitive_ops == []
    every = jaxamp.Policy(F32, jnp.bfloat16, F32,
                          fp8=fp8.CurrentScaling(keep="", batched=True))
    assert jaxamp.audit_grad(jaxamp.autocast(loss_fn, every), params,
                             batch).fp8_matmul_share == 1.0
    bf16 = jaxamp.audit_grad(jaxamp.autocast(loss_fn, "mixed_bfloat16"), params, batch)
    assert bf16.fp8_matmul_share == 0.0 and "FP8" not in str(bf16)


@pytest.mark.parametrize("keep,batched,expected", [
    (None, False, ["fp8", "bf16", "bf16", "fp8", "bf16"]),
    ("", False, ["fp8", "bf16", "bf16", "fp8", "fp8"]),
    (None, True, ["fp8", "fp8", "fp8", "fp8", "bf16"]),
    (r"(^|/)proj(/|$)", False, ["fp8", "bf16", "bf16", "bf16", "fp8"]),
], ids=["default", "keep-none", "batched", "keep-by-path"])
def test_an_fp8_recipe_keeps_the_head_and_attention_in_bf16_by_argument_path(keep, batched,
                                                                             expected):
    k = jax.random.split(jax.random.key(0), 4)
    params = {"embed": {"embedding": jax.random.normal(k[0], (50, 16))},
              "attn": {"qkv": jax.random.normal(k[1], (16, 48)) * 0.1},
              "proj": {"kernel": jax.random.normal(k[2], (16, 16)) * 0.1}}
    tokens = jnp.arange(8).reshape(1, 8) % 50

    def model(p, t):
        x = p["embed"]["embedding"][t]                                  # a gather, not a matmul
        q, key, v = jnp.split(x @ p["attn"]["qkv"], 3, axis=-1)           # 1: a dense layer
        s = jnp.einsum("bld,bmd->blm", q, key)                           # 2: batched (attention)
        a = jnp.einsum("blm,bmd->bld", jax.nn.softmax(s, axis=-1), v)     # 3: batched
        h = a @ p["proj"]["kernel"].T.T                                  # 4: a view of "proj"
        return h @ p["embed"]["embedding"].T                             # 5: the tied head
    recipe = fp8.CurrentScaling(keep=keep, batched=batched)
    policy = jaxamp.Policy(F32, jnp.bfloat16, F32, fp8=recipe)
    matmuls = jaxamp.audit(jaxamp.autocast(model, policy), params, tokens).matmuls
    assert [m.lhs.replace("float8_e4m3fn", "fp8").replace("bfloat16", "bf16")
            for m in matmuls] == expected


def test_an_equinox_mlp_trains_under_mixed_fp8_with_every_matmul_in_fp8():
    import equinox as eqx
    model = eqx.nn.MLP(in_size=8, out_size=1, width_size=32, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, batch):
        pred = jax.vmap(eqx.combine(params, static))(batch["x"])
        return jnp.mean((pred.astype(F32) - batch["y"]) ** 2)
    batch = batch_of()
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_fp8")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))
    losses = []
    for _ in range(60):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.3 * losses[0] and int(m["skipped_steps"]) == 0
    report = jaxamp.audit_grad(jaxamp.autocast(loss_fn, "mixed_fp8"), state.params, batch)
    assert report.fp8_matmul_share == 1.0


def test_mixed_fp8_keeps_convolutions_in_bf16_and_linen_dense_in_fp8():
    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            x = linen.Conv(4, (3, 3))(x)
            return linen.Dense(3)(x.reshape(x.shape[0], -1))

    x = jnp.ones((2, 6, 6, 1))
    params = Net().init(jax.random.key(0), x)
    report = jaxamp.audit(jaxamp.autocast(Net().apply, "mixed_fp8"), params, x)
    kinds = {s.primitive: (s.lhs, s.rhs) for s in report.matmuls}
    assert kinds["conv_general_dilated"] == ("bfloat16", "bfloat16")
    assert kinds["dot_general"] == ("float8_e4m3fn", "float8_e4m3fn")


def test_autocast_keeps_fp8_operands_and_output_for_backward_not_the_fp32_accumulator():
    def f(w1, w2, x):
        return jnp.mean((jax.nn.gelu(x @ w1) @ w2) ** 2)
    w1, w2, x = _data([(16, 64), (64, 16), (8, 16)])
    saved = jaxamp.audit_grad(jaxamp.autocast(f, "mixed_fp8"), w1, w2, x,
                              argnums=(0, 1)).saved_bytes_by_dtype
    assert saved.get("float32", 0) <= 64  # the scales and amaxes: scalars
    assert saved["float8_e4m3fn"] == 16 * 64 + 64 * 16 + 8 * 16 + 8 * 64


def test_policy_preset():
    p = jaxamp.get_policy("mixed_fp8")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype, p.fp8) == (
        jnp.float32, jnp.bfloat16, jnp.float32, True)
    assert str(p) == "p=f32,c=bf16,o=f32,matmul=fp8"
    assert p != jaxamp.get_policy("mixed_bfloat16")
    assert "mixed_fp8" in jaxamp.Policy.PRESETS


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def test_bad_recipes_and_formats_are_clear_errors():
    with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'.*hybrid"):
        fp8.DelayedScaling(format="e3m4")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8.CurrentScaling(format="fp8")
    with pytest.raises(ValueError, match="history_length must be an int >= 1, got 0"):
        fp8.DelayedScaling(history_length=0)
    with pytest.raises(ValueError, match="unknown amax_algo 'mean'"):
        fp8.DelayedScaling(amax_algo="mean")
    with pytest.raises(ValueError, match="margin must be an int >= 0"):
        fp8.CurrentScaling(margin=-1)
    with pytest.raises(TypeError, match="delayed scaling keeps state"):
        fp8.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DIMS,
                            recipe=fp8.DelayedScaling())
    with pytest.raises(TypeError, match="DelayedScaling recipe"):
        fp8.DotGeneral(fp8.CurrentScaling())
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        fp8.fp8_dot_general(jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2)), DIMS)


def test_fp8_asked_of_a_convolution_is_a_clear_error():
    with pytest.raises(ValueError, match="'fp8' is for 'dot_general' only.*convolutions"):
        jaxamp.autocast(lambda x: x, "mixed_fp8", rules={"conv_general_dilated": "fp8"})


# --------------------------------------------------------------------------------------------
# Delayed scaling in the train step
# --------------------------------------------------------------------------------------------

class MLP(nnx.Module):
    def __init__(self, recipe, rngs):
        self.l1 = fp8.Linear(8, 32, recipe=recipe, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, dot_general=fp8.DotGeneral(recipe), rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def setup(policy="mixed_bfloat16", loss_scale=None, history=4, seed=0, **recipe):
    recipe = fp8.DelayedScaling(history_length=history, **recipe)
    graphdef, params, meta = nnx.split(MLP(recipe, nnx.Rngs(seed)), nnx.Param, fp8.Fp8Meta)

    def loss_fn(params, batch, model_state):
        model = nnx.merge(graphdef, params, model_state)
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, nnx.state(model, fp8.Fp8Meta)
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy, loss_scale=loss_scale)
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=meta)
    return state, loss_fn


def batch_of(seed=1, n=32, boost=None):
    x = np.array(jax.random.normal(jax.random.key(seed), (n, 8)))
    if boost is not None:  # one micro-batch (rows in ``boost``) with larger inputs
        x[boost] *= 3.0
    return {"x": jnp.asarray(x), "y": jnp.asarray(np.sin(x.sum(-1, keepdims=True)))}


def states_of(state):
    return fp8.Fp8State.find_all(jax.device_get(state.model_state))


def test_the_history_rolls_over_five_steps_and_the_scale_follows_it():
    state, loss_fn = setup(history=3)
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))
    histories, inputs = [], []
    for i in range(5):
        batch = batch_of(seed=i)
        inputs.append(np.abs(np.asarray(batch["x"].astype(jnp.bfloat16), np.float32)).max())
        kernel = np.abs(np.asarray(state.params["l1"]["kernel"], np.float32)).max()
        state, m = step(state, batch)
        assert bool(m["grads_finite"])
        first = states_of(state)[0]
        # Row 0 is the first layer's input: the batch's amax; row 1 its kernel's.
        assert float(first.amax_history[0, 0]) == inputs[-1]
        assert float(first.amax_history[1, 0]) == kernel
        histories.append(np.asarray(first.amax_history))
        if i:  # the older entries moved one column right; the oldest fell off
            np.testing.assert_array_equal(histories[i][:, 1:], histories[i - 1][:, :-1])
        want = [float(_fp8.compute_scale(first.amax_history[r].max(), d))
                for r, d in enumerate((E4M3, E4M3, E5M2))]
        assert first.scale.tolist() == want
    assert histories[-1][0].tolist() == [inputs[4], inputs[3], inputs[2]]


def test_most_recent_algo_and_margin():
    state, loss_fn = setup(history=3, amax_algo="most_recent", margin=1)
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))
    for i in range(3):
        state, _ = step(state, batch_of(seed=i))
    s = states_of(state)[0]
    want = [float(_fp8.compute_scale(s.amax_history[r, 0], d, margin=1))
            for r, d in enumerate((E4M3, E4M3, E5M2))]
    assert s.scale.tolist() == want


def test_accumulation_takes_the_max_over_micro_batches_never_the_last_or_the_sum():
    batch = batch_of(n=32, boost=slice(8, 16))  # micro-batch 1 of 4 has the largest inputs
    state, loss_fn = setup()
    accum = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True, accum_steps=4))
    single = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))
    merged, _ = accum(state, batch)
    seen = []
    for k in range(4):
        micro = jax.tree.map(lambda x, k=k: x[8 * k:8 * (k + 1)], batch)
        alone, _ = single(state, micro)
        seen.append([np.asarray(s.amax_history[:, 0]) for s in states_of(alone)])
    for i, s in enumerate(states_of(merged)):
        rows = np.stack([seen[k][i] for k in range(4)])
        np.testing.assert_array_equal(s.amax_history[:, 0], rows.max(0))
        assert not np.array_equal(rows.max(0), rows[-1])  # the last one would be wrong
        assert not np.array_equal(rows.max(0), rows.sum(0))


def test_pmap_and_sharded_jit_take_the_max_over_devices_and_agree():
    n = jax.device_count()
    batch = batch_of(n=4 * n, boost=slice(4, 8))
    state, loss_fn = setup()
    flags = dict(has_model_state=True)
    pstep = jax.pmap(jaxamp.make_train_step(loss_fn, axis_name="batch", **flags),
                     axis_name="batch")
    pstate = jaxamp.parallel.replicate(state)
    mesh = jax.make_mesh((n,), ("batch",))
    jstep = jax.jit(jaxamp.make_train_step(loss_fn, **flags))
    jstate = jax.device_put(jax.tree.map(jnp.copy, state), NamedSharding(mesh, P()))
    single = jax.jit(jaxamp.make_train_step(loss_fn, **flags))
    per_device = [states_of(single(state, jax.tree.map(lambda x, d=d: x[4 * d:4 * d + 4],
                                                       batch))[0]) for d in range(n)]
    for _ in range(3):
        pstate, _ = pstep(pstate, jaxamp.parallel.shard_batch(batch))
        jstate, _ = jstep(jstate, jaxamp.parallel.put_sharded(
            batch, jaxamp.parallel.batch_sharding(mesh)))
        if _ == 0:  # each device's amax is its shard's, as one device would see it alone
            for i, s in enumerate(states_of(jstate)):
                rows = np.stack([np.asarray(p[i].amax_history[:, 0]) for p in per_device])
                np.testing.assert_array_equal(s.amax_history[:, 0], rows.max(0))
                assert not np.array_equal(rows.max(0), rows[0])
    assert_tree_bitwise_equal(jax.device_get(jaxamp.parallel.unreplicate(pstate).model_state),
                              jax.device_get(jstate.model_state))
    assert_tree_bitwise_equal(jax.device_get(jaxamp.parallel.unreplicate(pstate).params),
                              jax.device_get(jstate.params))


def test_a_skipped_step_leaves_the_metadata_bit_identical():
    state, loss_fn = setup(policy="mixed_float16")
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))
    state, m = step(state, batch_of())  # 2**16 overflows fp16: skipped
    state, m = step(state, batch_of())  # skipped again at 2**15
    while not bool(m["grads_finite"]):
        state, m = step(state, batch_of())
    state, m = step(state, batch_of(seed=2))
    assert bool(m["grads_finite"]) and states_of(state)[0].amax_history[0, 1] > 0
    before = jax.device_get(state.model_state)
    poisoned = batch_of(seed=3)
    poisoned["y"] = poisoned["y"].at[0].set(jnp.inf)
    after, m = step(state, poisoned)
    assert not bool(m["grads_finite"])
    assert_tree_bitwise_equal(before, jax.device_get(after.model_state))


def _run(loss_scale, steps=5, policy="mixed_bfloat16"):
    state, loss_fn = setup(policy=policy, loss_scale=loss_scale)
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))
    for i in range(steps):
        state, m = step(state, batch_of(seed=i))
        assert bool(m["grads_finite"])
    return jax.device_get(state)


def test_the_loss_scale_leaves_the_fp8_metadata_and_the_training_unchanged():
    plain = _run(jaxamp.StaticLossScale(1.0))
    scaled = _run(jaxamp.StaticLossScale(2.0 ** 12))
    assert_tree_bitwise_equal(plain.model_state, scaled.model_state)
    assert_tree_bitwise_equal(plain.params, scaled.params)
    assert float(states_of(plain)[0].amax_history[2, 0]) > 0


def test_the_keras_21706_mistake_is_caught(monkeypatch):
    """Dividing the FP8 metadata by the loss scale, as keras#21706's loss-scale optimizer did
    (it unscaled every 'gradient', the metadata's too), breaks the invariance above."""
    def unscale_everything(cotangent, loss_scale):
        return cotangent.scale / jnp.asarray(loss_scale, F32)
    monkeypatch.setattr(_fp8, "seen_amax", unscale_everything)  # where the step reads it
    plain = _run(jaxamp.StaticLossScale(1.0))
    scaled = _run(jaxamp.StaticLossScale(2.0 ** 12))
    with pytest.raises(AssertionError):
        assert_tree_bitwise_equal(plain.model_state, scaled.model_state)


def test_dynamic_fp16_loss_scaling_with_delayed_fp8_trains():
    state, loss_fn = setup(policy="mixed_float16")
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))
    first = None
    for i in range(40):
        state, m = step(state, batch_of(seed=i % 4))
        first = float(m["loss"]) if first is None else first
    assert float(m["loss"]) < 0.5 * first
    # The gradient row is in unscaled units whatever the loss scale (2**16 .. 2**14 here).
    assert float(states_of(state)[1].amax_history[2, 0]) < 1.0


def test_a_matmul_that_did_not_run_keeps_its_metadata():
    recipe = fp8.DelayedScaling(history_length=2)
    state = fp8.Fp8State(jnp.array([[1.0, 2.0]] * 3, F32), jnp.array([4.0, 5.0, 6.0], F32),
                         recipe)
    assert_tree_bitwise_equal(state.update(jnp.zeros(3)), state)


def test_checkpoint_restore_then_training_equals_an_uninterrupted_run(tmp_path):
    state, loss_fn = setup()
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))
    straight = state
    for i in range(6):
        straight, _ = step(straight, batch_of(seed=i))
    mid = state
    for i in range(3):
        mid, _ = step(mid, batch_of(seed=i))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.fspath(tmp_path / "mid"), mid)
    with ocp.StandardCheckpointer() as ckpt:
        resumed = ckpt.restore(os.fspath(tmp_path / "mid"), state)
    assert_tree_bitwise_equal(jax.device_get(mid.model_state), resumed.model_state)
    for i in range(3, 6):
        resumed, _ = step(resumed, batch_of(seed=i))
    assert_tree_bitwise_equal(jax.device_get(straight), jax.device_get(resumed))


def test_metadata_outside_the_model_state_is_a_clear_error():
    recipe = fp8.DelayedScaling(history_length=2)
    model = MLP(recipe, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        out = nnx.merge(graphdef, params, rest)(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    with pytest.raises(ValueError, match="Fp8State is not in the train state's model state"):
        jaxamp.make_train_step(loss_fn)(state, batch_of())


def test_nnx_einsum_and_einsum_op_record_their_own_metadata():
    recipe = fp8.DelayedScaling(history_length=2)
    layer = fp8.Einsum("bd,dhk->bhk", (8, 2, 4), recipe=recipe, rngs=nnx.Rngs(0))
    op = fp8.EinsumOp(recipe)
    x = jax.random.normal(jax.random.key(0), (3, 8))
    graphdef, params, meta = nnx.split((layer, op), nnx.Param, fp8.Fp8Meta)

    def loss(params, meta):
        layer, op = nnx.merge(graphdef, params, meta)
        y = layer(x)
        return jnp.sum(op("bhk,bhk->bh", y, y))
    _, seen = jax.grad(loss, argnums=(0, 1))(params, meta)
    amaxes = [s.scale for s in fp8.Fp8State.find_all(seen)]
    assert len(amaxes) == 2 and all(float(a.min()) > 0 for a in amaxes)
    assert float(amaxes[0][0]) == float(jnp.abs(x).max())


# --------------------------------------------------------------------------------------------
# Fine-grained scales: the block quantizer against a loop over blocks, bit for bit, and each
# granularity's matmul and gradients against the operands dequantized by that loop
# --------------------------------------------------------------------------------------------

def ref_power_of_two(scale):
    mantissa, exponent = np.frexp(np.float32(scale))
    return np.float32(np.ldexp(np.float32(1.0), exponent - 1))


def ref_quantize_blocks(x, dtype, block_shape, power_of_two=False, margin=0):
    """One block at a time: its amax, its scale, its 8-bit values."""
    x = np.asarray(x, np.float32)
    blocks = [max(n, 1) if b is None else min(b, max(n, 1))
              for n, b in zip(x.shape, block_shape, strict=True)]
    counts = [-(-n // b) for n, b in zip(x.shape, blocks, strict=True)]
    q = np.zeros(x.shape, REFERENCE[jnp.dtype(dtype)])
    scales = np.zeros(counts, np.float32)
    for index in np.ndindex(*counts):
        where = tuple(slice(i * b, (i + 1) * b) for i, b in zip(index, blocks, strict=True))
        block = x[where]
        scale = ref_scale(np.abs(block).max(), dtype, margin)
        scale = ref_power_of_two(scale) if power_of_two else scale
        scales[index] = scale
        q[where] = ref_quantize(block, dtype, scale)
    return q, scales


def ref_dequantize_blocks(q, scales, block_shape):
    out = np.asarray(q).astype(np.float64)
    blocks = [max(n, 1) if b is None else min(b, max(n, 1))
              for n, b in zip(out.shape, block_shape, strict=True)]
    for index in np.ndindex(*scales.shape):
        where = tuple(slice(i * b, (i + 1) * b) for i, b in zip(index, blocks, strict=True))
        out[where] /= np.float64(scales[index])
    return out


def _rows_of_every_magnitude(shape, seed=0):
    """Normal values whose magnitude spans 10**-6 .. 10**6 across the first axis: each row's
    scale differs from the tensor's."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    return (x * np.logspace(-6, 6, shape[0], dtype=np.float32).reshape(
        (-1,) + (1,) * (len(shape) - 1))).astype(np.float32)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("shape,block_shape", [
    ((7, 300), (1, 128)),        # 1 x 128 tiles, the last one a third full
    ((260, 130), (128, 128)),    # 128 x 128 weight blocks, both axes uneven
    ((9, 70), (1, 32)),          # MXFP8's 1 x 32
    ((5, 3, 40), (1, None, 16)),  # a whole axis in each block
    ((6, 11), (None, None)),     # one scale: per-tensor
    ((4, 0), (1, 32)),           # an empty axis
], ids=["tiles", "weight-blocks", "mx", "whole-axis", "tensor", "empty"])
def test_block_quantizer_matches_a_loop_over_blocks_bit_for_bit(dtype, power_of_two, shape,
                                                                 block_shape):
    x = _rows_of_every_magnitude(shape)
    q, scales = jax.jit(_fp8.quantize_blocks, static_argnums=(1, 2),
                        static_argnames="power_of_two")(x, dtype, block_shape,
                                                        power_of_two=power_of_two)
    ref_q, ref_s = ref_quantize_blocks(x, dtype, block_shape, power_of_two)
    assert q.dtype == jnp.dtype(dtype) and q.shape == x.shape
    np.testing.assert_array_equal(bits(q), ref_q.view(np.uint8))
    np.testing.assert_array_equal(bits(scales), bits(ref_s))
    np.testing.assert_array_equal(_fp8.dequantize_blocks(q, scales, block_shape),
                                  ref_dequantize_blocks(ref_q, ref_s, block_shape).astype(
                                      np.float32))
    if power_of_two and scales.size:
        mantissa, _ = np.frexp(np.asarray(scales))
        assert (mantissa == 0.5).all()
    if x.size:  # never past the format's max: every block's amax lands at or under it
        assert np.abs(np.asarray(q, np.float32)).max() <= _fp8.fp8_max(dtype)


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
def test_blocks_of_fp8_values_times_a_power_of_two_round_trip_exactly(power_of_two):
    # Each 1 x 32 tile: e4m3 values with one +-448, times its own power of two.
    rng = np.random.default_rng(3)
    values = rng.normal(size=(6, 96)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values[:, ::32] = 448.0 * np.sign(rng.normal(size=(6, 3)))
    x = values * np.exp2(rng.integers(-30, 30, size=(6, 3))).repeat(32, axis=1)
    x = x.astype(np.float32)
    q, s = _fp8.quantize_blocks(x, E4M3, (1, 32), power_of_two=power_of_two)
    np.testing.assert_array_equal(_fp8.dequantize_blocks(q, s, (1, 32)), x)


def test_zero_and_non_finite_blocks_are_scaled_by_one_and_leave_the_others_alone():
    x = _rows_of_every_magnitude((4, 64), seed=5)
    x[0, :32] = 0.0
    x[1, 40] = np.inf
    x[2, 3] = np.nan
    q, s = _fp8.quantize_blocks(x, E4M3, (1, 32))
    assert s[0, 0] == 1.0 and not np.asarray(q[0, :32], np.float32).any()
    assert s[1, 1] == 1.0 and float(q[1, 40].astype(F32)) == 448.0  # saturated
    assert s[2, 0] == 1.0 and np.isnan(np.asarray(q[2, 3], np.float32))
    clean = x.copy()
    clean[0, :32], clean[1, 32:], clean[2, :32] = 1.0, 1.0, 1.0
    _, clean_s = _fp8.quantize_blocks(clean, E4M3, (1, 32))
    untouched = np.ones((4, 2), bool)
    untouched[0, 0] = untouched[1, 1] = untouched[2, 0] = False
    np.testing.assert_array_equal(np.asarray(s)[untouched], np.asarray(clean_s)[untouched])


def test_bad_block_shapes_are_clear_errors():
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="one entry per axis"):
        _fp8.quantize_blocks(x, E4M3, (32,))
    with pytest.raises(ValueError, match="ints >= 1 or None"):
        _fp8.block_scales(x, E4M3, (1, 0))
    q, s = _fp8.quantize_blocks(x, E4M3, (1, 4))
    with pytest.raises(ValueError, match="do not match blocks"):
        _fp8.dequantize_blocks(q, s, (1, 8))


def test_power_of_two_rounding_is_exact_at_and_between_powers():
    powers = np.exp2(np.arange(-126, 128)).astype(np.float32)
    np.testing.assert_array_equal(_fp8.round_to_power_of_two(powers), powers)
    np.testing.assert_array_equal(_fp8.round_to_power_of_two(powers[:-1] * 1.9999999), powers[:-1])
    np.testing.assert_array_equal(_fp8.round_to_power_of_two(np.nextafter(
        powers[1:], np.float32(0))), powers[:-1])


def _jitted_vjp(recipe):
    """``(a, b, cotangent) -> (out, da, db)`` of ``a @ b`` in FP8 with ``recipe``, jitted."""
    def forward_and_back(a, b, cotangent):
        out, vjp = jax.vjp(functools.partial(fp8.fp8_dot_general, dimension_numbers=DIMS,
                                             recipe=recipe), a, b)
        return (out, *vjp(cotangent))
    return jax.jit(forward_and_back)


GRANULARITY_RECIPES = {
    "tensor-hp-wgrad": fp8.CurrentScaling(weight_grad="high"),
    "rowwise": fp8.CurrentScaling(granularity="rowwise"),
    "rowwise-hybrid": fp8.CurrentScaling(granularity="rowwise", format="hybrid"),
    "rowwise-hp-wgrad": fp8.CurrentScaling(granularity="rowwise", weight_grad="high"),
    "rowwise-pow2": fp8.CurrentScaling(granularity="rowwise", power_of_two=True),
    "blocks": fp8.CurrentScaling(granularity="blocks"),
    "blocks-16": fp8.CurrentScaling(granularity="blocks", block_size=16),
    "mxfp8": fp8.CurrentScaling(granularity="mxfp8"),
}


def ref_gemm_operand(x, contract, batch, recipe, weight, dtype):
    """An operand as one GEMM of the recipe sees it: the block shape the recipe gives it (the
    contract of CurrentScaling.granularity), quantized and dequantized by the loop."""
    ndim = np.ndim(x)
    free = [a for a in range(ndim) if a not in contract and a not in batch]
    if recipe.granularity == "tensor":
        block = [None] * ndim
    elif recipe.granularity == "rowwise":
        block = [None if a in contract else 1 for a in range(ndim)]
    else:
        block = [1] * ndim
        block[max(contract)] = recipe.block_size
        if weight and recipe.granularity == "blocks":
            block[max(free)] = recipe.block_size
    q, s = ref_quantize_blocks(x, dtype, block, recipe.power_of_two, recipe.margin)
    return ref_dequantize_blocks(q, s, block)


@pytest.mark.parametrize("name", list(GRANULARITY_RECIPES))
def test_each_granularity_matmul_and_gradients_match_the_dequantized_reference(name):
    recipe = GRANULARITY_RECIPES[name]
    fwd_dtype, bwd_dtype = recipe.dtypes
    # Rows and columns of every magnitude: a shared scale would flush the small ones.
    x = _rows_of_every_magnitude((40, 300), seed=1)
    w = _rows_of_every_magnitude((300, 140), seed=2).T.copy().T * 0.05
    g = _rows_of_every_magnitude((40, 140), seed=3)
    out, dx, dw = _jitted_vjp(recipe)(x, w, g)
    ref_out = (ref_gemm_operand(x, [1], [], recipe, False, fwd_dtype)
               @ ref_gemm_operand(w, [0], [], recipe, True, fwd_dtype))
    # dx = g . w^T: g's contraction is its columns; w, the weight, is contracted on its own.
    ref_dx = (ref_gemm_operand(g, [1], [], recipe, False, bwd_dtype)
              @ ref_gemm_operand(w, [1], [], recipe, True, fwd_dtype).T)
    if recipe.weight_grad == "high":
        ref_dw = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
    else:  # dw = x^T . g, both contracted over the tokens
        ref_dw = (ref_gemm_operand(x, [0], [], recipe, False, fwd_dtype).T
                  @ ref_gemm_operand(g, [0], [], recipe, False, bwd_dtype))
    for got, ref in ((out, ref_out), (dx, ref_dx), (dw, ref_dw)):
        # The same 8-bit values and scales, summed in fp32 instead of float64.
        scale = np.abs(ref).max(axis=-1, keepdims=True)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert (np.abs(got - ref) <= 1e-5 * scale).all()  # every row, the small ones too


# `make test`: each contraction and each granularity once; `make test-all`: the product.
@pytest.mark.parametrize(("spec", "granularity"), covering_grid(
    ["bhlm,bmhd->blhd", "ij,kj->ik", "btd,dhk->bthk"], ["rowwise", "blocks", "mxfp8"]))
def test_fine_scales_of_batched_and_transposed_contractions_match_the_reference(granularity,
                                                                                spec):
    # Batch axes and a transposed operand; a contraction-last rhs; one lhs axis to two.
    a_shape, b_shape = {"bhlm,bmhd->blhd": ((2, 3, 5, 36), (2, 36, 3, 4)),
                        "ij,kj->ik": ((5, 70), (3, 70)),
                        "btd,dhk->bthk": ((2, 3, 40), (40, 2, 3))}[spec]
    recipe = fp8.CurrentScaling(granularity=granularity, block_size=16 if granularity ==
                                "blocks" else None)
    a, b = _data([a_shape, b_shape], seed=5, scales=[1.0, 1e-3])
    out = jnp.einsum(spec, a, b, _dot_general=functools.partial(fp8.fp8_dot_general,
                                                               recipe=recipe))

    def reference_dot(x, y, dims, *args, **kwargs):  # the operands as einsum hands them over
        (x_contract, y_contract), (x_batch, y_batch) = dims
        xr = ref_gemm_operand(np.asarray(x), list(x_contract), list(x_batch), recipe, False,
                              E4M3)
        yr = ref_gemm_operand(np.asarray(y), list(y_contract), list(y_batch), recipe, True,
                              E4M3)
        return jax.lax.dot_general(jnp.asarray(xr, F32), jnp.asarray(yr, F32), dims,
                                   precision=jax.lax.Precision.HIGHEST)
    with jax.disable_jit():  # concrete operands for the numpy loop
        ref = jnp.einsum(spec, a, b, _dot_general=reference_dot)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * float(jnp.abs(ref).max()))
    grads = jax.grad(lambda x, y: jnp.einsum(spec, x, y, _dot_general=functools.partial(
        fp8.fp8_dot_general, recipe=recipe)).sum(), argnums=(0, 1))(a, b)
    exact = jax.grad(lambda x, y: jnp.einsum(spec, x, y).sum(), argnums=(0, 1))(a, b)
    for got, want in zip(grads, exact, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert float(jnp.abs(got - want).max()) < 0.1 * float(jnp.abs(want).max())


def test_rowwise_scales_keep_the_small_rows_that_one_scale_per_tensor_flushes():
    # A token 10**6 times larger than the others: its scale, shared, sends theirs to zero.
    x = _data([(16, 64)], seed=7)[0].at[0].multiply(1e6)
    w = _data([(64, 32)], seed=8)[0]
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    errors = {}
    for name, recipe in [("tensor", fp8.CurrentScaling()),
                         ("rowwise", fp8.CurrentScaling(granularity="rowwise")),
                         ("blocks", fp8.CurrentScaling(granularity="blocks")),
                         ("mxfp8", fp8.CurrentScaling(granularity="mxfp8"))]:
        out = np.asarray(jax.jit(functools.partial(fp8.fp8_dot_general, dimension_numbers=DIMS,
                                                   recipe=recipe))(x, w), np.float64)
        errors[name] = np.abs(out[1:] - exact[1:]).max() / np.abs(exact[1:]).max()
    assert errors["tensor"] > 0.9  # the small rows are gone
    for name in ("rowwise", "blocks", "mxfp8"):
        assert errors[name] < 0.1, errors


def test_fine_scales_never_hide_a_non_finite_value_and_keep_dtypes():
    x, w = (t.astype(jnp.bfloat16) for t in _data([(4, 64), (64, 8)]))
    for granularity in ("rowwise", "blocks", "mxfp8"):
        recipe = fp8.CurrentScaling(granularity=granularity)

        forward_and_back = _jitted_vjp(recipe)
        g = jnp.ones((4, 8), jnp.bfloat16)
        assert np.isnan(forward_and_back(x.at[0, 0].set(jnp.inf), w, g)[0].astype(F32)).all()
        out, dx, dw = forward_and_back(x, w, g.at[1, 1].set(jnp.nan))
        assert out.dtype == jnp.bfloat16
        assert dx.dtype == dw.dtype == jnp.bfloat16
        assert np.isnan(dx.astype(F32)).all() and np.isnan(dw.astype(F32)).all()


def test_power_of_two_scales_apply_to_per_tensor_and_delayed_scaling():
    x, w = _data([(8, 16), (16, 4)], seed=2, scales=[3.0, 0.3])
    recipe = fp8.CurrentScaling(power_of_two=True)
    out = fp8.fp8_dot_general(x, w, DIMS, recipe=recipe)
    sx = ref_power_of_two(ref_scale(np.abs(x).max(), E4M3))
    sw = ref_power_of_two(ref_scale(np.abs(w).max(), E4M3))
    ref = (ref_quantize(x, E4M3, sx).astype(np.float64) / sx) @ (
        ref_quantize(w, E4M3, sw).astype(np.float64) / sw)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    state = fp8.Fp8State.create(fp8.DelayedScaling(history_length=2, power_of_two=True))
    state = state.update(jnp.array([3.0, 0.3, 1e-4], F32))
    assert state.scale.tolist() == [128.0, 1024.0, 2.0 ** 29]


def test_granularity_recipes_resolve_their_defaults_and_reject_bad_ones():
    assert fp8.DelayedScaling().history_length == 16
    r = fp8.CurrentScaling(granularity="blocks")
    assert (r.format, r.block_size, r.power_of_two) == ("e4m3", 128, False)
    assert fp8.CurrentScaling().format == "hybrid"
    assert fp8.CurrentScaling(granularity="rowwise", format="hybrid").dtypes[1] == E5M2
    assert fp8.CurrentScaling(granularity="mxfp8") == fp8.CurrentScaling(
        granularity="mxfp8", format="e4m3", block_size=32, power_of_two=True)
    for kwargs, message in [({"granularity": "columns"}, "unknown FP8 granularity"),
                            ({"granularity": "rowwise", "block_size": 32}, "block_size is for"),
                            ({"granularity": "blocks", "block_size": 0}, "block_size must be"),
                            ({"granularity": "mxfp8", "power_of_two": False}, "E8M0"),
                            ({"weight_grad": "bf16"}, "unknown weight_grad"),
                            ({"power_of_two": 1}, "power_of_two must be"),
                            ({"keep": "("}, "not a valid regex"),
                            ({"keep": 3}, "a regex string"),
                            ({"batched": "yes"}, "batched must be")]:
        with pytest.raises(ValueError, match=message):
            fp8.CurrentScaling(**kwargs)
    with pytest.raises(TypeError, match="CurrentScaling recipe"):
        jaxamp.Policy(fp8=fp8.DelayedScaling())


def test_autocast_runs_a_policys_fp8_recipe():
    from train.models import nnx_gpt
    loss_fn, params = nnx_gpt.loss_and_params(width=32, depth=1, heads=2, max_len=16)
    batch = {"tokens": jax.random.randint(jax.random.key(0), (2, 17), 0, 256)}
    rowwise = fp8.CurrentScaling(granularity="rowwise")
    policy = jaxamp.Policy(F32, jnp.bfloat16, F32, fp8=rowwise)
    assert str(policy) == "p=f32,c=bf16,o=f32,matmul=fp8(rowwise)"
    calls = []
    real = fp8.fp8_dot_general

    def spy(*args, recipe, **kwargs):
        calls.append(recipe)
        return real(*args, recipe=recipe, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jaxamp._autocast._rules.fp8_dot_general", spy)
        loss, grads = jax.jit(jax.value_and_grad(jaxamp.autocast(loss_fn, policy)))(params,
                                                                                    batch)
    assert calls and all(r == rowwise for r in calls)
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    # Rowwise runs FP8 GEMMs: the audit counts them, all but the head's and attention's.
    report = jaxamp.audit_grad(jaxamp.autocast(loss_fn, policy), params, batch)
    assert 0.5 < report.fp8_matmul_share < 0.6


# --------------------------------------------------------------------------------------------
# The error report: which FP8 matmul loses what
# --------------------------------------------------------------------------------------------

EVERY_MATMUL = fp8.CurrentScaling(keep="", batched=True)


def _fp8_policy(recipe=EVERY_MATMUL):
    return jaxamp.Policy(F32, jnp.bfloat16, F32, fp8=recipe)


def _two_layers(p, x):
    return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["head"]["kernel"])


def test_the_error_report_is_zero_where_fp8_is_exact_and_names_each_matmul_by_its_argument():
    # 3.5 and 7.0 (scales 128 and 64) and a gradient of ones (scale 57344) are exact in FP8;
    # tanh(98) is 1.0 exactly, and so is every product after it.
    p = {"w1": jnp.full((4, 8), 7.0), "head": {"kernel": jnp.full((8, 2), 0.5)}}
    report = fp8.error_report(_two_layers, p, jnp.full((2, 4), 3.5), policy=_fp8_policy())
    assert [(m.site, m.shapes, m.calls) for m in report.matmuls] == [
        ("args[0]/w1", "(2, 4) x (4, 8)", 1), ("args[0]/head/kernel", "(2, 8) x (8, 2)", 1)]
    assert all((m.forward, m.grad_lhs, m.grad_rhs) == (0.0, 0.0, 0.0) for m in report.matmuls)
    assert "0.00%     0.00%     0.00%  args[0]/head/kernel [(2, 8) x (8, 2)]" in str(report)


def test_the_error_report_finds_the_outlier_that_per_tensor_scales_lose_and_rows_keep():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    p = {"w1": jax.random.normal(k1, (64, 64)) / 8,
         "head": {"kernel": jax.random.normal(k2, (64, 64)) / 8}}
    x = jax.random.normal(k3, (32, 64)).at[0].mul(2.0**16)  # one token 65536 times the others
    tensor = fp8.error_report(_two_layers, p, x, policy=_fp8_policy())
    rows = fp8.error_report(_two_layers, p, x, policy=_fp8_policy(
        fp8.CurrentScaling(keep="", granularity="rowwise")))
    # Per tensor, the other 31 tokens fall below e4m3's range: the first matmul's outputs for
    # them are lost (the head's input, after tanh, has no outlier). One scale per row keeps them.
    assert tensor.worst(1)[0].site == "args[0]/w1" and tensor.matmuls[0].forward > 0.1
    assert tensor.matmuls[0].forward > 3 * rows.matmuls[0].forward
    assert tensor.matmuls[1].forward < 0.08, tensor
    # Where the rows are the tokens, what remains is FP8's own rounding. The weight gradient
    # contracts over the tokens: the outlier is in each of its rows, so rows help less there.
    assert all(0 < e < 0.05 for m in rows.matmuls for e in (m.forward, m.grad_lhs))
    assert rows.matmuls[0].grad_rhs < tensor.matmuls[0].grad_rhs / 2


def test_the_error_report_counts_a_scanned_layer_and_names_a_matmul_without_argument_by_line():
    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h @ h.T)  # two computed values: named by this line
    ws = jax.random.normal(jax.random.key(1), (3, 16, 16)) / 4
    report = fp8.error_report(loss, ws, jnp.ones((4, 16)), policy=_fp8_policy())
    scanned, gram = report.matmuls
    assert scanned.calls == 3 and scanned.shapes == "(4, 16) x (16, 16)"
    assert gram.calls == 1 and "test_fp8.py:" in gram.site and gram.site.endswith(".loss)")
    assert all(np.isfinite([m.forward, m.grad_lhs, m.grad_rhs]).all() for m in report.matmuls)


def test_the_error_report_leaves_out_what_the_recipe_keeps_and_needs_an_fp8_policy():
    p = {"w1": jnp.ones((4, 8)), "head": {"kernel": jnp.ones((8, 2))}}
    report = fp8.error_report(_two_layers, p, jnp.ones((2, 4)))  # mixed_fp8 keeps the head
    assert [m.site for m in report.matmuls] == ["args[0]/w1"]
    with pytest.raises(ValueError, match="error_report measures FP8 matmuls, and policy"):
        fp8.error_report(_two_layers, p, jnp.ones((2, 4)), policy="mixed_bfloat16")


def test_fp8_states_are_found_and_replaced_in_tree_order():
    tree = {"b": fp8.Fp8State.create(fp8.DelayedScaling(history_length=2)), "a": [1.0],
            "c": fp8.Fp8State.create(fp8.DelayedScaling(history_length=3))}
    found = fp8.Fp8State.find_all(tree)
    assert [s.amax_history.shape for s in found] == [(3, 2), (3, 3)]
    swapped = fp8.Fp8State.replace_all(tree, found[::-1])
    assert [s.amax_history.shape for s in fp8.Fp8State.find_all(swapped)] == [(3, 3), (3, 2)]
    assert swapped["a"] == [1.0]
    with pytest.raises(ValueError, match=r"holds 2 Fp8State\(s\) but 1 were given"):
        fp8.Fp8State.replace_all(tree, found[:1])
