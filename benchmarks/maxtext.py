"""Suite ``maxtext``: MaxText's own llama2 decoder under autocast, against MaxText's own mixed
precision, for each of MaxText's remat policies.

    make install-maxtext && make maxtext          # .venv-maxtext; rows under runs/maxtext
    JAX_PLATFORMS=cpu .venv-maxtext/bin/python -m benchmarks maxtext [--tiny] [--steps 30]
        [--policies full,minimal] [--parts cpu,gpu] [--gpu h200|none] [--gpu-layers 16]

The model is MaxText's (``maxtext==0.2.5``, installed without its dependencies; ``make
install-maxtext`` adds the 42 packages its config and model code import, no others): its
``pyconfig`` on ``base.yml``, the
llama2 decoder block, scanned layers, MaxText's defaults otherwise (RMS norms, RoPE, SwiGLU, an
untied output head, logits cast to fp32, MaxText's cross-entropy), built by its factory
``model_creation_utils.from_config`` as an NNX ``Transformer`` whose params are split off.
Three arms train from the same init on the same batches of random tokens (four batches, cycled):

- ``fp32``: ``dtype=float32, weight_dtype=float32``, a plain ``jax.value_and_grad`` and
  ``optax.adam`` step;
- ``maxtext_bf16``: MaxText's own mixed precision, ``dtype=bfloat16, weight_dtype=float32``,
  with the same plain step: the anchor;
- ``maxtext_bf16_jaxamp_step``: the second arm's model under ``jaxamp.make_train_step`` with
  ``mixed_precision(optax.adam(lr), "mixed_bfloat16")``, no autocast: what jaxamp's step (its
  finite check, skip, loss scale and counters) costs apart from autocast;
- ``jaxamp_autocast``: the fp32 model of the first arm, ``jaxamp.make_train_step(loss_fn,
  autocast=True)`` on ``jaxamp.TrainState.create(params=..., tx=jaxamp.mixed_precision(
  optax.adam(lr), "mixed_bfloat16"))``: bf16 working params and an fp32 master, 14 bytes a
  param with Adam's moments where MaxText's state holds 12 (fp32 params, no working copy);
- ``jaxamp_autocast_kahan``: the same with ``master="kahan"``: the fp32 value kept as the bf16
  param and a bf16 compensation, losslessly, 12 bytes a param as MaxText's;
- ``jaxamp_autocast_recompute``: ``jaxamp_autocast`` with ``autocast={"recompute": True}``:
  autocast's recompute policy around the model's remat, where the default defers to it.

Each arm runs under the remat policies MaxText names for its decoder layers (``remat_policy``):
``full``, ``minimal``, ``save_dot_except_mlp``, ``save_qkv_proj`` and ``minimal_offloaded``
(MaxText's offload policy: the projections ``minimal`` saves, offloaded to pinned host memory).

Figures, per policy and arm:

1. the matmul FLOPs of the whole train step (forward and backward, ``jaxamp.audit``), and of
   those the step's own (jaxamp's gradient norm: a dot of each gradient with itself);
2. ``audit(...).share("bfloat16")`` and the primitives of ``audit(...).half_sensitive_ops``;
   and the bytes the loss's jaxpr saves for the backward pass, by dtype (``saved_mb``: a bf16
   copy of an fp32 param made inside the model counts, a bf16 working param does not);
3. the loss of each of ``--steps`` steps on XLA:CPU: the last one's relative gap to the anchor's,
   and the largest gap over the steps;
4. trace + lower + compile on XLA:CPU, in CPU seconds of the process (all its threads: the
   other tenants of a shared machine move its wall time more), ``maxtext_bf16``,
   ``maxtext_bf16_jaxamp_step`` and ``jaxamp_autocast`` built anew each round after one
   untimed compile of each, jax's caches cleared before each, in a rotating order,
   ``--rounds`` rounds, the ratio taken round by round;
5. the step compiled by XLA:GPU for an H200 on this machine, no GPU (``jaxamp.memory``, needs
   jax's CUDA plugin): arguments + outputs - donated + temporaries, the temporaries by dtype and
   by shape, the pinned host buffer an offloading policy fills (not in the GPU's total), and the
   GEMMs by operand dtypes, at the size where memory matters (emb 1024, 8 heads of 128, MLP
   3584, ``--gpu-layers`` layers, sequence 1024, batch 8, vocabulary 32000).

Figures 1-4 are measured at a CPU size (``--tiny``: smaller still). The H200 compile sets
``attention="dot_product"``: MaxText's ``autoselected`` attention on a GPU mesh calls tokamax's
Pallas Triton flash attention, which refuses to trace on a machine whose default device is a
CPU, and which fails inside MaxText's ``shard_map`` when forced (``tokamax_cross_compile`` with
an H200 as the default device: ``check_vma`` wants ``manual_axis_type`` on its outputs). On the
CPU, ``autoselected`` is ``dot_product``.

Rows go to ``OUT/maxtext.jsonl``; the table is printed. Without MaxText installed the suite
says so and writes a one-line ``maxtext.jsonl``.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import harness
from jaxamp._diagnoses import _memory

ROUNDS = 7  # compile-time rounds
POLICIES = ("full", "minimal", "save_dot_except_mlp", "save_qkv_proj", "minimal_offloaded")
ARMS = ("fp32", "maxtext_bf16", "maxtext_bf16_jaxamp_step", "jaxamp_autocast",
        "jaxamp_autocast_kahan", "jaxamp_autocast_recompute")
ANCHOR = "maxtext_bf16"
# MaxText's bf16 model under jaxamp's step: what the step costs (its finite check, skip, loss
# scale and counters, absent from MaxText's bare step) apart from what autocast costs.
STEP_ANCHOR = "maxtext_bf16_jaxamp_step"
TIMED = ("maxtext_bf16", STEP_ANCHOR, "jaxamp_autocast")
LEARNING_RATE = 1e-3
DISTINCT_BATCHES = 4
GB = 1e9
_JAXAMP_DIR = os.path.dirname(os.path.abspath(jaxamp.__file__))


@dataclasses.dataclass(frozen=True)
class Shape:
    """A llama2 decoder's size and its batch."""

    emb: int
    heads: int
    head_dim: int
    mlp: int
    layers: int
    vocab: int
    seq: int
    batch: int

    def label(self) -> str:
        return (f"emb {self.emb}, {self.heads} heads x {self.head_dim}, MLP {self.mlp}, "
                f"{self.layers} layers, vocab {self.vocab}, batch {self.batch} x {self.seq}")


