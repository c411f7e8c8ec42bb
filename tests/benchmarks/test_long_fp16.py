"""A short version of ``python -m benchmarks long_fp16``: hundreds of fp16 steps whose dynamic
loss scale grows into real overflows and backs off many times, against the fp32 run. (The
suite's only run in the tests: test_bench.py's tiny runs leave it to this module.)"""

import numpy as np
import pytest
from helpers import reference_sequence

from benchmarks.__main__ import main

# Under pytest-xdist, the tests sharing a module-scoped fixture run on one worker.
# 600 fp16 steps; tests/test_loss_scale.py checks the scale's sequence step by step in `make test`.
pytestmark = [pytest.mark.xdist_group("long_fp16"), pytest.mark.slow]


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_fp16")
    return main(["long_fp16", "--steps", "600", "--growth-interval", "10", "--out",
                 str(out)])["long_fp16"]


def test_the_scale_cycles_and_stays_finite_and_positive(figures):
    fp16 = figures["runs"]["mixed_float16"]
    # Growth every 10 finite steps runs into real fp16 overflows, which back off: many cycles.
    assert figures["growths"] >= 20 and figures["backoffs"] >= 20
    assert figures["skipped_steps"] == figures["backoffs"] == int((~fp16["finite"]).sum())
    assert not figures["scale_ever_zero_inf_or_nan"]
    assert 0 < figures["scale_min"] <= figures["scale_max"] < np.inf
    assert figures["scale_max"] > 2.0**16  # it did grow past the initial scale
    # Only the fp16 run has something to skip.
    assert bool(figures["runs"]["float32"]["finite"].all())


def test_the_scale_trajectory_follows_the_reference_model(figures):
    fp16 = figures["runs"]["mixed_float16"]
    ref = reference_sequence(2.0**16, fp16["finite"].tolist(), **fp16["scale_config"])
    assert fp16["scales"].tolist() == [2.0**16] + [s for s, _, _ in ref[:-1]]
    assert fp16["final_scale"] == ref[-1][0]


def test_the_final_loss_matches_fp32(figures):
    assert np.isfinite(figures["runs"]["mixed_float16"]["losses"]).all()
    np.testing.assert_allclose(figures["eval_loss_fp16"], figures["eval_loss_fp32"], rtol=0.1)
    np.testing.assert_allclose(figures["final_train_loss_fp16"],
                               figures["final_train_loss_fp32"], rtol=0.15)
    assert figures["eval_accuracy_fp16"] >= figures["eval_accuracy_fp32"] - 0.02
    assert figures["eval_accuracy_fp16"] > 0.9
