"""autocast against JAX's own primitive test harnesses (``benchmarks/conformance.py``).

`make test` runs one harness of every group (the group's first eligible harness in CRC32 order
of the names: deterministic) under ``mixed_bfloat16`` and ``mixed_float16``, with its floating
inputs as given and made by a matmul, forward and VJP, against the same function in plain fp32;
`make test-all` runs the whole corpus (about 10 minutes on 2 cores). A row that does not hold
must be listed below, with why; a listed row that holds must be removed from the list.
"""

import functools
import json

import numpy as np
import pytest

import jaxamp
from benchmarks import conformance
from benchmarks.__main__ import main

pytestmark = pytest.mark.xdist_group("conformance")

BF16, FP16 = "mixed_bfloat16", "mixed_float16"
INPUTS, MATMUL = "inputs", "matmul"  # the floating inputs as given; made by an fp32 matmul

# The rows of the one-harness-per-group sample that do not hold yet: (group, policy, mode) ->
# why, one line each. Remove an entry when autocast is fixed: test_the_known_list_has_no_stale_
# entry fails until it is. `python -m benchmarks conformance --per-group 1 --groups '^pad$'`
# reruns a group and prints each failure's first line. An entry reads
#     ("random_gamma", FP16, MATMUL): "differs: the gamma sampler runs in fp16",
# Before autocast's fixes of these findings (the random_gamma rule, a negative integer_pow in
# fp32, a pad's transpose summed in fp32, a complex matmul promoted, a function that types only
# with its own half dtypes traced with them) the sample's list held reduce and
# reduce_window_mul (inputs, both policies: "TypeError: reduce operand dtypes should match
# corresponding initial value dtypes") and random_gamma (fp16, matmul: 28x the tolerance).
KNOWN: dict[tuple[str, str, str], str] = {
}

# The whole corpus's rows that do not hold yet, beyond the sample's, in the same form;
# test_the_whole_corpus_holds_but_the_known (slow, about 10 minutes) reads both lists.
KNOWN_CORPUS: dict[tuple[str, str, str], str] = {
}


@pytest.fixture(scope="module")
def sample():
    harnesses = conformance.select(conformance.corpus(), per_group=1)
    return conformance.run_all(harnesses)


def _failing(rows) -> dict[tuple[str, str, str], list[dict]]:
    out: dict[tuple[str, str, str], list[dict]] = {}
    for r in conformance.failures(rows):
        out.setdefault((r["group"], r["policy"], r["mode"]), []).append(r)
    return out


def _show(rows) -> str:
    return "\n".join(f"  {r['group']}/{r['harness']} {r['policy']} {r['mode']}: {r['outcome']}"
                     f" ({r.get('stage')}) {r['reason']}" for r in rows)


def test_the_sample_has_one_harness_of_every_group(sample):
    groups = {h.group_name for h in conformance.corpus()}
    assert {r["group"] for r in sample} == groups
    assert len(sample) == 4 * len(groups)  # 2 policies x 2 modes
    ran = [r for r in sample if r["outcome"] != "skipped"]
    # Every group with floating inputs runs (115 of 132 groups in jax 0.10.2).
    assert len({r["group"] for r in ran}) > 100
    for r in ran:
        assert r["outcome"] in ("holds", "differs", "raises")
        if r["outcome"] != "raises":
            assert r["ratio"] >= 0 and r["max_rel_err"] >= 0 and r["vjp"]


def test_every_sampled_harness_holds_but_the_known(sample):
    unknown = [r for key, rows in _failing(sample).items() if key not in KNOWN for r in rows]
    assert not unknown, ("rows that do not hold and are not in KNOWN:\n" + _show(unknown))


def test_the_known_list_has_no_stale_entry(sample):
    failing = _failing(sample)
    by_key = {(r["group"], r["policy"], r["mode"]): r for r in sample}
    stale = {key: by_key.get(key, {}).get("outcome", "not in the sample") for key in KNOWN
             if key not in failing}
    assert not stale, f"KNOWN entries that now hold (remove them): {stale}"


