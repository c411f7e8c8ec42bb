"""``jaxamp.memory.gpu_memory`` and ``python -m benchmarks gpu --deviceless``, compiled by XLA:GPU
for an H200 on this machine (no GPU). Run by ``make test-gpu-memory``, in .venv-gpu: jax's CUDA
plugin at the versions of the H200 run, ``JAX_PLATFORMS=cpu``.

The memory goals are checked here on the reference models and the user's GPT with their real
layer shapes and batches but fewer layers (2; 8 of BERT-Large's 24), which compile faster;
`make gpu-memory` compiles the full models (BENCHMARKS.md).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from benchmarks import gpu
from benchmarks import gpu_deviceless
from benchmarks.__main__ import main
from jaxamp._diagnoses import _memory

GB = 1e9


def nnx_eval_shape(build):
    from flax import nnx
    return nnx.eval_shape(build)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def test_parts_of_a_known_program():
    """A donated 4 MiB argument updated in place: 4 MiB in, 4 MiB out, all of it aliased."""
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w.astype(x.dtype)).astype(
            jnp.float32).sum())(w)
    report = jaxamp.memory.gpu_memory(step, w, x, target="h200", donate_argnums=0)
    assert report.target == "NVIDIA H200 141GB HBM3e" and report.devices == 1
    assert report.argument_bytes == 4 * 2**20 + 512 * 2**10
    assert report.argument_by_dtype == {"float32": 4 * 2**20, "bfloat16": 512 * 2**10}
    assert report.output_bytes == report.alias_bytes == 4 * 2**20
    assert report.total_bytes == report.argument_bytes + report.temp_bytes
    split = sum(n for _, _, n in report.temp_by_shape)
    assert 0 < split <= report.temp_bytes
    assert sum(report.temp_by_dtype.values()) == split
    assert "custom_call_target" in report.hlo or "__triton" in report.hlo  # the GPU's kernels
    assert "H200" in str(report) and "temporaries" in str(report)
    # XLA's schedule holds at most what the arena allocates.
    assert 0 < report.live_peak_bytes <= report.total_bytes


def _two_matmuls(w):
    return jnp.tanh(jnp.tanh(w @ w) @ w).sum() * w


def test_the_split_by_dtype_holds_whatever_xla_flags_filter(monkeypatch, tmp_path):
    """MaxText sets XLA_FLAGS with a dump filter of its own when its config loads: the report
    came back with no split by dtype and no peak, silently."""
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    want = jaxamp.memory.gpu_memory(_two_matmuls, w)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=nomatch")
    got = jaxamp.memory.gpu_memory(_two_matmuls, w)
    assert got.temp_by_dtype == want.temp_by_dtype and sum(got.temp_by_dtype.values()) > 0
    assert got.live_peak_bytes == want.live_peak_bytes is not None
    with pytest.raises(RuntimeError, match="no buffer assignment"):
        jaxamp.memory.gpu_memory(_two_matmuls, w,
                                 compiler_options={"xla_dump_hlo_module_re": "nomatch"})


def test_the_mesh_of_set_mesh_is_the_one_compiled_for():
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    mesh = jaxamp.memory.gpu_mesh("h200", 2)
    with jax.set_mesh(mesh):      # it named device 0 of another mesh beside the context's
        report = jaxamp.memory.gpu_memory(_two_matmuls, w)
    assert report.devices == 2
    with jax.set_mesh(jax.make_mesh((1,), ("batch",), devices=jax.devices("cpu")[:1])):
        with pytest.raises(ValueError, match="mesh of cpu devices"):
            jaxamp.memory.gpu_memory(_two_matmuls, w)


def test_h100_and_a_target_of_ones_own():
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    h100 = jaxamp.memory.gpu_memory(lambda x: (x @ x).sum(), x, target="h100")
    assert h100.target == "NVIDIA H100 80GB HBM3"
    own = jaxamp.memory.gpu_memory(lambda x: (x @ x).sum(), x,
                            target=_memory._target_text("h100")[1].replace(
                                "NVIDIA H100 80GB HBM3", "my GPU"))
    assert own.target == "my GPU" and own.argument_bytes == h100.argument_bytes


def _linen_encoder():
    from train.models.linen_encoder import variants
    _, loss, params, tokens = variants(vocab=512, width=256, depth=2, heads=4, mlp=1024,
                                       batch=8, seq_len=256)[0]  # the fp32 model
    return loss, params, tokens


def _equinox_mlp():
    import equinox as eqx
    model = eqx.nn.MLP(in_size=256, out_size=10, width_size=1024, depth=3,
                       key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, x):
        logits = jax.vmap(eqx.combine(p, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), jnp.zeros(x.shape[:1], jnp.int32)).mean()
    return loss, params, jnp.zeros((16384, 256), jnp.float32)


# The user's NNX GPT is the memory goals' (below).
@pytest.mark.parametrize("make", [_linen_encoder, _equinox_mlp], ids=["linen", "equinox"])
def test_a_users_model_under_autocast_keeps_half_precision_on_the_gpu(make):
    """The user's step, as they build it, asked on an H200: under autocast its temporaries are
    half precision, and the step needs less than its fp32 twin."""
    loss, params, batch = make()
    reports = {}
    for policy, autocast in (("float32", False), ("mixed_bfloat16", True)):
        tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
        state = jax.eval_shape(lambda p, tx=tx: jaxamp.TrainState.create(params=p, tx=tx),
                               params)
        step = jax.jit(jaxamp.make_train_step(loss, autocast=autocast), donate_argnums=0)
        reports[policy] = jaxamp.memory.gpu_memory(step, state, _abstract(batch), target="h200")
    fp32, mixed = reports["float32"], reports["mixed_bfloat16"]
    assert mixed.total_bytes < 0.8 * fp32.total_bytes, (str(fp32), str(mixed))
    assert set(fp32.temp_by_dtype) <= {"float32", "int32", "int8", "bool"}, str(fp32)
    assert mixed.temp_by_dtype["bfloat16"] > 0.25 * mixed.temp_bytes, str(mixed)
    # The bf16 working copy is 2 bytes a param; the fp32 state (params, mu, nu) 12.
    batch32 = sum(x.size * 4 for x in jax.tree.leaves(batch) if x.dtype == jnp.float32)
    assert mixed.argument_by_dtype["bfloat16"] * 6 == pytest.approx(
        fp32.argument_by_dtype["float32"] - batch32, rel=0.01)


def test_every_fp8_matmul_of_a_train_step_compiles_to_an_fp8_gemm():
    """A user's MLP under make_train_step(autocast=True) and mixed_fp8, compiled for an H200:
    each matmul's GEMMs (forward, both gradients) take 8-bit operands in the optimized
    HLO, none is dequantized to a bf16 GEMM; under mixed_bfloat16 they are bf16 GEMMs."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (512, 1024)) * 0.02,
              "w2": jax.random.normal(k2, (1024, 1024)) * 0.02,
              "w3": jax.random.normal(k3, (1024, 512)) * 0.02}
    batch = jnp.zeros((1024, 512), jnp.float32)

    def loss(p, x):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((jax.nn.relu(h @ p["w2"]) @ p["w3"]).astype(jnp.float32) ** 2)
    gemms = {}
    for policy in ("mixed_fp8", "mixed_bfloat16"):
        tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
        state = jax.eval_shape(lambda p, tx=tx: jaxamp.TrainState.create(params=p, tx=tx),
                               params)
        step = jax.jit(jaxamp.make_train_step(loss, autocast=True), donate_argnums=0)
        gemms[policy] = jaxamp.memory.gpu_memory(step, state, _abstract(batch), target="h200").gemms
    # 3 forward, 3 weight gradients, 2 input gradients (the batch's is never computed).
    fp8 = {k: v for k, v in gemms["mixed_fp8"].items() if k.count("f8") == 2}
    assert sum(fp8.values()) == 8 and fp8 == gemms["mixed_fp8"], gemms
    assert fp8["f8e4m3fn x f8e4m3fn"] == 3  # the forward pass; e5m2 gradients in the others
    assert gemms["mixed_bfloat16"] == {"bf16 x bf16": 8}, gemms