def shapes(tiny: bool, gpu_layers: int) -> tuple[Shape, Shape]:
    """``(CPU shape, H200 shape)``: the trained and timed size, and the compiled-for-GPU one."""
    if tiny:
        small = Shape(emb=64, heads=4, head_dim=16, mlp=224, layers=2, vocab=256, seq=32, batch=2)
        return small, small
    cpu = Shape(emb=256, heads=4, head_dim=64, mlp=896, layers=4, vocab=2048, seq=128, batch=4)
    gpu = Shape(emb=1024, heads=8, head_dim=128, mlp=3584, layers=gpu_layers, vocab=32000,
                seq=1024, batch=8)
    return cpu, gpu


def add_arguments(ap) -> None:
    ap.add_argument("--steps", type=int, default=None,
                    help="train steps per arm on the CPU (default 30; 20 with --tiny)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"MaxText remat policies, comma-separated (default {','.join(POLICIES)})")
    ap.add_argument("--parts", default="cpu,gpu",
                    help="cpu (figures 1-4), gpu (the H200 compile, figure 5), or both (default)")
    ap.add_argument("--gpu", default="h200",
                    help="the GPU to compile for: h200, h100, or none (default h200)")
    ap.add_argument("--gpu-layers", type=int, default=16,
                    help="decoder layers of the GPU-sized model (default 16)")


# --------------------------------------------------------------------------------------------
# MaxText's model
# --------------------------------------------------------------------------------------------

def maxtext_config(shape: Shape, *, dtype: str, remat_policy: str, hardware: str,
                   attention: str, out: str):
    """MaxText's ``pyconfig`` on its ``base.yml``: the llama2 block (base.yml's default) at
    ``shape``, weights in fp32, compute in ``dtype``, no dropout, no checkpointing, and no
    persistent compilation cache (base.yml's ``jax_cache_dir: ~/jax_cache`` would turn jax's on
    for the whole process, and every compile after the first would be a cache read)."""
    from maxtext.configs import pyconfig
    return pyconfig.initialize(
        [""], base_output_directory=os.path.abspath(out), run_name="jaxamp-maxtext",
        enable_checkpointing=False, skip_jax_distributed_system=True, jax_cache_dir="",
        hardware=hardware,
        decoder_block="llama2", scan_layers=True, remat_policy=remat_policy,
        dtype=dtype, weight_dtype="float32", attention=attention, enable_dropout=False,
        base_emb_dim=shape.emb, base_num_query_heads=shape.heads, base_num_kv_heads=shape.heads,
        head_dim=shape.head_dim, base_mlp_dim=shape.mlp, base_num_decoder_layers=shape.layers,
        vocab_size=shape.vocab, max_target_length=shape.seq, per_device_batch_size=shape.batch)


def _concrete(x: Any) -> jax.Array:
    """A concrete value of an abstract leaf: zeros, or keys (of jax's default PRNG, the one
    ``nnx.Rngs`` uses)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(0), x.shape)
    return jnp.zeros(x.shape, x.dtype)


def build(config, devices: list, *, abstract: bool) -> tuple[Callable, Any]:
    """``(loss_fn(params, batch), params)`` of MaxText's ``Transformer`` built by its factory on a
    mesh of ``devices``: the params as a plain dict, abstract with ``abstract`` (for a compile
    on devices that cannot hold them). The rest of the model's state (its RNG streams, unused
    without dropout) is closed over."""
    from flax import nnx
    from maxtext.utils import max_utils
    from maxtext.utils import maxtext_utils
    from maxtext.utils import model_creation_utils

    mesh = maxtext_utils.get_mesh_from_config(config, devices)

    def create():
        return model_creation_utils.from_config(config, mesh=mesh,
                                                rngs=nnx.Rngs(params=0, dropout=1, aqt=2))

    model = nnx.eval_shape(create) if abstract else create()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if abstract:
        rest = jax.tree.map(_concrete, rest)

    def loss_fn(params, batch):
        """MaxText's train loss: its cross-entropy (custom VJP), z-loss, mean over tokens."""
        logits_BxLxV = nnx.merge(graphdef, params, rest)(
            decoder_input_tokens=batch["inputs"], decoder_positions=batch["positions"],
            decoder_segment_ids=batch["segmentation"], enable_dropout=False)
        one_hot_BxLxV = jax.nn.one_hot(batch["targets"], config.vocab_size)
        xent_BxL, _ = max_utils.cross_entropy_with_logits(logits_BxLxV, one_hot_BxLxV,
                                                          config.z_loss_multiplier)
        weights_BxL = batch["segmentation"] != 0
        return jnp.sum(xent_BxL * weights_BxL) / jnp.sum(weights_BxL)

    return loss_fn, nnx.to_pure_dict(params)