def test_the_suite_writes_a_row_per_harness_policy_and_mode(tmp_path, capsys):
    result = main(["conformance", "--groups", "^(exp|sort|and)$", "--per-group", "2",
                   "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "conformance.jsonl").read_text()
            .splitlines()]
    assert rows == [{"suite": "conformance", **r} for r in
                    json.loads(json.dumps(result["conformance"]["conformance"], default=str))]
    assert len(rows) == 3 * 2 * 4
    assert {r["outcome"] for r in rows if r["group"] == "and"} == {"skipped"}
    assert {r["outcome"] for r in rows if r["group"] != "and"} == {"holds"}
    printed = capsys.readouterr().out
    assert "| exp | 8 | 0 | 0 | 0 |" in printed and "| and | 0 | 0 | 0 | 8 |" in printed


def test_compare_bounds_errors_by_the_half_dtypes_rounding():
    eps = 2.0 ** -7
    ref = np.array([1.0, -2.0, 0.0, np.nan, np.inf])
    within = ref + np.array([conformance.C * eps * 2.9, 0, 0, 0, 0])  # |r| + max|r| = 3
    assert conformance.compare([within], [ref], eps)["ratio"] <= 1
    beyond = ref + np.array([conformance.C * eps * 3.1, 0, 0, 0, 0])
    assert conformance.compare([beyond], [ref], eps)["ratio"] > 1
    for bad in ([1.0, -2.0, 0.0, 0.0, np.inf], [1.0, -2.0, 0.0, np.nan, -np.inf],
                [1.0, -2.0, np.inf, np.nan, np.inf]):
        assert conformance.compare([np.array(bad)], [ref], eps)["ratio"] == np.inf
    # An infinity where the reference is beyond the half range is that range's rounding.
    over = conformance.compare([np.array([np.inf])], [np.array([7e4])], 2.0 ** -10, 65504.0)
    assert over["ratio"] == 0 and over["overflows"] == 1
    # Integers agree exactly, but for indices swapped between equal values (top_k's).
    values = np.array([3.0, 3.0, 1.0])
    got = conformance.compare([values, np.array([1, 0, 2])], [values, np.array([0, 1, 2])], eps)
    assert got["ratio"] == 0 and got["tie_swaps"] == 2
    got = conformance.compare([values, np.array([0, 2, 1])], [values, np.array([0, 1, 2])], eps)
    assert got["ratio"] == np.inf


def _harness(group: str, name: str):
    return next(h for h in conformance.corpus() if h.group_name == group and h.name == name)


def test_the_check_finds_half_precision_where_it_does_not_belong():
    """A rule override that puts back what autocast's rules keep out of half precision: the
    gamma sampler in fp16 draws another sample; ``x ** -3``'s gradient overflows fp16."""
    gamma = conformance.run_one(
        _harness("random_gamma", "shape_float32_"),
        autocast=functools.partial(jaxamp.autocast, rules={"random_gamma": "promote"}))
    assert {(r["policy"], r["mode"]): r["outcome"] for r in gamma}[(FP16, MATMUL)] == "differs"
    power = conformance.run_one(
        _harness("integer_pow", "dtypes_shape_float32_20_30_y_-3"),
        autocast=functools.partial(jaxamp.autocast, rules={"integer_pow": "promote"}))
    row = {(r["policy"], r["mode"]): r for r in power}[(FP16, MATMUL)]
    assert row["outcome"] == "differs" and row["stage"] == "vjp" and "infinit" in row["reason"]


def test_a_transformation_that_raises_is_a_row_not_a_crash():
    def broken(fn, policy):
        def call(*args):
            raise RuntimeError("no rule for this\nsecond line")
        return call
    rows = conformance.run_one(_harness("exp", "shape_float32_20_20_"), autocast=broken)
    assert [(r["outcome"], r["stage"], r["reason"]) for r in rows] == [
        ("raises", "forward", "RuntimeError: no rule for this")] * 4


@pytest.mark.slow
def test_the_whole_corpus_holds_but_the_known():
    rows = conformance.run_all(conformance.select(conformance.corpus()))
    failing = _failing(rows)
    known = {**KNOWN, **KNOWN_CORPUS}
    unknown = [r for key, rs in failing.items() if key not in known for r in rs]
    assert not unknown, "rows that do not hold and are not known:\n" + _show(unknown)
    stale = sorted(set(known) - set(failing))
    assert not stale, f"known entries that now hold (remove them): {stale}"
