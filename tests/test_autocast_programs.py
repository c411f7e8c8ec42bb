"""Autocast on the programs JAX users write: scatters with a combiner, custom derivative rules,
recurrences whose carry the rules compute in fp32, embeddings, side effects, offloading remat
policies and a batch the rules see as given. Each case is checked against the same program in
fp32 (gradients), not against what autocast happens to emit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxamp
from jaxamp import _jaxpr

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
POLICIES = {"bf16": jaxamp.get_policy("mixed_bfloat16"), "fp16": jaxamp.get_policy("mixed_float16")}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _grads(loss, policy, params, *args):
    """``(fp32 gradients, autocast's)`` of ``loss`` at the same params, autocast's given the
    params in the compute dtype as the train step hands them."""
    half = jax.tree.map(lambda x: x.astype(policy.compute_dtype), params)
    want = jax.grad(loss)(jax.tree.map(lambda x: x.astype(F32), half), *args)
    got = jax.jit(jax.grad(jaxamp.autocast(loss, policy)))(half, *args)
    return want, got


# --------------------------------------------------------------------------------------------
# Scatters and reductions with a combiner
# --------------------------------------------------------------------------------------------

X = jax.random.normal(jax.random.key(1), (6, 8))
SEGMENTS = jnp.array([0, 1, 1, 2, 0, 2])


def _segment(op):
    def loss(w):
        h = X @ w                                      # half under autocast
        return jnp.sum(jnp.tanh(op(h)))
    return loss


COMBINERS = {
    "segment_sum": lambda h: jax.ops.segment_sum(h, SEGMENTS, num_segments=3),
    "segment_max": lambda h: jax.ops.segment_max(h, SEGMENTS, num_segments=3),
    "at_add": lambda h: jnp.zeros((3, 8)).at[SEGMENTS].add(h),
    "at_max": lambda h: jnp.full((3, 8), -1e3).at[SEGMENTS].max(h),
    # JAX differentiates a scatter-mul only with unique indices.
    "at_mul": lambda h: jnp.ones((6, 8)).at[jnp.arange(6)[::-1]].mul(h, unique_indices=True),
    "at_min": lambda h: jnp.full((3, 8), 1e3).at[SEGMENTS].min(h),
    "bincount": lambda h: jnp.bincount(SEGMENTS, weights=h[:, 0], length=3),
    "reduce_body": lambda h: lax.reduce(h, 0.0, lambda a, b: a + b * b, (0,)),
}
# JAX differentiates no reduce_window with a custom body: the forward pass only.
FORWARD_ONLY = {
    "reduce_window_mul": lambda h: lax.reduce_window(h, 1.0, lax.mul, (2, 1), (1, 1), "VALID"),
    "reduce_window_body": lambda h: lax.reduce_window(h, -jnp.inf, lambda a, b: jnp.maximum(
        a, b * 0.5), (2, 1), (1, 1), "VALID"),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combiner", FORWARD_ONLY)
def test_reduce_windows_with_a_body_lower_and_match_fp32(combiner, policy):
    w = jax.random.normal(jax.random.key(2), (8, 8)) * 0.3
    half = w.astype(POLICIES[policy].compute_dtype)
    fn = _segment(FORWARD_ONLY[combiner])
    want = fn(half.astype(F32).astype(POLICIES[policy].compute_dtype).astype(F32))
    got = jax.jit(jaxamp.autocast(fn, POLICIES[policy]))(half)
    assert abs(float(got) - float(want)) < 8 * float(jnp.finfo(half.dtype).eps) * abs(float(want))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combiner", COMBINERS)
def test_scatters_and_reductions_with_a_combiner_lower_and_match_fp32(combiner, policy):
    """They crashed XLA's verifier (a bf16 operand against the combiner's fp32 region). Their
    combiner keeps the dtype it was traced with: fp32 for a model written in fp32."""
    w = jax.random.normal(jax.random.key(2), (8, 8)) * 0.3
    want, got = _grads(_segment(COMBINERS[combiner]), POLICIES[policy], w)
    eps = float(jnp.finfo(POLICIES[policy].compute_dtype).eps)
    assert _rel(got, want) < 8 * eps, combiner


def test_a_graph_network_trains_through_the_step_under_autocast():
    """One message-passing layer (gather the senders, ``segment_sum`` at the receivers) trained
    by ``make_train_step(autocast=True)``: it crashed at the first step."""
    senders, receivers = jnp.array([0, 1, 2, 3, 4, 5, 1]), jnp.array([1, 2, 3, 4, 5, 0, 0])

    def loss_fn(params, batch):
        messages = (batch["x"] @ params["w"])[senders]
        h = jax.ops.segment_sum(messages, receivers, num_segments=6)
        return jnp.mean((jax.nn.relu(h) @ params["out"] - batch["y"]) ** 2)
    params = {"w": jax.random.normal(jax.random.key(0), (8, 16)) * 0.3,
              "out": jax.random.normal(jax.random.key(1), (16, 1)) * 0.3}
    batch = {"x": X, "y": jnp.ones((6, 1))}
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]


# --------------------------------------------------------------------------------------------
# Custom derivative rules
# --------------------------------------------------------------------------------------------

@jax.custom_jvp
def _straight_through_round(x):
    return jnp.round(x)


@_straight_through_round.defjvp
def _straight_through_round_jvp(primals, tangents):
    return _straight_through_round(primals[0]), tangents[0]


@jax.custom_jvp
def _safe_norm(x):
    return jnp.sqrt(jnp.sum(x * x, axis=-1))


@_safe_norm.defjvp
def _safe_norm_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = _safe_norm(x)
    return y, jnp.sum(x * t, axis=-1) / jnp.maximum(y, 1e-6)


@jax.custom_jvp
def _stable_softplus(x):
    return jnp.logaddexp(x, 0.0)


@_stable_softplus.defjvp
def _stable_softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _stable_softplus(x), t * jax.nn.sigmoid(x)


CUSTOM_JVPS = {
    # A weight gradient through a straight-through estimator: 0 when the primal's round is
    # differentiated instead of the rule.
    "straight_through": lambda h: jnp.sum(_straight_through_round(h * 4.0) ** 2),
    # A norm of zero rows: the rule guards the division, the primal's sqrt gives nan.
    "safe_norm": lambda h: jnp.sum(_safe_norm(h * 0.0)),
    # The primal's log(1 + exp(x)) at x = 200 overflows in its derivative; the rule's sigmoid not.
    "stable_softplus": lambda h: jnp.sum(_stable_softplus(h + 200.0)),
    "relu": lambda h: jnp.sum(jax.nn.relu(h)),
    "relu_at_zero": lambda h: jnp.sum(jax.nn.relu(h * 0.0) * 3.0),
    "silu": lambda h: jnp.sum(jax.nn.silu(h)),
    "gelu": lambda h: jnp.sum(jax.nn.gelu(h)),
    "logsumexp": lambda h: jnp.sum(jax.nn.logsumexp(h, axis=-1)),
    "softmax": lambda h: jnp.sum(jax.nn.softmax(h, axis=-1) ** 2),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CUSTOM_JVPS)
def test_a_custom_jvp_is_differentiated_by_its_own_rule(case, policy):
    """The rule differentiates the function under autocast, as without it: its primal body
    and its rule are each evaluated under the rules. Before, the primal body was
    differentiated (the straight-through gradient was 0, the safe norm's nan)."""
    w = jax.random.normal(jax.random.key(3), (8, 8)) * 0.3
    fn = CUSTOM_JVPS[case]
    want, got = _grads(lambda w: fn(X @ w), POLICIES[policy], w)
    assert np.all(np.isfinite(np.asarray(got, np.float32))), case
    # A straight-through round of values computed in half lands on another integer now and
    # then: 0.03 in fp16 (0, the rule dropped, gave 1.0).
    assert _rel(got, want) < (0.1 if case == "straight_through" else 0.02), (case, _rel(got, want))


def test_an_overflowed_cotangent_at_a_dead_relu_is_discarded_in_fp16():
    """``jax.nn.relu``'s rule selects the cotangent where the input is positive: an inf
    cotangent at a dead unit is dropped, where the primal body's ``max`` multiplies it by 0
    (nan), and a NeRF's loss scale fell from 2^16 to 2^-9."""
    def loss(w, x):
        h = jax.nn.relu(x @ w)                       # every unit dead: x @ w < 0
        return jnp.sum(h * 3e4) + jnp.sum(w)         # a cotangent 3e4 x scale overflows fp16
    w, x = -jnp.ones((4, 4), F16), jnp.ones((2, 4))
    scaled = jax.grad(lambda w, x: jaxamp.autocast(loss, "mixed_float16")(w, x) * 2.0 ** 15)
    g = jax.jit(scaled)(w, x)
    assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_a_custom_vjp_is_differentiated_by_its_own_rule_in_fp32():
    """A ``custom_vjp`` runs, primal and rule, in the dtypes it was written for (fp32)."""
    @jax.custom_vjp
    def clip_gradient(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        return (jnp.clip(g, -0.1, 0.1),)
    clip_gradient.defvjp(fwd, bwd)
    w = jax.random.normal(jax.random.key(3), (8, 8))
    want, got = _grads(lambda w: jnp.sum(clip_gradient(X @ w) * 5.0), POLICIES["bf16"], w)
    assert _rel(got, want) < 0.02


# --------------------------------------------------------------------------------------------
# Recurrences: the carry the rules compute in fp32
# --------------------------------------------------------------------------------------------

def _linear_recurrence(params, xs):
    """A linear recurrent unit (real-valued): ``h = a * h + (1 - a) * (x @ w_in)``, decays near
    1 (``a = exp(-exp(nu_log))``), the carry started from a learned state (a param: in the
    compute dtype, as the train step hands it)."""
    a = jnp.exp(-jnp.exp(params["nu_log"]))
    u = xs @ params["w_in"]                                    # (T, B, D), half

    def step(h, u_t):
        h = a * h + (1.0 - a) * u_t
        return h, h
    _, hs = lax.scan(step, jnp.broadcast_to(params["h0"], u.shape[1:]), u)
    return jnp.mean((hs @ params["w_out"]) ** 2)


def test_a_recurrence_keeps_its_fp32_carry_and_matches_fp32():
    """The decays (fp32, from an fp32 region) were handed to the scan in bf16, where 0.999 is
    1.0, and the carry, started in bf16 (a param), was rounded to bf16 at each of 64 steps:
    0.017 to 0.027 off fp32's gradients, 0.002 to 0.003 now."""
    k = jax.random.split(jax.random.key(4), 4)
    params = {"nu_log": jnp.log(-jnp.log(jnp.linspace(0.9, 0.999, 16))),
              "w_in": jax.random.normal(k[0], (8, 16)) * 0.3,
              "w_out": jax.random.normal(k[1], (16, 4)) * 0.3,
              "h0": jax.random.normal(k[3], (16,))}
    xs = jax.random.normal(k[2], (64, 4, 8))
    want, got = _grads(_linear_recurrence, POLICIES["bf16"], params, xs)
    errors = {name: _rel(got[name], want[name]) for name in params}
    assert max(errors.values()) < 0.01, errors


# --------------------------------------------------------------------------------------------
# Embeddings: the lookup's gradient summed in fp32
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", ["indexing", "nnx.Embed"])
def test_an_embeddings_gradient_is_summed_in_fp32(layer):
    """A token that makes up 60% of the batch: its row's gradient was 0.12 off fp32's, summed
    by a bf16 scatter-add (0.008 on the other rows). Only a param's lookup is summed so: the
    loss's ``take_along_axis`` of the logits (one cotangent a place) keeps its half-precision
    transpose, which an fp32 one would double (0.54 GB of fp32 logits for the NNX GPT of the
    benchmarks on an H200)."""
    from flax import nnx
    vocab, dim = 16, 8
    k = jax.random.split(jax.random.key(0), 3)
    embed = nnx.Embed(vocab, dim, rngs=nnx.Rngs(0))
    graphdef, table = nnx.split(embed, nnx.Param)
    params = {"emb": table if layer == "nnx.Embed" else jax.random.normal(k[0], (vocab, dim)),
              "w": jax.random.normal(k[1], (dim, vocab)) * 0.3}
    tokens = jnp.where(jax.random.uniform(k[2], (512,)) < 0.6, 3,
                       jax.random.randint(k[2], (512,), 0, vocab))

    def loss(p, tokens):
        h = nnx.merge(graphdef, p["emb"])(tokens) if layer == "nnx.Embed" else p["emb"][tokens]
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w"],
                                                               (tokens * 7) % vocab).mean()
    want, got = _grads(loss, POLICIES["bf16"], params, tokens)
    row = (lambda g: g["emb"]["embedding"][3]) if layer == "nnx.Embed" else (
        lambda g: g["emb"][3])
    assert _rel(row(got), row(want)) < 0.02
    grad = jax.make_jaxpr(jax.grad(jaxamp.autocast(loss)))(
        jax.tree.map(lambda x: x.astype(BF16), params), tokens)
    scatters = [str(e.outvars[0].aval) for e, _ in _jaxpr.walk(grad.jaxpr)
                if e.primitive.name == "scatter-add"]
    assert f"float32[{vocab},{dim}]" in scatters, scatters


# --------------------------------------------------------------------------------------------
# Side effects, remat policies, the batch
# --------------------------------------------------------------------------------------------

def _mlp(w, x, effect=False):
    h = jnp.tanh(x @ w["a"])
    if effect:
        jax.debug.print("h[0, 0] = {}", h[0, 0])
    h = jax.nn.gelu(h @ w["b"], approximate=True)
    return jnp.sum(h @ w["c"])


def _saved(fn, *args):
    from jax.ad_checkpoint import print_saved_residuals  # noqa: F401 - public API
    residuals = jax.vjp(fn, *args)[1]
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals)
               if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))