def batches(shape: Shape, n: int, seed: int = 0) -> list[dict[str, jax.Array]]:
    """``n`` batches of random tokens: inputs, next-token targets, positions, one segment."""
    out = []
    for key in jax.random.split(jax.random.key(seed), n):
        tokens_BxL1 = jax.random.randint(key, (shape.batch, shape.seq + 1), 0, shape.vocab,
                                         jnp.int32)
        out.append({"inputs": tokens_BxL1[:, :-1], "targets": tokens_BxL1[:, 1:],
                    "positions": jnp.broadcast_to(jnp.arange(shape.seq, dtype=jnp.int32),
                                                  (shape.batch, shape.seq)),
                    "segmentation": jnp.ones((shape.batch, shape.seq), jnp.int32)})
    return out


# --------------------------------------------------------------------------------------------
# The three arms
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm at one policy: how to build its step, and its state from the shared params."""

    name: str
    loss_fn: Callable
    make_step: Callable[[], Callable]  # a new step function each call (for the timing)
    init: Callable[[Any], Any]  # the state from params (concrete or abstract)
    loss_of: Callable[[Any], jax.Array]  # the loss from the step's second output


def plain_step(loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
    """``step((params, opt_state), batch) -> ((params, opt_state), loss)``: value_and_grad and
    the optimizer, nothing else."""
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


def arms(loss_fp32: Callable, loss_bf16: Callable) -> dict[str, Arm]:
    tx = optax.adam(LEARNING_RATE)
    mixed_tx = jaxamp.mixed_precision(optax.adam(LEARNING_RATE), "mixed_bfloat16")
    kahan_tx = jaxamp.mixed_precision(optax.adam(LEARNING_RATE), "mixed_bfloat16",
                                      master="kahan")

    def plain_arm(name: str, loss_fn: Callable) -> Arm:
        return Arm(name, loss_fn, lambda: plain_step(loss_fn, tx),
                   lambda params: (params, tx.init(params)), lambda loss: loss)

    return {
        "fp32": plain_arm("fp32", loss_fp32),
        "maxtext_bf16": plain_arm("maxtext_bf16", loss_bf16),
        STEP_ANCHOR: Arm(
            STEP_ANCHOR, loss_bf16,
            lambda: jaxamp.make_train_step(loss_bf16, warn_fp32_matmuls=False),
            lambda params: jaxamp.TrainState.create(params=params, tx=mixed_tx),
            lambda metrics: metrics["loss"]),
        "jaxamp_autocast": Arm(
            "jaxamp_autocast", loss_fp32,
            lambda: jaxamp.make_train_step(loss_fp32, autocast=True),
            lambda params: jaxamp.TrainState.create(params=params, tx=mixed_tx),
            lambda metrics: metrics["loss"]),
        "jaxamp_autocast_kahan": Arm(
            "jaxamp_autocast_kahan", loss_fp32,
            lambda: jaxamp.make_train_step(loss_fp32, autocast=True),
            lambda params: jaxamp.TrainState.create(params=params, tx=kahan_tx),
            lambda metrics: metrics["loss"]),
        # autocast's recompute forced on around the model's remat (the default defers to it)
        "jaxamp_autocast_recompute": Arm(
            "jaxamp_autocast_recompute", loss_fp32,
            lambda: jaxamp.make_train_step(loss_fp32, autocast={"recompute": True}),
            lambda params: jaxamp.TrainState.create(params=params, tx=mixed_tx),
            lambda metrics: metrics["loss"]),
    }


def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


# --------------------------------------------------------------------------------------------
# Figures 1-4: the audit, the loss and the compile time on XLA:CPU
# --------------------------------------------------------------------------------------------

def audit_row(arm: Arm, params: Any, batch: dict) -> dict[str, Any]:
    """The audit of the whole step: matmul FLOPs, the bf16 share, the half-precision ops that
    prefer fp32. A plain step is audited with its state closed over (its jaxpr is the same; the
    audit then does not differentiate the step itself for its residuals)."""
    step = arm.make_step()
    state = arm.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no residuals to list; the fp32 arm's fp32 matmuls
        if isinstance(state, jaxamp.TrainState):
            report = jaxamp.audit(step, state, batch)  # its residuals: the step's loss's
            saved = report.saved_bytes_by_dtype
        else:
            report = jaxamp.audit(lambda b: step(state, b), batch)
            saved = jaxamp.audit(lambda p: arm.loss_fn(p, batch), params).saved_bytes_by_dtype
    own = sum(m.flops for m in report.matmuls if m.where.startswith(_JAXAMP_DIR))
    return {"matmul_gflops": report.total_matmul_flops / 1e9,
            "step_own_matmul_gflops": own / 1e9,
            "model_matmul_gflops": (report.total_matmul_flops - own) / 1e9,
            "bf16_share": report.share("bfloat16"),
            "half_sensitive_ops": [op.primitive for op in report.half_sensitive_ops],
            "half_sensitive_sites": [f"{op.primitive} {op.dtype}{list(op.shape)} x{op.count:g}"
                                     for op in report.half_sensitive_ops],
            "saved_mb_by_dtype": {k: v / 1e6 for k, v in sorted(saved.items())},
            "saved_mb": sum(saved.values()) / 1e6}


def _compile(step: Callable, state: Any, batch: dict) -> tuple[tuple[float, float, float], Any]:
    """``((trace, lower, compile) CPU seconds, compiled)`` of ``step`` jitted with its state
    donated, jax's caches cleared and the garbage collected first."""
    jax.clear_caches()
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # make_train_step's fp32-matmul warning, none here
        t0 = time.process_time()
        traced = jax.jit(step, donate_argnums=0).trace(state, batch)
        t1 = time.process_time()
        lowered = traced.lower()
        t2 = time.process_time()
        compiled = lowered.compile()
        t3 = time.process_time()
    return (t1 - t0, t2 - t1, t3 - t2), compiled


