"""The code of :mod:`jaxamp.memory`: the memory a step needs on a GPU, compiled by XLA:GPU
on a machine without one."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["GPU_TARGETS", "GpuMemoryReport", "gpu_memory", "gpu_mesh"]


@dataclasses.dataclass(frozen=True)
class _Gpu:
    """The facts of one GPU model that XLA:GPU's compiler reads (its ``GpuTargetConfigProto``).

    The per-SM limits are those of CUDA compute capability 9.0 (the CUDA C++ Programming Guide's
    table of technical specifications); the rest is the product's datasheet."""

    name: str
    memory_bytes: int  # what the CUDA runtime reports as total global memory
    bandwidth: float  # bytes/s of HBM
    memory_clock_khz: int
    cores: int = 132  # SMs
    clock_ghz: float = 1.98  # boost clock
    l2_bytes: int = 50 * 2**20
    nvlinks: int = 18


_HOPPER_SXM = {
    "h100": _Gpu("NVIDIA H100 80GB HBM3", 85_520_809_984, 3.35e12, 2_619_000),
    "h200": _Gpu("NVIDIA H200 141GB HBM3e", 151_397_597_184, 4.8e12, 3_750_000),
}
GPU_TARGETS: tuple[str, ...] = tuple(_HOPPER_SXM)
"""The GPUs :func:`gpu_memory` compiles for by name (SXM modules); any other GPU through
``target=`` as the text of XLA's ``GpuTargetConfigProto``."""


def _target_config(gpu: _Gpu) -> str:
    """XLA's ``GpuTargetConfigProto`` (text format) of a Hopper GPU, CUDA 13."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {gpu.cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.bandwidth)}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  model_str: "sm_9.0a with {gpu.memory_bytes}B RAM, {gpu.cores} cores, \
{int(gpu.clock_ghz * 1e6)}KHz clock, {gpu.memory_clock_khz}KHz mem clock, {gpu.l2_bytes}B L2$"
  device_address_bits: 64
  ecc_enabled: true
  name: "{gpu.name}"
  driver_version: "13.0.0"
  runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
  dnn_version: "9.10.0"
  device_interconnect_info {{ active_links: {gpu.nvlinks} }}
  collective_memory_granularity: 2097152
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{gpu.name}"
"""


def _target_text(target: str) -> tuple[str, str]:
    """``(name, GpuTargetConfigProto text)`` of a target name or proto text."""
    if "gpu_device_info" in target:
        found = re.search(r'device_description_str:\s*"([^"]*)"', target)
        return (found.group(1) if found else "custom GPU"), target
    key = target.lower().replace(" ", "").removeprefix("nvidia")
    if key not in _HOPPER_SXM:
        raise ValueError(
            f"unknown target {target!r} in jaxamp.memory.gpu_memory; expected one of "
            f"{', '.join(GPU_TARGETS)}, or the text of an XLA GpuTargetConfigProto (XLA "
            "ships them as xla/backends/gpu/target_config/specs/*.txtpb)")
    return _HOPPER_SXM[key].name, _target_config(_HOPPER_SXM[key])


def gpu_mesh(target: str = "h200", shape: tuple[int, ...] | int = 1,
             axis_names: tuple[str, ...] = ("batch",)) -> jax.sharding.Mesh:
    """A mesh of compile-only devices of GPU ``target`` (``"h200"``, ``"h100"``, or the text of
    an XLA ``GpuTargetConfigProto``), for :func:`gpu_memory`'s sharded steps.

    The devices can compile programs but not run them; they need jax's CUDA plugin
    (``pip install "jax[cuda13]"``, which installs on Linux without a GPU), and in a process
    on a machine without a GPU, ``JAX_PLATFORMS=cpu`` set before jax starts (else the plugin
    stops at its driver check).

    Args:
      target: the GPU.
      shape: the mesh's shape, one entry per axis name; ``8`` is 8 GPUs of one host.
      axis_names: the mesh's axis names.

    >>> import jaxamp
    >>> mesh = jaxamp.memory.gpu_mesh("h200", 8)
    >>> mesh.size, mesh.axis_names, mesh.devices.flat[0].device_kind
    (8, ('batch',), 'NVIDIA H200 141GB HBM3e')
    """
    from jax.experimental import topologies
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"gpu_mesh: shape {shape} has {len(shape)} axes but axis_names "
                         f"{axis_names} names {len(axis_names)}; give one name per axis")
    _, text = _target_text(target)
    devices = math.prod(shape)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{devices}", target_config=text)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise RuntimeError(
            "jaxamp.memory.gpu_memory compiles with XLA:GPU, which comes with jax's CUDA plugin: "
            'install it with pip install "jax[cuda13]" (Linux, no GPU needed), and on a machine '
            "without a GPU start Python with JAX_PLATFORMS=cpu so that the plugin loads without "
            f"a driver. jax {jax.__version__} said: {type(e).__name__}: {e}") from e
    return topologies.make_mesh(topology, shape, axis_names)