def test_a_debug_print_does_not_change_what_is_recomputed(capfd):
    """``jax.debug.print`` turned autocast's recompute off for the whole function (0.096x to
    0.630x fp32's saved bytes). Where the backward pass recomputes the printed value, it
    prints again, as under a ``jax.checkpoint`` of JAX's own."""
    k = jax.random.split(jax.random.key(5), 4)
    w = {n: jax.random.normal(kk, (64, 64)).astype(BF16)
         for n, kk in zip("abc", k[:3], strict=True)}
    x = jax.random.normal(k[3], (32, 64))
    plain = jax.jit(lambda w: _saved(jaxamp.autocast(_mlp), w, x))(w)
    printing = jax.jit(lambda w: _saved(jaxamp.autocast(lambda w, x: _mlp(w, x, True)), w, x))(w)
    capfd.readouterr()
    jax.block_until_ready(jax.jit(jax.grad(jaxamp.autocast(lambda w, x: _mlp(w, x, True))))(w, x))
    assert int(printing) == int(plain)
    assert capfd.readouterr().out.count("h[0, 0] =") == 2


def _rope_layers(w, x, positions, names=True, read_by_exp=False):
    """MaxText's attention in small, a scan of remat'd layers: RoPE's table, of the batch's
    positions, cast to the query's dtype (fp32 in the trace autocast reads), the rotated query
    and key named for the layers' remat policy."""
    def layer(x, w):
        q, k = x @ w["q"], x @ w["k"]
        angle = positions[:, :, None] / 10.0 ** jnp.arange(8)
        cos = jnp.cos(jnp.tile(angle, 4)).astype(q.dtype)
        q, k = q * cos, k * cos
        if names:
            q, k = checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj")
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
        if read_by_exp:
            scores = scores + jnp.mean(jnp.exp(-(q ** 2)), axis=-1, keepdims=True)
        return x + jax.nn.softmax(scores) @ (x @ w["v"]), None
    policy = jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj")
    return jnp.sum(lax.scan(jax.checkpoint(layer, policy=policy), x, w)[0] ** 2)