def compile_times(by_arm: dict[str, Arm], params: Any, batch: dict, rounds: int,
                  label: str) -> tuple[dict[str, list[tuple[float, float, float]]], dict]:
    """Each timed arm's step built anew and compiled in each round, the order rotating; the
    compiled steps of the last round are kept for training."""
    times: dict[str, list[tuple[float, float, float]]] = {a: [] for a in TIMED}
    compiled = {}
    for name in TIMED:  # untimed: the process's first compiles are slower
        _compile(by_arm[name].make_step(), by_arm[name].init(params), batch)
    for r in range(rounds):
        for name in TIMED[r % len(TIMED):] + TIMED[:r % len(TIMED)]:
            arm = by_arm[name]
            seconds, compiled[name] = _compile(arm.make_step(), arm.init(params), batch)
            times[name].append(seconds)
            print(f"  {label}, compile round {r + 1}/{rounds}, {name}: {sum(seconds):.1f} CPU s",
                  flush=True)
    return times, compiled


def train(arm: Arm, compiled: Any, params: Any, data: list[dict], steps: int) -> list[float]:
    """The loss of each of ``steps`` steps from a copy of ``params``, the batches cycled."""
    state = arm.init(_copy(params))
    losses = []
    for i in range(steps):
        state, out = compiled(state, data[i % len(data)])
        losses.append(float(arm.loss_of(out)))
    return losses


