"""``jaxamp.memory.gpu_memory``'s parts that need no XLA:GPU: reading a buffer assignment, the
targets, and the error without jax's CUDA plugin. The compiles themselves are tested in
tests/gpu_memory/ (``make test-gpu-memory``, in an environment with the plugin)."""

import pytest

import jaxamp
from jaxamp._diagnoses import _memory

# The shape of XLA's ``*buffer-assignment.txt``: a parameter, the temporary buffer shared by
# four values (two of them at offset 0, at different times), and a thread-local scalar.
ASSIGNMENT = """\
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <0 p0 @0> (size=64,offset=0): f32[16]{0}
allocation 3: size 4096, preallocated-temp:
 value: <10 fusion.1 @0> (size=2048,offset=0): f32[16,32]{1,0}
 value: <11 fusion.2 @0> (size=1024,offset=0): bf16[16,32]{1,0}
 value: <12 fusion.3 @0> (size=1024,offset=2048): bf16[16,32]{1,0}
 value: <13 fusion.4 @0> (size=512,offset=3072): f32[128]{0}
allocation 4: size 4, thread-local:
 value: <14 add.2 @0> (size=4,offset=0): f32[]
"""


def test_temp_buffer_split_counts_each_byte_once_for_its_largest_value():
    by_dtype, rows = _memory.temp_buffer_split(ASSIGNMENT)
    # [0, 2048): fusion.1 (fp32, the larger of the two values there); [2048, 3072): fusion.3;
    # [3072, 3584): fusion.4; [3584, 4096): no value.
    assert rows == [("f32[16,32]", 1, 2048), ("bf16[16,32]", 2, 1024), ("f32[128]", 1, 512)]
    assert by_dtype == {"float32": 2560, "bfloat16": 1024}


def test_temp_buffer_split_without_a_temporary_buffer():
    assert _memory.temp_buffer_split(ASSIGNMENT.split("allocation 3")[0]) == ({}, [])


def test_targets():
    assert jaxamp.memory.GPU_TARGETS == ("h100", "h200")
    for name, size in (("h100", "85520809984"), ("h200", "151397597184")):
        label, text = _memory._target_text(name)
        assert label.startswith(f"NVIDIA {name.upper()}")
        assert f"device_memory_size: {size}" in text and "core_count: 132" in text
    assert _memory._target_text("NVIDIA H100")[0] == "NVIDIA H100 80GB HBM3"
    custom = 'gpu_device_info { core_count: 8 }\ndevice_description_str: "My GPU"\n'
    assert _memory._target_text(custom) == ("My GPU", custom)


def test_unknown_target():
    with pytest.raises(ValueError, match=r"unknown target 'a100'.*h100, h200.*"
                                         r"GpuTargetConfigProto"):
        jaxamp.memory.gpu_mesh("a100")


def test_mesh_shape_needs_one_name_per_axis():
    with pytest.raises(ValueError, match=r"shape \(2, 4\) has 2 axes but axis_names"):
        jaxamp.memory.gpu_mesh("h200", (2, 4))


def test_without_the_cuda_plugin_says_how_to_install_it():
    # make test's environment has no CUDA plugin (make test-gpu-memory's has).
    with pytest.raises(RuntimeError, match=r'pip install "jax\[cuda13\]".*JAX_PLATFORMS=cpu'):
        jaxamp.memory.gpu_mesh("h200")


def test_live_peak_reads_the_live_range_dump(tmp_path):
    dump = tmp_path / "m.live-range.txt"
    dump.write_text("HloLiveRange (max 3)\n  Stack trace breakdown for peak usage: 10 949 000 416 "
                    "bytes\n")
    assert _memory._live_peak(str(dump)) == 10_949_000_416
    assert _memory._live_peak(str(tmp_path / "missing.txt")) is None