@pytest.mark.parametrize("model_remat", ["no remat", "checkpoint"])
def test_memory_goal_of_a_scanned_transformer_under_autocast(model_remat):
    """A memory goal (left out of CI with the others; tests/test_autocast.py checks the scan's
    structure there): a layer-scanned transformer (the remat suite's, 4 layers x 256, batch
    4 x 512), with and without its own remat. The H200 step's temporaries (the activations kept
    for the backward pass among them) under autocast are at most 0.6x fp32's. Without the
    model's remat, autocast's recompute used to run the whole forward scan again in the
    backward pass and stack every layer's attention scores at once (0.63x on the suite's 12
    layers)."""
    import functools

    from benchmarks import remat
    cfg = dict(layers=4, width=256, heads=4, batch=4, length=512, vocab=1024)
    params, batch = remat.abstract_params(cfg), remat.make_batch(cfg)
    loss = functools.partial(remat.loss_fn, remat.POLICIES[model_remat], cfg["heads"])
    fp32 = remat._step_gpu_bytes(loss, params, batch, "float32")[1]
    mixed = remat._step_gpu_bytes(loss, params, batch, "mixed_bfloat16")[1]
    assert mixed <= 0.6 * fp32, (mixed / fp32, mixed, fp32)


def test_retry_on_overflow_costs_no_gpu_memory():
    """``retry_on_overflow``'s loop holds a second copy of the gradient computation (its
    GEMMs twice in the program), run only after an overflow: the user's NNX GPT (one layer of
    128, batch 8 x 128) under fp16 autocast, compiled for an H200, needs at most 1.01x the
    bytes of the step without it (BENCHMARKS.md: 0.986x at 2 layers of 256)."""
    from train.models import nnx_gpt
    loss_fn, params = nnx_gpt.loss_and_params(vocab=256, width=128, depth=1, heads=2,
                                              max_len=128)
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), "mixed_float16")
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
    batch = {"tokens": jax.ShapeDtypeStruct((8, 129), jnp.int32)}
    reports = {r: jaxamp.memory.gpu_memory(
        jaxamp.make_train_step(loss_fn, autocast=True, retry_on_overflow=r), state, batch,
        donate_argnums=0, target="h200") for r in (False, True)}
    assert reports[True].total_bytes <= 1.01 * reports[False].total_bytes, reports
    assert sum(reports[True].gemms.values()) == 2 * sum(reports[False].gemms.values())