def cpu_rows(policy: str, shape: Shape, steps: int, rounds: int, out: str) -> dict[str, dict]:
    """Figures 1-4 of each arm at ``policy``, on XLA:CPU."""
    devices = jax.devices()[:1]
    cfg32 = maxtext_config(shape, dtype="float32", remat_policy=policy, hardware="cpu",
                           attention="autoselected", out=out)
    cfg16 = maxtext_config(shape, dtype="bfloat16", remat_policy=policy, hardware="cpu",
                           attention="autoselected", out=out)
    loss32, params = build(cfg32, devices, abstract=False)
    loss16, params16 = build(cfg16, devices, abstract=False)
    same = jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, params16))
    if not same:
        raise RuntimeError(f"maxtext suite, policy {policy!r}: the fp32 and bf16 models did not "
                           "initialise to the same params; the arms would not share an init")
    by_arm = arms(loss32, loss16)
    data = batches(shape, DISTINCT_BATCHES)
    rows: dict[str, dict] = {}
    for name, arm in by_arm.items():
        rows[name] = audit_row(arm, params, data[0])
        print(f"  {policy}, {name}: {rows[name]['matmul_gflops']:.4g} GFLOP of matmuls, "
              f"bf16 share {rows[name]['bf16_share']:.3f}", flush=True)
    times, compiled = compile_times(by_arm, params, data[0], rounds, policy)
    for name in set(by_arm) - set(TIMED):
        _, compiled[name] = _compile(by_arm[name].make_step(), by_arm[name].init(params),
                                     data[0])
    for name, arm in by_arm.items():
        losses = train(arm, compiled[name], params, data, steps)
        rows[name].update(loss_first=losses[0], loss_last=losses[-1], losses=losses)
    for name, t in times.items():
        rows[name].update(
            trace_s=statistics.median(x[0] for x in t), lower_s=statistics.median(x[1] for x in t),
            compile_s=statistics.median(x[2] for x in t),
            total_compile_s=statistics.median(sum(x) for x in t))
    for anchor, key in ((ANCHOR, "compile_vs_anchor"), (STEP_ANCHOR, "compile_vs_step")):
        for name, t in times.items():
            ratios = [sum(a) / sum(b) for a, b in zip(t, times[anchor], strict=True)]
            rows[name][key] = statistics.median(ratios)
            rows[name][key.replace("_vs_", "_ratios_vs_")] = [round(x, 3) for x in ratios]
    return rows