def _residuals_by_dtype(fn, *args):
    """The bytes of the 4-d residuals (the layers' stacked ones), by dtype."""
    residuals = jax.vjp(fn, *args)[1]
    out: dict[str, int] = {}
    for x in jax.tree.leaves(residuals):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim == 4:
            out[str(x.dtype)] = out.get(str(x.dtype), 0) + x.size * x.dtype.itemsize
    return out


def test_a_value_fp32_only_in_the_trace_is_saved_in_the_compute_dtype():
    """MaxText's RoPE casts its table to the query's dtype: fp32 in the trace autocast reads,
    so the rotated query and key its remat policy names were saved in fp32 (1.6 GB of an H200
    step's 10 GB). Read only by matmuls, which round them to bf16, the name goes on the
    rounded value: the same gradients, the saved query and key in bf16. A named value that
    another op reads in fp32 is saved as it is."""
    k = jax.random.split(jax.random.key(11), 4)
    w = {n: (jax.random.normal(kk, (3, 32, 32)) / 6).astype(BF16)
         for n, kk in zip("qkv", k[:3], strict=True)}
    x = jax.random.normal(k[3], (2, 16, 32))
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    grad = jax.jit(jax.grad(jaxamp.autocast(_rope_layers)))
    unnamed = jax.jit(jax.grad(jaxamp.autocast(
        lambda w, x, p: _rope_layers(w, x, p, names=False))))
    for a, b in zip(jax.tree.leaves(grad(w, x, positions)),
                    jax.tree.leaves(unnamed(w, x, positions)), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=0)
    size = 3 * 2 * 16 * 32  # a layer input, query or key of the three layers
    saved = _residuals_by_dtype(jaxamp.autocast(_rope_layers), w, x, positions)
    assert saved == {"float32": size * 4, "bfloat16": 2 * size * 2}, saved  # x; q and k
    fp32_read = _residuals_by_dtype(
        jaxamp.autocast(lambda w, x, p: _rope_layers(w, x, p, read_by_exp=True)),
        w, x, positions)
    assert fp32_read == {"float32": 2 * size * 4, "bfloat16": size * 2}, fp32_read  # x, q; k


