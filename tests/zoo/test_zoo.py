"""Autocast on third-party model packages as they ship (``make test-zoo``): Google DeepMind's
``recurrentgemma`` (Griffin: its own ``nn.remat`` of every block, scans, a ``custom_vjp``) and
``penzai``'s Llama-like transformer (named axes, params unbound with ``pz.unbind_params``),
unedited, at tiny sizes, under ``make_train_step(autocast=True)`` in bf16 and fp16.

Each: every matmul FLOP in the compute dtype, forward and backward; no fp32-preferred op left
in half precision; the bytes saved for the backward pass at most 0.6x the fp32 model's; and,
after 60 applied adamw steps on the same batches (fp16's skipped steps, while its loss scale
settles, do not count), a held-out loss within 1% of the fp32 run's, with no warning.
"""

import warnings

import jax
import numpy as np
import optax
import pytest
from models import MODELS
from models import text_batch

import jaxamp

STEPS = 60
POLICIES = ("mixed_bfloat16", "mixed_float16")


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return request.param, MODELS[request.param]()


@pytest.fixture(scope="module")
def fp32_runs():
    return {}


def _train(loss_fn, params, policy: str) -> tuple[float, int]:
    """``(held-out loss of the master params, skipped steps)`` after ``STEPS`` applied steps,
    the batch of each applied step the same whatever the policy."""
    tx = jaxamp.mixed_precision(optax.adamw(3e-3), policy)
    state = jaxamp.TrainState.create(params=params, tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=policy != "float32"))
    applied = skipped = 0
    while applied < STEPS:
        state, m = step(state, text_batch(seed=1 + applied))
        if bool(m["grads_finite"]):
            applied += 1
        else:
            skipped += 1
            assert skipped <= 20, "the loss scale did not settle"
    held_out = text_batch(seed=10_000)
    return float(jax.jit(loss_fn)(state.master_params, held_out)), skipped


@pytest.mark.parametrize("policy", POLICIES)
def test_every_matmul_in_half_nothing_sensitive_in_half_and_less_saved(model, policy):
    _, (loss_fn, params, batch) = model
    p = jaxamp.get_policy(policy)
    fp32 = jaxamp.audit_grad(loss_fn, params, batch)
    report = jaxamp.audit_grad(jaxamp.autocast(loss_fn, p), p.cast_params_to_compute(params),
                               p.cast_to_compute(batch))
    print(f"\n{model[0]} {policy}: {report.share(p.compute_dtype.name):.1%} of matmul FLOPs "
          f"in {p.compute_dtype.name}, {len(report.half_sensitive_ops)} sensitive ops in half, "
          f"saved {report.saved_bytes / fp32.saved_bytes:.3f}x fp32's bytes")
    assert report.share(p.compute_dtype.name) == 1.0
    assert report.half_sensitive_ops == []
    assert report.saved_bytes <= 0.6 * fp32.saved_bytes, (report.saved_bytes_by_dtype,
                                                          fp32.saved_bytes)


@pytest.mark.parametrize("policy", POLICIES)
def test_trains_like_fp32(model, policy, fp32_runs):
    name, (loss_fn, params, _) = model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if name not in fp32_runs:
            fp32_runs[name] = _train(loss_fn, params, "float32")[0]
        loss, skipped = _train(loss_fn, params, policy)
    reference = fp32_runs[name]
    print(f"\n{name} {policy}: held-out loss {loss:.4f}, fp32 {reference:.4f} "
          f"({loss / reference - 1:+.3%}), {skipped} skipped steps")
    assert np.isfinite(loss)
    assert abs(loss - reference) <= 0.01 * reference, (loss, reference, skipped)