@pytest.mark.parametrize("model_remat", ["checkpoint"])
def test_a_model_that_remats_keeps_what_its_remat_keeps_in_less_memory(model_remat):
    """Autocast's default (``recompute=None``) defers to a model's own remat: the remat suite's
    layer-scanned transformer with checkpointed layers (4 layers x 256, batch 4 x 512,
    vocabulary 1024) compiled for an H200 needs less than under ``recompute=True`` (which also
    checkpoints the embedding, the head and the loss around the model's remat), and the same
    as under ``recompute=False``. (MaxText's llama2: 5-7%, BENCHMARKS.md.)"""
    import functools

    from benchmarks import remat
    cfg = dict(layers=4, width=256, heads=4, batch=4, length=512, vocab=1024)
    params, batch = remat.abstract_params(cfg), remat.make_batch(cfg)
    loss = functools.partial(remat.loss_fn, remat.POLICIES[model_remat], cfg["heads"])
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), "mixed_bfloat16")
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
    total = {}
    for recompute in (None, True, False):
        step = jaxamp.make_train_step(loss, autocast={"recompute": recompute},
                                      warn_fp32_matmuls=False)
        total[recompute] = jaxamp.memory.gpu_memory(step, state, batch, donate_argnums=0,
                                                    target="h200").total_bytes
    assert total[None] == total[False] < 0.98 * total[True], total


@pytest.mark.parametrize("name,mask", [("bert_tiny", "NO_MASK"), ("gpt_tiny", "CAUSAL")])
def test_the_reference_transformers_lower_attention_to_cudnn(name, mask):
    """``attention="cudnn"`` compiles to cuDNN's flash attention, forward and backward, in
    bf16; the same model in fp32 runs the explicit path (cuDNN has no fp32 kernel)."""
    from train import models
    batch = {"tokens": jax.ShapeDtypeStruct((4, 128), jnp.int32),
             "targets": jax.ShapeDtypeStruct((4, 128), jnp.int32)}
    hlo = {}
    # fp32 (the explicit path) once, on BERT: the choice is the same code for both models.
    for policy in ("mixed_bfloat16", "float32")[:2 if name.startswith("bert") else 1]:
        # heads of 64, as BERT-Large's and GPT-2's
        model = nnx_eval_shape(lambda p=policy: models.build(name, p, attention="cudnn",
                                                               width=128, heads=2))
        graphdef, params, _ = models.split(model)
        loss = models.mlm_loss(graphdef) if name.startswith("bert") else models.lm_loss(graphdef)
        tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
        state = jax.eval_shape(lambda p, tx=tx: jaxamp.TrainState.create(params=p, tx=tx),
                               params)
        step = jax.jit(jaxamp.make_train_step(loss, has_aux=True), donate_argnums=0)
        hlo[policy] = jaxamp.memory.gpu_memory(step, state, batch, target="h200").hlo
    fused = hlo["mixed_bfloat16"]
    assert fused.count('custom_call_target="__cudnn$fmhaSoftmax"') == 2  # one per layer
    assert fused.count('custom_call_target="__cudnn$fmhaSoftmaxBackward"') == 2
    assert f'"mask_type": "{mask}"' in fused
    assert "__cudnn$fmha" not in hlo.get("float32", "")