def test_the_batch_reaches_an_autocast_loss_as_given():
    """Fourier features ``sin(2^k x)`` of fp32 positions: the step cast the positions to bf16
    before autocast saw them (a first-step gradient 0.41 off fp32's); as PyTorch's autocast,
    the rules decide each op's dtype and the inputs stay as given."""
    k = jax.random.split(jax.random.key(6), 3)
    positions = jax.random.uniform(k[0], (256, 2), minval=-1.0, maxval=1.0)

    def loss_fn(params, batch):
        freqs = 2.0 ** jnp.arange(10)
        features = jnp.sin(batch["x"][..., None] * freqs * jnp.pi).reshape(256, -1)
        return jnp.mean((features @ params["w"] - batch["y"]) ** 2)
    params = {"w": jax.random.normal(k[1], (20, 1)) * 0.1}
    batch = {"x": positions, "y": jnp.sin(7.0 * positions[:, :1])}
    want = jax.grad(loss_fn)(params, batch)["w"]
    tx = jaxamp.mixed_precision(optax.sgd(1.0), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    new, _ = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))(state, batch)
    got = state.master_params["w"] - new.master_params["w"]      # sgd(1.0): the gradient
    assert _rel(got, want) < 0.05


OFFLOAD_POLICIES = {
    "names": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
        offload_src="device", offload_dst="pinned_host"),
    "dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def _offloaded_shapes(fn, *args) -> set[str]:
    """The shapes of the values the backward pass reads from host memory."""
    text = str(jax.make_jaxpr(jax.grad(fn))(*args))
    return set(re.findall(r"<host>(\[[\d,]*\])", text))