# --------------------------------------------------------------------------------------------
# Figure 5: the step compiled for an H200, on this machine
# --------------------------------------------------------------------------------------------

def gpu_mesh_or_none(target: str) -> Any:
    """A mesh of one compile-only GPU, or ``None`` without jax's CUDA plugin."""
    if target == "none":
        return None
    try:
        return jaxamp.memory.gpu_mesh(target)
    except Exception:  # noqa: BLE001 - no CUDA plugin: the GPU columns stay empty
        return None


def _abstract_batch(shape: Shape) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32)
            for k in ("inputs", "targets", "positions", "segmentation")}


_ARENA = re.compile(r"^allocation \d+: size (\d+)(?:, color (\d+))?[^\n]*preallocated-temp",
                    re.MULTILINE)
_HOST_COLOR = "5"  # XLA:GPU's memory space of pinned host memory (offloaded residuals)


def temp_arenas(buffer_assignment: str) -> dict[str, dict[str, Any]]:
    """The temporary buffers of XLA's buffer assignment, ``"device"`` and ``"host"`` (pinned
    host memory, where an offloading remat policy puts what it saves), each with its bytes and
    its split by dtype and by shape (``jaxamp._diagnoses._memory.temp_buffer_split`` of that arena).
    ``gpu_memory``'s own split reads the first arena of the file, the host's when there is one."""
    arenas: dict[str, dict[str, Any]] = {}
    for found in _ARENA.finditer(buffer_assignment):
        where = "host" if found.group(2) == _HOST_COLOR else "device"
        by_dtype, by_shape = _memory.temp_buffer_split(buffer_assignment[found.start():])
        arenas[where] = {"bytes": int(found.group(1)), "by_dtype": by_dtype,
                         "by_shape": by_shape}
    return arenas


def compile_for_gpu(step: Callable, state: Any, batch: Any, mesh) -> tuple[Any, dict]:
    """``(jaxamp.memory.GpuMemoryReport, temp_arenas)`` of ``step`` jitted with its state
    donated and compiled by XLA:GPU for ``mesh``'s one GPU, nothing run."""
    on_gpu = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_gpu),
                        (state, batch))
    lowered = jax.jit(step, donate_argnums=0).lower(*args)
    with tempfile.TemporaryDirectory(prefix="jaxamp-maxtext-") as dump:
        report, _ = _memory.compile_report(
            lowered, mesh.devices.flat[0].device_kind, 1, args, {"xla_dump_to": dump})
        assigned = sorted(glob.glob(os.path.join(
            dump, "*gpu_after_optimizations-buffer-assignment.txt")), key=os.path.getmtime)
        text = ""
        if assigned:
            with open(assigned[-1]) as f:
                text = f.read()
    return report, temp_arenas(text)