def test_autocast_gives_a_users_nnx_attention_cudnns_kernel():
    """The user's NNX GPT (``nnx.MultiHeadAttention``, fp32 layers) under
    ``make_train_step(autocast=True)``: compiled for an H200 its attention is cuDNN's flash
    kernel, once forward and once backward per layer (the forward's output is kept, not run
    again), in less memory than the XLA attention's; on this CPU the same step runs the XLA
    implementation under the rules, equal to the step that asks for it."""
    from train.models import nnx_gpt
    depth, heads, width = 1, 1, 64  # a head of 64
    loss_fn, params = nnx_gpt.loss_and_params(vocab=128, width=width, depth=depth, heads=heads,
                                              max_len=128)
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 129)), jnp.int32)
    batch = {"tokens": tokens}
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))
    report = jaxamp.memory.gpu_memory(step, _abstract(state), _abstract(batch), target="h200")
    # The mask of nnx.make_causal_mask makes them cuDNN's kernels with a bias.
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', report.hlo)
    assert len([c for c in calls if not c.endswith("Backward")]) == depth, calls
    assert len([c for c in calls if c.endswith("Backward")]) == depth, calls
    # The XLA attention, asked for by name (autocast passes such a call through as it is).
    original = jax.nn.dot_product_attention

    def xla_attention(*args, **kwargs):
        return original(*args, **{**kwargs, "implementation": "xla"})
    try:
        jax.nn.dot_product_attention = xla_attention
        explicit_step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True))
        explicit = jaxamp.memory.gpu_memory(explicit_step, _abstract(state), _abstract(batch),
                                     target="h200")
        cpu_explicit = explicit_step(state, batch)[1]["loss"]
    finally:
        jax.nn.dot_product_attention = original
    assert "__cudnn$fmha" not in explicit.hlo
    assert report.temp_bytes < explicit.temp_bytes
    np.testing.assert_allclose(float(step(state, batch)[1]["loss"]), float(cpu_explicit),
                               rtol=1e-6)


def _linen_attention(p, x):
    import flax.linen as nn
    return nn.MultiHeadDotProductAttention(num_heads=4).apply(p, x, x)