@pytest.mark.parametrize("scanned", [False, True], ids=["one block", "scan of blocks"])
@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
def test_a_models_offload_policy_is_honoured(policy, scanned):
    """A model's remat policy that offloads (MaxText's offload configurations) offloads the
    same values under autocast, in bf16: in a scan of remat'd blocks autocast recomputed each
    step under its own policy, and the stacked values went unoffloaded."""
    def block(w, x):
        h = checkpoint_name(jnp.tanh(x @ w), "h")
        return jnp.sin(h @ w)
    remat = jax.checkpoint(block, policy=OFFLOAD_POLICIES[policy])

    def loss(w, x):
        if not scanned:
            return jnp.sum(remat(w, x))
        return jnp.sum(lax.scan(lambda h, wi: (remat(wi, h), None), x, jnp.stack([w, w]))[0])
    w, x = jnp.ones((8, 8)) * 0.1, jnp.ones((4, 8))
    want = _offloaded_shapes(loss, w, x)
    assert want and _offloaded_shapes(jaxamp.autocast(loss), w, x) == want


REMAT_POLICIES = {
    "full": None,                                   # MaxText's remat_policy="full"
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "names": jax.checkpoint_policies.save_only_these_names("up"),
    "offload": OFFLOAD_POLICIES["names"],
    "everything": jax.checkpoint_policies.everything_saveable,
}