@dataclasses.dataclass(frozen=True)
class GpuMemoryReport:
    """What a compiled step holds on one GPU, in bytes (per device, for a sharded step).

    ``total_bytes`` is ``argument + output - alias + temp``: the arguments, the outputs that do
    not reuse a donated argument, and XLA's temporary buffer (the activations kept for the
    backward pass among them). The allocator's pool, cuBLAS/cuDNN workspaces and NCCL's buffers
    are not counted. ``print(report)`` gives a summary.
    """

    target: str
    """The GPU's name."""
    devices: int
    """The GPUs the step was compiled for (the figures are one GPU's)."""
    argument_bytes: int
    """The arguments, from XLA's ``memory_analysis()``."""
    output_bytes: int
    """The outputs."""
    alias_bytes: int
    """The outputs that reuse a donated argument's buffer."""
    temp_bytes: int
    """XLA's temporary buffer: activations kept for the backward pass, gradients, workspaces."""
    argument_by_dtype: dict[str, int]
    """The arguments' bytes on one GPU, by dtype name."""
    temp_by_dtype: dict[str, int]
    """The temporary buffer's bytes by the dtype of the values that use them."""
    temp_by_shape: tuple[tuple[str, int, int], ...]
    """``(dtype[shape], values, bytes)`` rows, largest first: the temporary buffer split among
    the values that share it, each byte counted once, for the largest value that uses it."""
    hlo: str = dataclasses.field(repr=False, default="")
    """The optimized HLO text."""
    live_peak_bytes: int | None = None
    """The most bytes live at once in XLA's schedule (arguments included), where its dump says:
    what the step holds at its peak. ``total_bytes`` is larger by what the temporary buffer's
    layout cannot reuse (values of different sizes and lifetimes packed into one arena)."""

    @property
    def gemms(self) -> dict[str, int]:
        """The compiled program's matrix multiplications by operand dtypes (HLO names:
        ``"f8e4m3fn x f8e4m3fn"``, ``"bf16 x bf16"``): its ``dot`` instructions, inside GEMM
        fusions too, and cuBLAS's GEMM custom calls. An FP8 matmul that XLA runs as one has
        8-bit operands here; one it dequantizes first shows as a 16- or 32-bit GEMM."""
        return gemms_by_operands(self.hlo)

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries: what the step needs on one GPU."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def __str__(self) -> str:
        gb = 1e9
        lines = [f"{self.target} x{self.devices}: {self.total_bytes / gb:.2f} GB per device "
                 f"(arguments {self.argument_bytes / gb:.2f} + outputs "
                 f"{self.output_bytes / gb:.2f} - donated {self.alias_bytes / gb:.2f} + "
                 f"temporaries {self.temp_bytes / gb:.2f})"]
        if self.live_peak_bytes is not None:
            lines.append(f"  live at the peak: {self.live_peak_bytes / gb:.2f} GB")
        if self.argument_by_dtype:
            lines.append("  arguments by dtype: " + ", ".join(
                f"{k} {v / gb:.2f} GB" for k, v in _largest(self.argument_by_dtype)))
        if self.temp_by_dtype:
            lines.append("  temporaries by dtype: " + ", ".join(
                f"{k} {v / gb:.2f} GB" for k, v in _largest(self.temp_by_dtype)))
        for label, count, nbytes in self.temp_by_shape[:8]:
            lines.append(f"    {nbytes / gb:7.2f} GB  {count:3d} x {label}")
        return "\n".join(lines)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+) = ([a-z0-9]+)\[")
_PARAMETER = re.compile(r"(%?[\w.\-]+): ([a-z0-9]+)\[")
_GEMM = re.compile(r"= [^=]*? (dot|custom-call)\((%[\w.\-]+), (%[\w.\-]+)")
_CUBLAS = re.compile(r'custom_call_target="(__cublas\$[^"]*)"')


def gemms_by_operands(hlo: str) -> dict[str, int]:
    """``{"lhs x rhs": count}`` of the ``dot`` instructions and cuBLAS GEMM custom calls of an
    HLO module's text, by their operands' dtypes.

    >>> gemms_by_operands('''
    ... %f (p0: f8e4m3fn[2,4], p1: f8e5m2[4,3]) -> f32[2,3] {
    ...   %p0 = f8e4m3fn[2,4]{1,0} parameter(0)
    ...   %p1 = f8e5m2[4,3]{1,0} parameter(1)
    ...   ROOT %d = f32[2,3]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}
    ... }''')
    {'f8e4m3fn x f8e5m2': 1}
    """
    dtypes: dict[str, str] = {}
    for line in hlo.splitlines():
        found = _INSTRUCTION.match(line)
        if found:
            dtypes[found.group(1)] = found.group(2)
        elif "->" in line and "(" in line:  # a computation's header names its parameters
            for name, dtype in _PARAMETER.findall(line.split("->")[0]):
                dtypes.setdefault(name if name.startswith("%") else "%" + name, dtype)
    counts: collections.Counter[str] = collections.Counter()
    for line in hlo.splitlines():
        found = _GEMM.search(line)
        if found is None:
            continue
        kind, lhs, rhs = found.groups()
        if kind == "custom-call" and not _CUBLAS.search(line):
            continue
        counts[f"{dtypes.get(lhs, '?')} x {dtypes.get(rhs, '?')}"] += 1
    return dict(sorted(counts.items()))


def _largest(d: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(d.items(), key=lambda kv: -kv[1])


_VALUE = re.compile(r"value: <\d+ [^>]*> \(size=(\d+),offset=(\d+)\): (\w+)\[([^\]]*)\]")
_TEMP = re.compile(r"^allocation \d+: size (\d+).*preallocated-temp", re.MULTILINE)


def temp_buffer_split(buffer_assignment: str) -> tuple[dict[str, int], list[tuple[str, int, int]]]:
    """The preallocated temporary buffer of XLA's buffer assignment (its dump's
    ``*buffer-assignment.txt``) split by dtype and by ``dtype[shape]``.

    Values that live at different times share bytes of the buffer. Each byte is counted once,
    for the largest value that uses it, so that the parts add up to the buffer's size (less
    bytes no value uses).
    """
    start = _TEMP.search(buffer_assignment)
    if start is None:
        return {}, []
    end = buffer_assignment.find("\nallocation ", start.end())
    block = buffer_assignment[start.end():None if end < 0 else end]
    values = [(int(off), int(size), f"{dt}[{shape}]") for size, off, dt, shape
              in _VALUE.findall(block)]
    cuts = sorted({o for o, _, _ in values} | {o + s for o, s, _ in values})
    by_shape: dict[str, int] = collections.Counter()
    starts: dict[str, set[int]] = collections.defaultdict(set)
    for o, _, label in values:
        starts[label].add(o)
    # Each segment between two cuts goes to the largest value covering it.
    ordered = sorted(values)
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        best = None
        for o, s, label in ordered:
            if o > lo:
                break
            if o + s >= hi and (best is None or s > best[0]):
                best = (s, label)
        if best is not None:
            by_shape[best[1]] += hi - lo
    rows = sorted(((label, len(starts[label]), n) for label, n in by_shape.items()),
                  key=lambda r: -r[2])
    by_dtype: dict[str, int] = collections.Counter()
    for label, _, n in rows:
        by_dtype[_dtype_name(label.split("[")[0])] += n
    return dict(by_dtype), rows


_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
               "s32": "int32", "u32": "uint32", "s8": "int8", "u8": "uint8", "pred": "bool",
               "s64": "int64", "u64": "uint64", "s16": "int16", "u16": "uint16",
               "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def _dtype_name(hlo: str) -> str:
    return _HLO_DTYPES.get(hlo, hlo)


def _on_one_device(sharding: jax.sharding.Sharding) -> bool:
    is_single = getattr(jax.sharding, "is_single_device_sharding", None)  # jax >= 0.12.1
    if is_single is not None:
        return is_single(sharding)
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


def _abstract(x: Any, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    own = getattr(x, "sharding", None)
    if isinstance(x, jax.ShapeDtypeStruct) and own is not None and not _on_one_device(own):
        return x  # laid out by the caller on a gpu_mesh
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _bytes_by_dtype(tree: Any) -> dict[str, int]:
    out: dict[str, int] = collections.Counter()
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        out[str(np.dtype(x.dtype)) if not jax.numpy.issubdtype(
            x.dtype, jax.dtypes.prng_key) else "key"] += math.prod(shape) * x.dtype.itemsize
    return dict(out)


def gpu_memory(fn: Callable, *args: Any, target: str = "h200",
               mesh: jax.sharding.Mesh | None = None,
               donate_argnums: int | tuple[int, ...] = (),
               compiler_options: dict[str, Any] | None = None) -> GpuMemoryReport:
    """Compiles ``fn(*args)`` for a GPU with XLA:GPU, on this machine, and reports the memory
    the GPU would need for it, and in which dtypes. Nothing runs; no GPU is needed.

    ``args`` are what you would call the step with: arrays, or ``jax.ShapeDtypeStruct`` leaves
    (``jax.eval_shape`` of your init gives them without allocating). Leaves are placed on one
    device of ``target`` (every device of ``mesh``, replicated), except ``ShapeDtypeStruct``
    leaves already sharded over a :func:`gpu_mesh`. ``fn`` may be ``jax.jit``-wrapped (its own
    shardings and donations then apply) or plain (jitted here, donating ``donate_argnums``: pass
    ``0`` for a train step that donates its state, as it should).

    It needs jax's CUDA plugin (``pip install "jax[cuda13]"`` on Linux; no GPU, no driver) and,
    on a machine without a GPU, ``JAX_PLATFORMS=cpu`` in the environment before jax starts.

    The figure is XLA:GPU's, for the jax and XLA installed; it agrees with a real H200 to within
    4% on BERT-Large, ResNet-50 and a GPT (the project's BENCHMARKS.md). :func:`jaxamp.audit`'s
    saved-residual bytes are the jaxpr's, before XLA: a different, smaller figure.

    Args:
      fn: the step.
      *args: its arguments.
      target: ``"h200"``, ``"h100"`` (SXM), or the text of an XLA ``GpuTargetConfigProto``.
      mesh: a :func:`gpu_mesh` to compile a sharded step for (several GPUs); default one GPU.
      donate_argnums: the arguments a plain ``fn`` donates.
      compiler_options: XLA options for the compile (``{"xla_gpu_...": ...}``).

    Returns:
      A :class:`GpuMemoryReport`; ``print`` it for a summary.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
    >>> def step(w, x):
    ...     loss = lambda w: jnp.tanh(x @ w.astype(x.dtype)).astype(jnp.float32).sum()
    ...     return w - 0.1 * jax.grad(loss)(w)
    >>> report = jaxamp.memory.gpu_memory(step, w, x, target="h100", donate_argnums=0)
    >>> report.target, report.argument_bytes / 2**20, report.alias_bytes / 2**20
    ('NVIDIA H100 80GB HBM3', 128.0, 64.0)
    >>> report.total_bytes == report.argument_bytes + report.temp_bytes  # w updated in place
    True
    """
    mesh = mesh if mesh is not None else _context_mesh(target)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(lambda x: _abstract(x, replicated), args)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums)
    report, _ = compile_report(jitted.lower(*abstract), _target_text(target)[0], mesh.size,
                               abstract, compiler_options)
    return report


def _context_mesh(target: str) -> jax.sharding.Mesh:
    """The mesh of ``jax.set_mesh`` when its devices are GPUs (a :func:`gpu_mesh`), else one
    device of ``target``: under ``jax.set_mesh(gpu_mesh(...))`` jit places the step on the
    context's devices, which one device of another mesh would contradict."""
    context = jax.sharding.get_mesh()
    if not context.empty and context.devices.flat[0].platform == "gpu":
        return context
    if not context.empty:
        raise ValueError(f"jaxamp.memory.gpu_memory runs under jax.set_mesh of a mesh of "
                         f"{context.devices.flat[0].platform} devices, on which it cannot "
                         "compile for a GPU: set a jaxamp.memory.gpu_mesh(...) instead, or pass "
                         "mesh=gpu_mesh(...) outside the set_mesh block")
    return gpu_mesh(target)


@contextlib.contextmanager
def _cache_cannot_load():
    """Silences JAX's warning when its persistent compilation cache holds this program: an
    executable compiled for compile-only devices cannot be loaded back (there is no client to
    load it into), so the read fails and XLA compiles it again, which is what is wanted."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Error reading persistent compilation cache",
                                category=UserWarning)
        yield


def compile_report(lowered: Any, target: str, devices: int, args: Any,
                   compiler_options: dict[str, Any] | None = None) -> tuple[GpuMemoryReport, Any]:
    """Compiles ``lowered`` (lowered for :func:`gpu_mesh` devices) and reads its memory:
    ``(report, compiled)``. ``args``: the abstract arguments, for their bytes by dtype."""
    # The dump is read back: whatever XLA_FLAGS holds (a --xla_dump_hlo_module_re of another
    # program, MaxText sets one), this program's buffer assignment is written as text.
    options = {"xla_dump_hlo_module_re": ".*", "xla_dump_hlo_as_text": True,
               **(compiler_options or {})}
    kept = options.get("xla_dump_to")  # the caller's dump: left in place
    with tempfile.TemporaryDirectory(prefix="jaxamp-gpu-memory-") as scratch:
        dump = kept or scratch
        with _cache_cannot_load():
            compiled = lowered.compile({**options, "xla_dump_to": dump})
        assigned = sorted(glob.glob(os.path.join(dump, "*gpu_after_optimizations-buffer-"
                                                       "assignment.txt")),
                          key=os.path.getmtime)
        if not assigned:
            raise RuntimeError(
                f"jaxamp.memory: XLA wrote no buffer assignment for this program to {dump}, so "
                "its memory cannot be split by dtype; the compile options given "
                f"({sorted(options)}) or XLA_FLAGS ({os.environ.get('XLA_FLAGS', '')!r}) "
                "turn the dump off or filter it")
        with open(assigned[-1]) as f:
            assignment = f.read()
        live_peak = _live_peak(assigned[-1].replace("-buffer-assignment.txt", "-live-range.txt"))
    stats = compiled.memory_analysis()
    if isinstance(stats, list | tuple):
        stats = stats[0]
    temp_by_dtype, temp_by_shape = temp_buffer_split(assignment)
    report = GpuMemoryReport(
        target=target, devices=devices,
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        argument_by_dtype=_bytes_by_dtype(args), temp_by_dtype=temp_by_dtype,
        temp_by_shape=tuple(temp_by_shape), hlo=compiled.as_text(), live_peak_bytes=live_peak)
    return report, compiled


_PEAK = re.compile(r"peak usage: ([\d ]+) bytes")


def _live_peak(path: str) -> int | None:
    """The peak of XLA's live-range dump (``*-live-range.txt``), ``None`` without one."""
    try:
        with open(path) as f:
            found = _PEAK.search(f.read())
    except OSError:
        return None
    return int(found.group(1).replace(" ", "")) if found else None
