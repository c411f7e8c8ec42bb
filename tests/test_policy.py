"""Tests for jaxamp.policy: presets, jmp's grammar, errors, casts and per-parameter overrides."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from flax import struct
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxamp
from jaxamp import Policy
from jaxamp import get_policy
from jaxamp._optimizer._state import Health
from jaxamp._optimizer._state import Master
from jaxamp.gradients import tree_path_str

# The library's own arithmetic must be promotion-clean (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("strict_promotion")

F32 = jnp.dtype(jnp.float32)
BF16 = jnp.dtype(jnp.bfloat16)
F16 = jnp.dtype(jnp.float16)


def dtypes(policy):
    return (policy.param_dtype, policy.compute_dtype, policy.output_dtype)


# --------------------------------------------------------------------------------------------
# Presets and "auto".
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("float32", (F32, F32, F32)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("mixed_bfloat16", (F32, BF16, F32)),
    ("mixed_float16", (F32, F16, F32)),
])
def test_presets(name, expected):
    policy = get_policy(name)
    assert isinstance(policy, Policy)
    assert dtypes(policy) == expected
    assert policy.overrides == ()
    assert policy.name == name
    assert policy.is_mixed == (expected[0] != expected[1])


def test_default_spec_is_mixed_bfloat16():
    assert dtypes(get_policy()) == (F32, BF16, F32)


def test_presets_are_case_insensitive():
    assert dtypes(get_policy("Mixed_Float16")) == (F32, F16, F32)


def test_auto_is_float32_on_cpu():
    assert jax.local_devices()[0].platform == "cpu"
    policy = get_policy("auto")
    assert dtypes(policy) == (F32, F32, F32)
    assert policy.name.startswith("auto:")
    assert policy.name == "auto:float32"


class FakeDevice:
    def __init__(self, platform, compute_capability=None):
        self.platform = platform
        self.compute_capability = compute_capability


@pytest.mark.parametrize("device, expected", [
    (FakeDevice("tpu"), "mixed_bfloat16"),
    (FakeDevice("gpu", "8.0"), "mixed_bfloat16"),
    (FakeDevice("gpu", "8.6"), "mixed_bfloat16"),
    (FakeDevice("gpu", "9.0"), "mixed_bfloat16"),
    (FakeDevice("gpu", "7.0"), "mixed_float16"),
    (FakeDevice("gpu", "7.5"), "mixed_float16"),
    (FakeDevice("cpu"), "float32"),
])
def test_resolve_auto_on_fake_devices(device, expected):
    assert Policy.resolve_auto(device) == expected


def test_resolve_auto_defaults_to_the_first_local_device():
    assert Policy.resolve_auto() == "float32"


@pytest.mark.parametrize("device, expected_dtypes, expected_name", [
    (FakeDevice("tpu"), (F32, BF16, F32), "auto:mixed_bfloat16"),
    (FakeDevice("gpu", "9.0"), (F32, BF16, F32), "auto:mixed_bfloat16"),
    (FakeDevice("gpu", "7.0"), (F32, F16, F32), "auto:mixed_float16"),
    (FakeDevice("cpu"), (F32, F32, F32), "auto:float32"),
])
def test_auto_with_an_explicit_device(device, expected_dtypes, expected_name):
    policy = get_policy("auto", device=device)
    assert dtypes(policy) == expected_dtypes
    assert policy.name == expected_name


# --------------------------------------------------------------------------------------------
# jmp's grammar.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=f16,o=f32", (F32, F16, F32)),
    # Omitted output follows compute.
    ("p=f32,c=f16", (F32, F16, F16)),
    # Omitted params default to f32, omitted compute follows params.
    ("c=bf16", (F32, BF16, BF16)),
    ("o=f16", (F32, F32, F16)),
    ("p=bf16", (BF16, BF16, BF16)),
    ("p=f32,o=bf16", (F32, F32, BF16)),
    ("o=f32,c=bf16", (F32, BF16, F32)),
    # Bare dtype names set all three.
    ("bf16", (BF16, BF16, BF16)),
    ("f16", (F16, F16, F16)),
    ("f32", (F32, F32, F32)),
    ("full", (F32, F32, F32)),
    ("float16", (F16, F16, F16)),
])
def test_jmp_grammar(spec, expected):
    policy = get_policy(spec)
    assert dtypes(policy) == expected
    assert policy.name == spec


# Strings jmp accepts. "half" is left out: jmp maps it to bf16 on TPU and f16 elsewhere.
JMP_STRINGS = [
    "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32", "p=f32,c=f16", "p=f32,c=bf16", "c=bf16",
    "c=f16", "o=bf16", "p=bf16", "p=f16,c=bf16", "p=f16,c=bf16,o=f32", "params=float32",
    "params=float32,compute=bfloat16,output=float32", "compute=float16", "output=bfloat16",
    "p=full,c=bf16,o=full", "p=float32,c=float16", "o=f32,c=bf16,p=f32", "c=bf16,p=f16",
    "bf16", "bfloat16", "f16", "float16", "f32", "float32", "full",
]


@pytest.mark.parametrize("spec", JMP_STRINGS)
def test_parse_matches_jmp(spec):
    ours = get_policy(spec)
    theirs = jmp.get_policy(spec)
    assert dtypes(ours) == tuple(jnp.dtype(d) for d in dtypes(theirs))


_JMP_DTYPE_NAMES = ["bf16", "bfloat16", "f16", "float16", "f32", "float32", "full"]
_JMP_KEYS = {"param": ["p", "params"], "compute": ["c", "compute"], "output": ["o", "output"]}


@st.composite
def jmp_specs(draw):
    fields = draw(st.lists(st.sampled_from(sorted(_JMP_KEYS)), min_size=1, max_size=3,
                           unique=True))
    parts = [f"{draw(st.sampled_from(_JMP_KEYS[f]))}={draw(st.sampled_from(_JMP_DTYPE_NAMES))}"
             for f in fields]
    return ",".join(parts)


@settings(max_examples=200, deadline=None)
@given(jmp_specs())
def test_parse_matches_jmp_on_generated_strings(spec):
    theirs = jmp.get_policy(spec)
    assert dtypes(get_policy(spec)) == tuple(jnp.dtype(d) for d in dtypes(theirs))


@pytest.mark.parametrize("spec", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f16", "bf16",
                                  "p=f16,c=bf16,o=f32"])
def test_jmp_policy_object_passes_through(spec):
    jmp_policy = jmp.get_policy(spec)
    policy = get_policy(jmp_policy)
    assert isinstance(policy, Policy)
    assert dtypes(policy) == tuple(jnp.dtype(d) for d in dtypes(jmp_policy))


def test_jmp_policy_built_by_hand_passes_through():
    jmp_policy = jmp.Policy(param_dtype=jnp.float32, compute_dtype=jnp.float16,
                            output_dtype=jnp.bfloat16)
    assert dtypes(get_policy(jmp_policy)) == (F32, F16, BF16)


def test_jaxamp_policy_passes_through_unchanged():
    policy = Policy(jnp.float32, jnp.float16, jnp.bfloat16, overrides={"norm": "f32"})
    assert get_policy(policy) is policy


def test_policy_constructor_accepts_dtype_names():
    policy = Policy("f32", "bf16", "float16")
    assert dtypes(policy) == (F32, BF16, F16)
    for d in dtypes(policy):
        assert isinstance(d, np.dtype)


# --------------------------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------------------------


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown policy 'mixed_float8'") as info:
        get_policy("mixed_float8")
    for accepted in ("mixed_bfloat16", "mixed_float16", "float32", "bfloat16", "auto"):
        assert accepted in str(info.value)


def test_unknown_key():
    with pytest.raises(ValueError, match="unknown key 'x'"):
        get_policy("x=f32")
    with pytest.raises(ValueError, match="unknown key 'q'"):
        get_policy("p=f32,q=bf16")


def test_unknown_dtype_names_the_value_and_lists_accepted_names():
    with pytest.raises(ValueError) as info:
        get_policy("p=f32,c=bf61")
    message = str(info.value)
    assert "'bf61'" in message
    assert "compute" in message
    for accepted in ("f32", "float32", "bf16", "bfloat16", "f16", "float16"):
        assert re.search(rf"\b{accepted}\b", message), accepted


def test_unknown_bare_dtype():
    with pytest.raises(ValueError, match="unknown policy 'bf61'"):
        get_policy("bf61")


@pytest.mark.parametrize("spec", ["", "   "])
def test_empty_string(spec):
    with pytest.raises(ValueError, match="empty policy string"):
        get_policy(spec)


@pytest.mark.parametrize("spec", ["c=bf16,c=f16", "c=bf16,compute=bf16", "p=f32,params=f32",
                                  "o=f32,c=f16,output=f16"])
def test_duplicated_keys(spec):
    with pytest.raises(ValueError, match="duplicated key"):
        get_policy(spec)


@pytest.mark.parametrize("spec", ["p=f32,bf16", "p=f32,", "p=f32,,c=bf16", "c=bf16,o"])
def test_malformed_part(spec):
    with pytest.raises(ValueError, match="malformed part"):
        get_policy(spec)


@pytest.mark.parametrize("dtype, name", [(jnp.int32, "int32"), (jnp.int8, "int8"),
                                         (jnp.bool_, "bool"), (jnp.uint8, "uint8")])
def test_integer_and_bool_compute_dtypes_are_type_errors(dtype, name):
    with pytest.raises(TypeError, match=rf"compute dtype must be floating, got '{name}'"):
        Policy(jnp.float32, dtype, jnp.float32)


@pytest.mark.parametrize("field", ["param_dtype", "output_dtype"])
def test_integer_param_and_output_dtypes_are_type_errors(field):
    kwargs = {field: jnp.int32}
    with pytest.raises(TypeError, match="must be floating, got 'int32'"):
        Policy(**kwargs)


@pytest.mark.parametrize("spec, value", [("c=int8", "int8"), ("p=f32,c=int32", "int32"),
                                         ("o=bool", "bool")])
def test_integer_dtype_names_in_a_string_are_rejected(spec, value):
    # A name that is not a floating dtype name is an unknown dtype (ValueError).
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    assert f"'{value}'" in str(info.value)
    assert "f32" in str(info.value)


@pytest.mark.parametrize("spec", [3, 2.5, None, True, [("p", "f32")]])
def test_non_string_spec_is_a_type_error(spec):
    with pytest.raises(TypeError, match="policy must be a string, a jmp.Policy or a "
                                        "jaxamp.Policy"):
        get_policy(spec)


# --------------------------------------------------------------------------------------------
# Casts.
# --------------------------------------------------------------------------------------------

# 1 + 3 * 2**-9 is exact in f32 and f16 and rounds to 1 + 2**-7 in bf16.
ODD = 1.0 + 3 * 2.0**-9


def _mixed_tree():
    return {
        "f32": jnp.array([1.5, -2.25, ODD], jnp.float32),
        "f16": jnp.array([0.5, ODD], jnp.float16),
        "bf16": jnp.array([3.0, -0.125], jnp.bfloat16),
        "int": jnp.array([1, -7, 2**31 - 1], jnp.int32),
        "bool": jnp.array([True, False]),
        "none": None,
        "python_int": 7,
        "nested": [jnp.array([2.0], jnp.float32), (jnp.array([4], jnp.int32),)],
    }


def _check_non_floating_untouched(out, tree):
    assert out["int"] is tree["int"]
    assert out["bool"] is tree["bool"]
    assert out["none"] is None
    assert out["python_int"] is tree["python_int"]
    assert out["nested"][1][0] is tree["nested"][1][0]
    assert jax.tree.structure(out) == jax.tree.structure(tree)


def test_cast_to_compute_bf16_touches_floating_leaves_only():
    tree = _mixed_tree()
    out = get_policy("mixed_bfloat16").cast_to_compute(tree)
    for key in ("f32", "f16", "bf16"):
        assert out[key].dtype == BF16
    assert out["nested"][0].dtype == BF16
    assert np.asarray(out["f32"], np.float32).tolist() == [1.5, -2.25, 1.0 + 2.0**-7]
    assert np.asarray(out["f16"], np.float32).tolist() == [0.5, 1.0 + 2.0**-7]
    assert np.asarray(out["bf16"], np.float32).tolist() == [3.0, -0.125]
    _check_non_floating_untouched(out, tree)


def test_cast_to_compute_f16_is_exact_for_representable_values():
    tree = _mixed_tree()
    out = get_policy("mixed_float16").cast_to_compute(tree)
    for key in ("f32", "f16", "bf16"):
        assert out[key].dtype == F16
    assert np.asarray(out["f32"], np.float32).tolist() == [1.5, -2.25, ODD]
    assert np.asarray(out["f16"], np.float32).tolist() == [0.5, ODD]
    _check_non_floating_untouched(out, tree)


def test_cast_to_param_and_output():
    tree = _mixed_tree()
    policy = Policy(jnp.float32, jnp.bfloat16, jnp.float16)
    params = policy.cast_to_param(tree)
    outputs = policy.cast_to_output(tree)
    for key in ("f32", "f16", "bf16"):
        assert params[key].dtype == F32
        assert outputs[key].dtype == F16
    assert np.asarray(params["f16"]).tolist() == [0.5, ODD]
    assert np.asarray(params["bf16"]).tolist() == [3.0, -0.125]
    _check_non_floating_untouched(params, tree)
    _check_non_floating_untouched(outputs, tree)


def test_cast_under_jit():
    policy = get_policy("mixed_bfloat16")
    out = jax.jit(policy.cast_to_compute)({"x": jnp.array([ODD]), "n": jnp.array([3])})
    assert out["x"].dtype == BF16
    assert out["n"].dtype == jnp.int32
    assert np.asarray(out["x"], np.float32).tolist() == [1.0 + 2.0**-7]


# --------------------------------------------------------------------------------------------
# Per-parameter overrides.
# --------------------------------------------------------------------------------------------


def _params():
    return {
        "layers": [
            {"norm": {"scale": jnp.array([ODD, 1.0], jnp.float32)},
             "dense": {"kernel": jnp.array([[ODD, -2.0]], jnp.float32)}},
            {"norm": {"scale": jnp.array([0.5], jnp.float32)},
             "dense": {"kernel": jnp.array([[ODD]], jnp.float32)}},
        ],
        "count": jnp.array(3, jnp.int32),
    }


def test_tree_path_str():
    paths = [tree_path_str(path) for path, _ in
             jax.tree_util.tree_flatten_with_path(_params())[0]]
    assert paths == ["count",
                     "layers/0/dense/kernel", "layers/0/norm/scale",
                     "layers/1/dense/kernel", "layers/1/norm/scale"]


def test_tree_path_str_with_tuples_and_attributes():
    tree = jaxamp.state.MixedPrecisionState(
        master=Master(params={"w": (jnp.zeros(1),)}), inner_state=(),
        loss_scale=jaxamp.NoOpLossScale(), health=Health.create())
    paths = [tree_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths[0] == "master/params/w/0"


def test_param_compute_dtypes_with_override():
    policy = get_policy("mixed_bfloat16", overrides={r"norm": "float32"})
    assert policy.overrides == (("norm", F32),)
    assert policy.param_compute_dtypes(_params()) == {
        "layers": [
            {"norm": {"scale": F32}, "dense": {"kernel": BF16}},
            {"norm": {"scale": F32}, "dense": {"kernel": BF16}},
        ],
        "count": None,
    }


def test_param_compute_dtypes_without_overrides():
    policy = get_policy("mixed_float16")
    assert policy.param_compute_dtypes({"a": [jnp.zeros(1)], "n": jnp.zeros(1, jnp.int32)}) \
        == {"a": [F16], "n": None}


def test_cast_params_to_compute_with_override():
    params = _params()
    policy = get_policy("mixed_bfloat16", overrides={r"norm": "float32"})
    out = policy.cast_params_to_compute(params)
    layer0, layer1 = out["layers"]
    assert layer0["norm"]["scale"].dtype == F32
    assert layer1["norm"]["scale"].dtype == F32
    assert layer0["dense"]["kernel"].dtype == BF16
    assert layer1["dense"]["kernel"].dtype == BF16
    # The override keeps the fp32 value bit for bit; the bf16 kernel is rounded.
    assert np.asarray(layer0["norm"]["scale"]).tolist() == [ODD, 1.0]
    assert np.asarray(layer0["dense"]["kernel"], np.float32).tolist() == [[1.0 + 2.0**-7, -2.0]]
    assert out["count"] is params["count"]
    assert jax.tree.structure(out) == jax.tree.structure(params)


def test_cast_params_to_compute_under_jit():
    policy = get_policy("mixed_float16", overrides={r"^layers/1/": "bf16"})
    out = jax.jit(policy.cast_params_to_compute)(_params())
    assert jax.tree.map(lambda x: x.dtype, out) == {
        "layers": [
            {"norm": {"scale": F16}, "dense": {"kernel": F16}},
            {"norm": {"scale": BF16}, "dense": {"kernel": BF16}},
        ],
        "count": jnp.dtype(jnp.int32),
    }


def test_cast_to_compute_ignores_overrides():
    policy = get_policy("mixed_bfloat16", overrides={r"norm": "float32"})
    out = policy.cast_to_compute(_params())
    assert out["layers"][0]["norm"]["scale"].dtype == BF16


def test_first_matching_rule_wins():
    first_norm = get_policy("mixed_bfloat16", overrides=[("norm", "f32"), ("layers/0", "f16")])
    assert first_norm.param_compute_dtypes(_params())["layers"] == [
        {"norm": {"scale": F32}, "dense": {"kernel": F16}},
        {"norm": {"scale": F32}, "dense": {"kernel": BF16}},
    ]
    first_layer = get_policy("mixed_bfloat16", overrides=[("layers/0", "f16"), ("norm", "f32")])
    assert first_layer.param_compute_dtypes(_params())["layers"] == [
        {"norm": {"scale": F16}, "dense": {"kernel": F16}},
        {"norm": {"scale": F32}, "dense": {"kernel": BF16}},
    ]


def test_dict_overrides_keep_their_order():
    policy = get_policy("mixed_bfloat16", overrides={"layers/0": "f16", "norm": "f32"})
    assert [p for p, _ in policy.overrides] == ["layers/0", "norm"]
    assert policy.param_compute_dtypes(_params())["layers"][0]["norm"]["scale"] == F16


def test_overrides_use_re_search_on_the_full_path():
    params = _params()
    anchored = get_policy("mixed_bfloat16", overrides={r"^norm": "f32"})
    assert anchored.param_compute_dtypes(params)["layers"][0]["norm"]["scale"] == BF16
    suffix = get_policy("mixed_bfloat16", overrides={r"kernel$": "f16"})
    assert suffix.param_compute_dtypes(params)["layers"][1]["dense"]["kernel"] == F16
    assert suffix.param_compute_dtypes(params)["layers"][1]["norm"]["scale"] == BF16


def test_with_overrides_appends_after_existing_rules():
    policy = get_policy("mixed_bfloat16", overrides={"norm": "f32"})
    more = policy.with_overrides({"norm": "f16", "dense": "f16"})
    assert more.overrides == (("norm", F32), ("norm", F16), ("dense", F16))
    assert more.param_compute_dtypes(_params())["layers"][0] == {
        "norm": {"scale": F32}, "dense": {"kernel": F16}}
    assert policy.overrides == (("norm", F32),)


@pytest.mark.parametrize("pattern", ["(", "[a-", "*norm", "a{2,1}"])
def test_invalid_regex_is_a_value_error(pattern):
    with pytest.raises(ValueError, match="is not a valid regex"):
        get_policy("mixed_bfloat16", overrides={pattern: "f32"})


def test_invalid_override_dtype():
    with pytest.raises(ValueError, match="unknown override dtype 'int8' for pattern 'norm'"):
        get_policy("mixed_bfloat16", overrides={"norm": "int8"})
    with pytest.raises(TypeError, match="override dtype must be floating, got 'int32'"):
        get_policy("mixed_bfloat16", overrides={"norm": jnp.int32})


def test_malformed_override_item():
    with pytest.raises(TypeError, match="overrides must be"):
        Policy(overrides=[("norm", "f32", "extra")])


# --------------------------------------------------------------------------------------------
# Hashing, static fields and str().
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [
    get_policy("mixed_bfloat16"),
    get_policy("mixed_float16", overrides={"norm": "f32", "embed": "bf16"}),
    Policy(jnp.bfloat16, jnp.float16, jnp.float32),
])
def test_policy_is_hashable_and_equal_copies_hash_equal(policy):
    copy = dataclasses.replace(policy)
    assert copy == policy
    assert hash(copy) == hash(policy)
    assert {policy: 1}[copy] == 1


def test_policies_with_different_dtypes_differ():
    assert get_policy("mixed_bfloat16") != get_policy("mixed_float16")
    assert get_policy("mixed_bfloat16") != get_policy("mixed_bfloat16", overrides={"n": "f32"})


def test_policy_is_frozen():
    policy = get_policy("mixed_bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = F16


@struct.dataclass
class _Holder:
    x: jax.Array
    policy: Policy = struct.field(pytree_node=False)


def test_policy_as_a_static_pytree_field():
    policy = get_policy("mixed_bfloat16", overrides={"norm": "f32"})
    holder = _Holder(jnp.array([ODD], jnp.float32), policy)
    leaves, treedef = jax.tree.flatten(holder)
    assert len(leaves) == 1
    assert jax.tree.unflatten(treedef, leaves).policy is policy

    @jax.jit
    def step(h):
        return h.replace(x=h.policy.cast_to_compute(h.x))

    out = step(holder)
    assert out.policy == policy
    assert out.x.dtype == BF16
    assert np.asarray(out.x, np.float32).tolist() == [1.0 + 2.0**-7]


def test_policy_as_a_static_jit_argument():
    f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), get_policy("mixed_float16")).dtype == F16
    assert f(jnp.ones(2), get_policy("mixed_bfloat16")).dtype == BF16


@pytest.mark.parametrize("spec", ["float32", "bfloat16", "mixed_bfloat16", "mixed_float16",
                                  "p=f32,c=f16", "c=bf16", "p=bf16,c=f16,o=f32", "f16",
                                  "params=float32,compute=bfloat16,output=float32"])
def test_str_round_trips(spec):
    policy = get_policy(spec)
    text = str(policy)
    assert re.fullmatch(r"p=(f32|bf16|f16),c=(f32|bf16|f16),o=(f32|bf16|f16)", text)
    again = get_policy(text)
    assert dtypes(again) == dtypes(policy)
    assert str(again) == text


def test_str_values():
    assert str(get_policy("mixed_bfloat16")) == "p=f32,c=bf16,o=f32"
    assert str(get_policy("mixed_float16")) == "p=f32,c=f16,o=f32"
    assert str(get_policy("bfloat16")) == "p=bf16,c=bf16,o=bf16"
    assert str(get_policy("mixed_bfloat16", overrides={"norm": "f32"})) == \
        "p=f32,c=bf16,o=f32 overrides='norm':f32"


def test_name_does_not_change_equality_or_hash():
    # ``name`` only records where a policy came from: the same dtypes make the same policy
    # (and so the same treedef when it is a static field of a train state).
    preset = get_policy("mixed_bfloat16")
    parsed = get_policy(str(preset))
    assert preset.name != parsed.name
    assert preset == parsed
    assert hash(preset) == hash(parsed)
    assert get_policy("auto") == get_policy("float32")
    holder = _Holder(jnp.zeros(1), preset)
    assert jax.tree.structure(holder) == jax.tree.structure(holder.replace(policy=parsed))