@pytest.mark.parametrize("layout", ["scan", "unrolled", "while"])
@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_autocast_runs_no_more_matmuls_than_the_models_own_remat(remat, layout):
    """Autocast's recompute composes with a model's remat: the forward and backward pass run
    the matmuls fp32 runs, under every remat policy. A scan's final carry, read by the loss
    after it, was recomputed by running the whole scan again (1.25x fp32's matmul FLOPs under
    MaxText's default remat)."""
    def block(w, x):
        h = checkpoint_name(x @ w["a"], "up")
        return x + jnp.tanh(jax.nn.gelu(checkpoint_name(h, "h")) @ w["b"])
    blocks = jax.checkpoint(block, policy=REMAT_POLICIES[remat])

    def loss(ws, x):
        if layout == "scan":
            x, _ = lax.scan(lambda h, w: (blocks(w, h), None), x, ws)
        elif layout == "while":
            x = lax.fori_loop(0, 3, lambda i, h: blocks(jax.tree.map(lambda a: a[i], ws), h), x)
        else:
            for i in range(3):
                x = blocks(jax.tree.map(lambda a, i=i: a[i], ws), x)
        return jnp.mean(jax.nn.log_softmax(x) ** 2)
    ws = {"a": jnp.ones((3, 32, 64)) * 0.01, "b": jnp.ones((3, 64, 32)) * 0.01}
    x = jnp.ones((8, 32))
    half = jax.tree.map(lambda a: a.astype(BF16), ws)
    want = jaxamp.audit_grad(loss, ws, x).total_matmul_flops
    got = jaxamp.audit_grad(jaxamp.autocast(loss), half, x)
    assert got.total_matmul_flops == want and got.share("bfloat16") == 1.0


def test_a_rule_autocast_cannot_keep_is_warned_about_and_listed_by_the_audit(monkeypatch):
    """On a JAX whose ``custom_jvp`` params hold no rule jaxamp can read, the primal body is
    differentiated: autocast warns, naming the function's line, and the audit lists it."""
    from jaxamp import _jaxpr
    monkeypatch.setattr(_jaxpr, "_jvp_rule", lambda eqn: None)
    w = jax.random.normal(jax.random.key(3), (8, 8))

    def loss(w):
        return jnp.sum(_straight_through_round(X @ w) ** 2)
    with pytest.warns(_jaxpr.RuleNotKeptWarning, match=r"custom_jvp rule of the function at "
                      r".*test_autocast_programs.py:\d+.*primal body is differentiated"):
        report = jaxamp.audit_grad(jaxamp.autocast(loss), w)
    assert len(report.rules_not_kept) == 1
    assert report.to_dict()["rules_not_kept"] == report.rules_not_kept
    monkeypatch.undo()
    assert jaxamp.audit_grad(jaxamp.autocast(loss), w).rules_not_kept == []


def test_a_function_that_types_only_with_its_half_arguments_is_traced_as_given():
    """Autocast traces a half argument as fp32; a function that meets it with a value of the
    argument's own half dtype (a reduction's init value, a convolution's preferred type)
    raised a TypeError at that trace. It is traced as given."""
    x = jax.random.normal(jax.random.key(7), (4, 6)).astype(F16)

    def reduce_max(x):
        return lax.reduce(x, np.float16(-np.inf), lax.max, (1,))
    np.testing.assert_array_equal(jaxamp.autocast(reduce_max, "mixed_bfloat16")(x).astype(F32),
                                  reduce_max(x).astype(F32))
    w = jax.random.normal(jax.random.key(8), (3, 2, 3, 3)).astype(F16)

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", preferred_element_type=F16)
    img = jax.random.normal(jax.random.key(9), (1, 2, 5, 5)).astype(F16)
    got = jaxamp.autocast(conv, "mixed_float16")(img, w)
    assert got.shape == (1, 3, 5, 5) and bool(jnp.all(jnp.isfinite(got)))