def _hand_causal(p, x):
    b, t, d = x.shape
    q, k, v = ((x @ p[w]).reshape(b, t, 4, d // 4) for w in ("wq", "wk", "wv"))
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(d // 4)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e10)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v).reshape(b, t, d) @ p["wo"]


def _maxtext_like(p, x):
    """MaxText's ``dot_product`` attention: grouped queries (2 kv heads of 4), the query
    scaled first, a causal mask from ``iota``, the softmax in fp32."""
    b, t, d = x.shape
    q = (x @ p["wq"]).reshape(b, t, 4, d // 4) * (d // 4) ** -0.5
    k, v = ((x @ p[w]).reshape(b, t, 2, d // 4) for w in ("wk", "wv"))
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, 2, 2, d // 4), k)
    rows = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
    s = jnp.where(cols <= rows, s, -0.7 * float(np.finfo(np.float32).max))
    out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s.astype(jnp.float32), -1), v)
    return out.reshape(b, t, d) @ p["wo"]


@pytest.mark.parametrize("model", ["linen", "hand-written causal", "maxtext-like"])
def test_attention_found_by_its_structure_compiles_to_cudnn(model):
    """Attention that is no ``jax.nn.dot_product_attention`` call (flax Linen's module,
    a hand-written causal one, MaxText's grouped-query layout) under autocast, compiled for an
    H200: cuDNN's fused kernel forward and backward, its scores no longer kept (under 0.3x
    fp32's temporaries; 0.5x with the XLA attention under the rules)."""
    import flax.linen as nn
    b, t, d = 4, 512, 256
    x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    if model == "linen":
        fn = _linen_attention
        p = jax.eval_shape(lambda: nn.MultiHeadDotProductAttention(num_heads=4).init(
            jax.random.key(0), jnp.zeros((b, t, d)), jnp.zeros((b, t, d))))
    else:
        fn = _hand_causal if model == "hand-written causal" else _maxtext_like
        kv = d // 2 if model == "maxtext-like" else d
        p = {"wq": jax.ShapeDtypeStruct((d, d), jnp.float32),
             "wk": jax.ShapeDtypeStruct((d, kv), jnp.float32),
             "wv": jax.ShapeDtypeStruct((d, kv), jnp.float32),
             "wo": jax.ShapeDtypeStruct((d, d), jnp.float32)}

    def loss(p, x):
        return jnp.mean(fn(p, x) ** 2)
    fused = jaxamp.memory.gpu_memory(jax.grad(jaxamp.autocast(loss)), p, x)
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', fused.hlo)
    assert len(calls) == 2 and calls[1].endswith("Backward"), calls
    fp32 = jaxamp.memory.gpu_memory(jax.grad(loss), p, x)
    assert "__cudnn$fmha" not in fp32.hlo
    assert fused.temp_bytes < 0.3 * fp32.temp_bytes, (fused.temp_bytes, fp32.temp_bytes)


def test_attention_imported_by_name_and_traced_in_two_threads_compiles_to_cudnn():
    """A model that imported ``dot_product_attention`` by name, under autocast, traced in two
    threads at once and compiled for an H200: cuDNN's kernel forward and backward in each."""
    import threading

    from jax.nn import dot_product_attention
    s = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.float32)
    both_tracing = threading.Barrier(2, timeout=120)

    def loss(q, k, v):
        both_tracing.wait()
        return jnp.mean(dot_product_attention(q, k, v, is_causal=True) ** 2)
    hlo, errors = {}, []

    def compile_for_the_gpu(name):
        try:
            grad = jax.jit(jax.grad(jaxamp.autocast(loss), argnums=(0, 1, 2)))
            hlo[name] = jaxamp.memory.gpu_memory(grad, s, s, s, target="h200").hlo
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=compile_for_the_gpu, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for text in hlo.values():
        calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text)
        assert sorted(calls) == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], calls
    assert len(hlo) == 2


def test_the_audit_counts_cudnns_attention_flops():
    """cuDNN's fused attention is matmuls too: the audit counts its two forward matmuls, and
    twice those in the backward pass, as for the explicit attention's ``dot_general``s."""
    s = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)

    def loss(q, k, v, implementation):
        out = jax.nn.dot_product_attention(q, k, v, implementation=implementation)
        return out.astype(jnp.float32).sum()
    fused = jaxamp.audit_grad(lambda q, k, v: loss(q, k, v, "cudnn"), s, s, s,
                              argnums=(0, 1, 2))
    explicit = jaxamp.audit_grad(lambda q, k, v: loss(q, k, v, "xla"), s, s, s,
                                 argnums=(0, 1, 2))
    forward = 2 * 2 * 4 * 128 * 128 * (64 + 64)
    assert fused.total_matmul_flops == 3 * forward
    assert fused.matmul_flops_by_operands == {"bfloat16": 3 * forward}
    assert explicit.total_matmul_flops == pytest.approx(3 * forward)


def test_the_zero3_state_on_eight_gpus():
    """ZeRO-3 on 8 H200s: each GPU holds an eighth of the state."""
    mesh = jaxamp.memory.gpu_mesh("h200", 8)
    params = {"w": jnp.zeros((4096, 4096)), "b": jnp.zeros((4096,))}
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), "mixed_bfloat16")
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
    shardings = jaxamp.parallel.state_sharding(state, mesh, params="sharded")
    batch_sharding = jaxamp.parallel.batch_sharding(mesh)
    laid = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)
    x = jax.ShapeDtypeStruct((64, 4096), jnp.float32, sharding=batch_sharding)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)
    step = jax.jit(jaxamp.make_train_step(loss), donate_argnums=0,
                   in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, jax.sharding.NamedSharding(
                       mesh, jax.sharding.PartitionSpec())))
    report = jaxamp.memory.gpu_memory(step, laid, x, mesh=mesh)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert report.devices == 8
    assert report.argument_bytes == pytest.approx(whole / 8 + 64 * 4096 * 4 / 8, rel=0.01)