def _shapes_gb(by_shape: list, n: int, dtype: str = "") -> list[list]:
    return [[label, count, b / GB] for label, count, b in by_shape
            if label.startswith(dtype)][:n]


def gpu_rows(policy: str, shape: Shape, mesh, out: str) -> dict[str, dict]:
    """Figure 5 of each arm at ``policy``: the whole step compiled by XLA:GPU for ``mesh``'s
    GPU, its state donated, nothing run."""
    devices = list(mesh.devices.flat)
    built = {}
    for dtype in ("float32", "bfloat16"):
        cfg = maxtext_config(shape, dtype=dtype, remat_policy=policy, hardware="gpu",
                             attention="dot_product", out=out)
        built[dtype] = build(cfg, devices, abstract=True)
    params = built["float32"][1]
    by_arm = arms(built["float32"][0], built["bfloat16"][0])
    batch = _abstract_batch(shape)
    rows: dict[str, dict] = {}
    for name, arm in by_arm.items():
        state = jax.eval_shape(arm.init, params)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report, arenas = compile_for_gpu(arm.make_step(), state, batch, mesh)
        except Exception as e:  # noqa: BLE001 - the row says why, the suite goes on
            rows[name] = {"gpu_error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
            print(f"  {policy}, {name}: GPU compile failed: {rows[name]['gpu_error']}",
                  flush=True)
            continue
        gemms = report.gemms
        device = arenas.get("device", {"bytes": 0, "by_dtype": {}, "by_shape": []})
        host = arenas.get("host", {"bytes": 0, "by_dtype": {}, "by_shape": []})
        rows[name] = {
            "gpu_gb": report.total_bytes / GB, "gpu_argument_gb": report.argument_bytes / GB,
            "gpu_output_gb": report.output_bytes / GB, "gpu_alias_gb": report.alias_bytes / GB,
            "gpu_temp_gb": report.temp_bytes / GB,
            "gpu_live_peak_gb": None if report.live_peak_bytes is None
            else report.live_peak_bytes / GB,
            "gpu_temp_by_dtype_gb": {k: v / GB for k, v in device["by_dtype"].items()},
            "gpu_temp_largest": _shapes_gb(device["by_shape"], 10),
            "gpu_temp_f32_largest": _shapes_gb(device["by_shape"], 8, "f32["),
            "host_temp_gb": host["bytes"] / GB,
            "host_temp_by_dtype_gb": {k: v / GB for k, v in host["by_dtype"].items()},
            "host_temp_largest": _shapes_gb(host["by_shape"], 10),
            "gemms_by_operands": gemms, "gemms": sum(gemms.values()),
            "gpu_compile_s": time.perf_counter() - t0}
        print(f"  {policy}, {name}: {report.total_bytes / GB:.2f} GB on the GPU "
              f"(temporaries {report.temp_bytes / GB:.2f}; pinned host "
              f"{host['bytes'] / GB:.2f}), GEMMs {gemms}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------

def _ratio(rows: list[dict], key: str, out_key: str) -> None:
    """``row[out_key] = row[key] / the anchor's`` for every row of each policy."""
    anchors = {r["policy"]: r.get(key) for r in rows if r["arm"] == ANCHOR}
    for r in rows:
        base, value = anchors.get(r["policy"]), r.get(key)
        r[out_key] = value / base if value is not None and base else None


def _loss_vs_anchor(rows: list[dict]) -> None:
    """The relative gap to the anchor's loss at the last step, and the largest over the steps."""
    anchors = {r["policy"]: r.get("losses") for r in rows if r["arm"] == ANCHOR}
    for r in rows:
        base, losses = anchors.get(r["policy"]), r.get("losses")
        if base is None or losses is None:
            continue
        gaps = [(x - b) / b for x, b in zip(losses, base, strict=True)]
        r["loss_vs_anchor"] = gaps[-1]
        r["loss_max_gap"] = max(gaps, key=abs)


def _skip(out: str, reason: str) -> list[dict]:
    print(f"## maxtext\n\n{reason}: suite skipped (`make install-maxtext` builds .venv-maxtext, "
          "`make maxtext` runs it there).\n", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "maxtext.jsonl"), "w") as f:
        f.write(json.dumps({"suite": "maxtext", "skipped": reason}) + "\n")
    return []


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args) -> list[dict]:
    if importlib.util.find_spec("maxtext") is None:
        return _skip(args.out, "maxtext is not installed")
    steps = args.steps if args.steps is not None else (20 if args.tiny else 30)
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"--policies {args.policies!r}: unknown {unknown}; expected some of "
                         f"{', '.join(POLICIES)}")
    parts = set(args.parts.split(","))
    cpu_shape, gpu_shape = shapes(args.tiny, args.gpu_layers)
    mesh = gpu_mesh_or_none(args.gpu) if "gpu" in parts else None
    rows = []
    for policy in policies:
        print(f"# remat_policy={policy}", flush=True)
        cpu = cpu_rows(policy, cpu_shape, steps, args.rounds, args.out) if "cpu" in parts else {}
        gpu = gpu_rows(policy, gpu_shape, mesh, args.out) if mesh is not None else {}
        for arm in ARMS:
            rows.append({"policy": policy, "arm": arm, **cpu.get(arm, {}), **gpu.get(arm, {})})
    _ratio(rows, "matmul_gflops", "flops_vs_anchor")
    _ratio(rows, "model_matmul_gflops", "model_flops_vs_anchor")
    _ratio(rows, "gpu_gb", "gpu_vs_anchor")
    _ratio(rows, "gpu_temp_gb", "gpu_temp_vs_anchor")
    _ratio(rows, "saved_mb", "saved_vs_anchor")
    _ratio(rows, "gemms", "gemms_vs_anchor")
    _loss_vs_anchor(rows)
    for r in rows:
        r["half_sensitive"] = " ".join(sorted(set(r.get("half_sensitive_ops", [])))) or "-"
    info = {"maxtext": _version("maxtext"), "flax": _version("flax"), "optax": _version("optax"),
            "cpu_shape": cpu_shape.label(), "steps": steps, "compile_rounds": args.rounds,
            "gpu": None if mesh is None else mesh.devices.flat[0].device_kind,
            "gpu_shape": None if mesh is None else gpu_shape.label()}
    for r in rows:
        r.update(info)
    header = (f"{harness.machine()}, maxtext {info['maxtext']}; MaxText's llama2 decoder, scanned "
              f"layers. CPU figures at {cpu_shape.label()}: matmul FLOPs of the whole step "
              f"(jaxamp.audit), its bf16 share, the half-precision ops that prefer fp32, the loss "
              f"of step {steps} (adam {LEARNING_RATE:g}, {DISTINCT_BATCHES} batches of random "
              f"tokens cycled), trace + lower + compile on XLA:CPU in CPU seconds ({args.rounds} "
              "interleaved rounds after one untimed, median; ratio per round, median, over "
              "maxtext_bf16 and over maxtext_bf16_jaxamp_step). "
              + ("GPU: not compiled (no CUDA plugin, or --gpu none)." if mesh is None else
                 f"GPU: the step compiled for {info['gpu']} with no GPU at {gpu_shape.label()} "
                 "(attention dot_product): arguments + outputs - donated + temporaries, GEMM "
                 "count. `_vs_anchor`: over maxtext_bf16's at the same policy."))
    harness.write_outputs(
        "maxtext", rows,
        ["policy", "arm", "matmul_gflops", "flops_vs_anchor", "bf16_share", "half_sensitive",
         "saved_vs_anchor", "loss_last", "loss_vs_anchor", "total_compile_s",
         "compile_vs_anchor", "compile_vs_step", "gpu_gb", "gpu_vs_anchor", "gpu_temp_gb",
         "host_temp_gb", "gemms", "gemms_vs_anchor"],
        args.out, None, header)
    return rows