def test_the_suite_compiles_its_rows_for_a_gpu(tmp_path):
    rows = main(["gpu", "--deviceless", "h200", "--tiny", "--models", "bert_large",
                 "--precisions", "fp32_default,mixed_bfloat16_zero3",
                 "--out", str(tmp_path)])["gpu"]
    assert [r["precision"] for r in rows] == ["fp32_default", "mixed_bfloat16_zero3"]
    assert all(r["error"] is None and r["mem_gb"] > 0 and r["temp_largest"] for r in rows)
    fp32, zero3 = rows
    assert zero3["mem_gb"] == pytest.approx(zero3["argument_gb"] + zero3["output_gb"]
                                            - zero3["alias_gb"] + zero3["temp_gb"])
    assert fp32["devices"] == 1
    assert zero3["devices"] == 2  # the tiny batch of 2 splits over 2 of the 8 GPUs
    assert fp32["vs_fp32_default"] == 1 and 0 < zero3["vs_fp32_default"] < 1.5
    assert sum(zero3["temp_by_dtype_gb"].values()) <= zero3["temp_gb"]
    # fp32: the explicit attention; its fusions are XLA:GPU's kernels
    assert fp32["cudnn_attention"] == 0 and fp32["fusions"] > 10
    text = (tmp_path / "gpu_deviceless_h200.md").read_text()
    assert "| bert_large | mixed_bfloat16_zero3 | 2 |" in text
    stored = [json.loads(line) for line in
              (tmp_path / "gpu_deviceless_h200.jsonl").read_text().splitlines()]
    assert [r["precision"] for r in stored] == [r["precision"] for r in rows]


# The memory goals, on an H200, mixed ÷ fp32 of the compiled step, checked on fewer layers of
# each model at its real width and batch (the full models' figures are in BENCHMARKS.md):
# BERT-Large 0.45 with cuDNN's fused attention (its mixed_bfloat16 row), 0.55 with the explicit
# one; the user's NNX GPT under autocast and ResNet-50 0.55. ResNet-50 meets its goal because
# the train step hands its gradients on in the order the backward pass makes them (0.576 for
# the full model without it, 0.512 with it).
GOALS = [("bert_large", "mixed_bfloat16", 0.45), ("bert_large", "mixed_bfloat16_explicit", 0.55),
         ("nnx_gpt", "autocast_bf16", 0.55), ("resnet50", "mixed_bfloat16", 0.55)]
# BERT-Large keeps 8 of its 24 layers: at 2 its MLM head (30522 wide) outweighs the layers.
REDUCED = {"bert_large": dict(depth=8), "nnx_gpt": dict(depth=2),
           "resnet50": dict(stage_sizes=(1, 1, 1, 1))}


@pytest.mark.parametrize("model,precision,goal", GOALS, ids=[f"{m}-{p}" for m, p, _ in GOALS])
def test_memory_goal(model, precision, goal):
    case = gpu._cases(False)[model]
    case = {**case, "kw": {**case["kw"], **REDUCED[model]}}
    args = type("Args", (), {"tiny": False, "zero_devices": 8})()
    ctx = gpu.Context(args, {model: case}, "NVIDIA H200 141GB HBM3e", {},
                      init=gpu.abstract_init)
    rows = {p: gpu_deviceless.compile_row(model, p, ctx, "h200")
            for p in (precision, "fp32_default")}
    ratio = rows[precision]["mem_gb"] / rows["fp32_default"]["mem_gb"]
    assert ratio <= goal, (ratio, rows)
    # What is left in fp32 is small: the loss head's chunks, cuDNN's softmax statistics, and
    # with the fused head one buffer of f32[64,512,4096]'s size (0.54 GB: 8% of BERT-Large's
    # temporaries at 8 layers, 3% at 24). One fp32 activation per layer, the regression fixed
    # here, is a quarter of them or more.
    fp32_left = rows[precision]["temp_by_dtype_gb"].get("float32", 0)
    assert fp32_left < 0.10 * rows[precision]["temp_gb"], rows[precision]["temp_largest"]
