"""Fault injection: inf and nan in gradients and batches, real fp16 overflows, and a loss that
loss scaling cannot fix, under ``jit`` (an 8-way sharded batch) and ``pmap`` (8 devices).

Every step is checked: a skipped step leaves params, master, optimizer state and rng bit-identical;
the scale used at each step is the one the reference model of ``test_loss_scale`` predicts from
the observed finite/non-finite sequence; and after the faults, training ends at the loss of a
run that never saw them.

As a pytest module it runs a few seeds. As a script it runs more and prints the figures::

    python tests/test_faults.py --seeds 20
"""

import os

# As a script: the 8 virtual CPU devices the test suite runs on (conftest.py sets the same).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from helpers import assert_tree_bitwise_equal  # noqa: E402
from helpers import bits  # noqa: E402
from helpers import init_params  # noqa: E402
from helpers import make_batch  # noqa: E402
from helpers import mse_loss  # noqa: E402
from helpers import reference_sequence  # noqa: E402
from helpers import replicated_sharding  # noqa: E402

import jaxamp  # noqa: E402

N_DEVICES = 8
BATCH = 32  # 4 examples per device
N_BATCHES = 4
N_LEAVES = 4  # dense1/bias, dense1/kernel, dense2/bias, dense2/kernel, in tree order
LEAF_NAMES = ["dense1/bias", "dense1/kernel", "dense2/bias", "dense2/kernel"]
LAYOUTS = ("jit", "pmap")


# --------------------------------------------------------------------------------------------
# The model: test_train_step's MLP, with a hook that adds a batch field to the gradients
# --------------------------------------------------------------------------------------------

@jax.custom_vjp
def _grad_fault(leaf, fault):
    return leaf


def _grad_fault_fwd(leaf, fault):
    return leaf, fault


def _grad_fault_bwd(fault, g):
    # The fault column's sum (0, or the one inf/nan placed in it) is added to the gradient.
    return g + jnp.sum(fault).astype(g.dtype), jnp.zeros_like(fault)


_grad_fault.defvjp(_grad_fault_fwd, _grad_fault_bwd)


def faulty_loss(params, batch):
    """``mse_loss``, with ``batch['fault'][:, j]`` added to the gradient of the j-th param leaf."""
    leaves, treedef = jax.tree.flatten(params)
    leaves = [_grad_fault(x, batch["fault"][:, j]) for j, x in enumerate(leaves)]
    return mse_loss(jax.tree.unflatten(treedef, leaves), batch)


def clean_batches():
    out = []
    for i in range(N_BATCHES):
        batch = make_batch(seed=10 + i, n=BATCH)
        batch["fault"] = np.zeros((BATCH, N_LEAVES), np.float32)
        out.append(batch)
    return out


EVAL_BATCH = {**make_batch(seed=99, n=BATCH), "fault": np.zeros((BATCH, N_LEAVES), np.float32)}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` 'grad' (into a gradient leaf), 'batch' (into an input) or
    'nan_data' (a nan input on every device, which no loss scale can fix)."""

    kind: str
    device: int
    leaf: int
    value: float

    def apply(self, batch):
        out = {k: np.array(v) for k, v in batch.items()}
        row = self.device * (BATCH // N_DEVICES) + 1  # an example on that device
        if self.kind == "grad":
            out["fault"][row, self.leaf] = self.value
        elif self.kind == "batch":
            out["x"][row, self.leaf] = self.value
        else:
            out["x"][:, 0] = np.nan
        return out


def plan_faults(rng, n_clean, n_bursts, max_burst=4):
    """A schedule of ``n_clean`` clean steps with ``n_bursts`` runs of 1 to ``max_burst``
    consecutive faults inserted: a list whose entries are ``None`` or a :class:`Fault`."""
    starts = set(rng.choice(np.arange(2, n_clean - 4), size=n_bursts, replace=False).tolist())
    schedule = []
    for i in range(n_clean):
        if i in starts:
            for _ in range(int(rng.integers(1, max_burst + 1))):
                kind = "grad" if rng.random() < 0.6 else "batch"
                schedule.append(Fault(kind, int(rng.integers(N_DEVICES)),
                                      int(rng.integers(N_LEAVES)),
                                      float(rng.choice([np.inf, -np.inf, np.nan]))))
        schedule.append(None)
    return schedule


# --------------------------------------------------------------------------------------------
# The runner: one step at a time, every step checked
# --------------------------------------------------------------------------------------------

SCALE_FIELDS = ("growth_interval", "growth_factor", "backoff_factor", "min_scale", "max_scale",
                "hysteresis", "hysteresis_refill")


def scale_config(scale):
    return {name: getattr(scale, name) for name in SCALE_FIELDS}


_TX = {}


def make_state(scale, lr=1e-2, stall_after=10):
    # The optimizer is a static field of the state: one object per configuration, so that
    # runs with the same configuration share one compiled step.
    key = (float(scale.loss_scale), tuple(scale_config(scale).items()), lr, stall_after)
    if key not in _TX:
        inner = optax.adamw(optax.cosine_decay_schedule(lr, 200), weight_decay=1e-4)
        _TX[key] = jaxamp.mixed_precision(inner, "mixed_float16", loss_scale=scale,
                                          stall_after=stall_after)
    return jaxamp.TrainState.create(params=init_params(), tx=_TX[key])


_STEPS = {}


def compiled_step(layout):
    if layout not in _STEPS:
        if layout == "pmap":
            _STEPS[layout] = jax.pmap(jaxamp.make_train_step(faulty_loss, axis_name="batch"),
                                      axis_name="batch")
        else:
            _STEPS[layout] = jax.jit(jaxamp.make_train_step(faulty_loss))
    return _STEPS[layout]


def place(layout, state):
    if layout == "pmap":
        return jaxamp.parallel.replicate(state)
    return jax.device_put(state, replicated_sharding())


def put_batch(layout, batch):
    if layout == "pmap":
        return jaxamp.parallel.shard_batch(batch)
    return jaxamp.parallel.put_sharded(batch)


def first(x):
    """The value of a metric or state leaf (device 0's copy under pmap)."""
    return np.asarray(x).reshape(-1)[0]


@dataclasses.dataclass
class Run:
    state: jaxamp.TrainState  # on the host, unreplicated
    scales: list  # the scale used at each step
    finite: list
    first_leaf: list
    nonfinite_leaves: list
    skips_at_min: list
    stalled: list
    losses: list


def _frozen_parts(state):
    """Everything a skipped step must leave bit-identical."""
    mp = jaxamp.state.find_state(state.opt_state)
    return (state.params, mp.master.params, mp.inner_state, mp.health.applied_steps,
            state.model_state, state.rng)


def run(layout, scale, schedule, *, batches=None, next_batch=None, **state_kwargs):
    """Runs one step per ``schedule`` entry: a clean batch, or one with the fault applied.

    The clean batch is ``batches[applied % len(batches)]``, so that skipped steps do not
    consume data and every run applies the same batches in the same order. Checks every
    skipped step bit for bit, and replicas against each other under pmap.
    """
    batches = clean_batches() if batches is None else batches
    step = compiled_step(layout)
    state = place(layout, make_state(scale, **state_kwargs))
    out = Run(None, [], [], [], [], [], [], [])
    for i, fault in enumerate(schedule):
        applied = int(first(jaxamp.state.find_state(state.opt_state).health.applied_steps))
        batch = batches[applied % len(batches)]
        if fault is not None:
            batch = fault.apply(batch)
        before = jax.device_get(_frozen_parts(state))
        state, m = step(state, put_batch(layout, batch))
        m = jax.device_get(m)
        if layout == "pmap":  # every device took the same decision
            for key in ("grads_finite", "loss_scale", "first_nonfinite_leaf", "stalled"):
                assert len(set(np.asarray(m[key]).tolist())) == 1, (i, key)
        out.scales.append(float(first(m["loss_scale"])))
        out.finite.append(bool(first(m["grads_finite"])))
        out.first_leaf.append(int(first(m["first_nonfinite_leaf"])))
        out.nonfinite_leaves.append(int(first(m["nonfinite_leaves"])))
        out.skips_at_min.append(int(first(m["skips_at_min_scale"])))
        out.stalled.append(bool(first(m["stalled"])))
        out.losses.append(float(first(m["loss"])))
        if not out.finite[-1]:
            # A skipped step: params, master, optimizer state (its count too), rng untouched.
            assert_tree_bitwise_equal(jax.device_get(_frozen_parts(state)), before)
    if layout == "pmap":  # and every device holds the same state
        for leaf in jax.tree.leaves(jax.device_get(state)):
            leaf = bits(leaf)
            assert (leaf == leaf[:1]).all()
        state = jaxamp.parallel.unreplicate(state)
    out.state = jax.device_get(state)
    return out


def check_scale_trajectory(result, scale):
    """The scale used at each step, and the final loss-scale state, follow the reference model
    of ``test_loss_scale`` fed with the observed finite/non-finite sequence."""
    ref = reference_sequence(float(scale.loss_scale), result.finite, **scale_config(scale))
    assert result.scales == [float(scale.loss_scale)] + [s for s, _, _ in ref[:-1]]
    final = jaxamp.state.get_loss_scale(result.state.opt_state)
    assert (float(final.loss_scale), int(final.growth_tracker), int(final.hysteresis_left)) \
        == ref[-1]


_EVAL = jax.jit(faulty_loss)


def eval_loss(state):
    """The loss of the working params on a held-out batch."""
    return float(_EVAL(state.params, jaxamp.get_policy("mixed_float16").cast_to_compute(
        EVAL_BATCH)))


# --------------------------------------------------------------------------------------------
# Scenario 1 and 2: inf/nan in gradients and in batches, on a random device, several in a row
# --------------------------------------------------------------------------------------------

N_CLEAN = 30


def injection_scale(rng):
    hysteresis = int(rng.integers(1, 3))
    return jaxamp.DynamicLossScale(
        loss_scale=2.0**10, growth_interval=3, hysteresis=hysteresis,
        hysteresis_refill=str(rng.choice(["growth", "finite"])), min_scale=2.0**4,
        max_scale=2.0**12)


def injected_faults(layout, seed):
    """Runs a faulty and a clean run; checks them; returns the figures."""
    rng = np.random.default_rng(seed)
    scale = injection_scale(rng)
    schedule = plan_faults(rng, N_CLEAN, n_bursts=4)
    faulty = run(layout, scale, schedule)
    clean = run(layout, scale, [None] * N_CLEAN)

    faults = [f for f in schedule if f is not None]
    # Exactly the injected steps are skipped: this scale never overflows on the clean data.
    assert faulty.finite == [f is None for f in schedule]
    assert all(clean.finite)
    for f, leaf, count, loss in zip(schedule, faulty.first_leaf, faulty.nonfinite_leaves,
                                    faulty.losses, strict=True):
        if f is None:
            assert (leaf, count) == (-1, 0)
        elif f.kind == "grad":
            # The diagnosis names the leaf the fault went into, on whichever device.
            assert (leaf, count) == (f.leaf, 1)
            assert np.isfinite(loss)
        else:
            # A nan input makes the loss nan; an inf one may saturate (tanh) to a finite loss,
            # but its gradient (inf * 0) is not finite.
            assert count >= 1 and leaf >= 0
            assert not (np.isnan(f.value) and np.isfinite(loss))
    mp = jaxamp.state.find_state(faulty.state.opt_state)
    assert int(mp.health.skipped_steps) == len(faults)
    assert int(mp.health.applied_steps) == N_CLEAN
    check_scale_trajectory(faulty, scale)
    check_scale_trajectory(clean, scale)
    # After the faults: the loss of the run that never saw them.
    loss_faulty, loss_clean = eval_loss(faulty.state), eval_loss(clean.state)
    np.testing.assert_allclose(loss_faulty, loss_clean, rtol=1e-2)
    for a, b in zip(jax.tree.leaves(faulty.state.master_params),
                    jax.tree.leaves(clean.state.master_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-3)
    bursts, length = [], 0
    for f in schedule + [None]:
        if f is None and length:
            bursts.append(length)
        length = length + 1 if f is not None else 0
    return {"layout": layout, "seed": seed, "faults": len(faults),
            "grad": sum(f.kind == "grad" for f in faults),
            "batch": sum(f.kind == "batch" for f in faults),
            "devices": len({f.device for f in faults}), "longest_burst": max(bursts),
            "skipped": int(mp.health.skipped_steps), "hysteresis": scale.hysteresis,
            "refill": scale.hysteresis_refill, "scale_min": min(faulty.scales),
            "scale_max": max(faulty.scales), "loss_clean": loss_clean,
            "loss_faulty": loss_faulty, "bit_identical_end": all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                    jax.tree.leaves(faulty.state.master_params),
                    jax.tree.leaves(clean.state.master_params), strict=True))}


@pytest.mark.parametrize("layout, seed", [("jit", 0), ("jit", 1), ("pmap", 2)])
def test_injected_infs_and_nans_are_skipped_bit_for_bit(layout, seed):
    figures = injected_faults(layout, seed)
    assert figures["faults"] >= 4 and figures["skipped"] == figures["faults"]


def test_the_fault_plans_cover_every_kind_bursts_and_devices():
    faults = []
    for seed in (0, 1, 2):
        rng = np.random.default_rng(seed)
        injection_scale(rng)
        faults += [f for f in plan_faults(rng, N_CLEAN, n_bursts=4) if f is not None]
    assert {f.kind for f in faults} == {"grad", "batch"}
    assert {str(f.value) for f in faults} == {"inf", "-inf", "nan"}
    assert len({f.device for f in faults}) >= 4
    schedule = plan_faults(np.random.default_rng(0), N_CLEAN, n_bursts=4)
    runs = "".join("x" if f else "." for f in schedule)
    assert "xx" in runs  # several in a row


# --------------------------------------------------------------------------------------------
# Scenario 3: fp16 overflows for real (a scale far too high for the data)
# --------------------------------------------------------------------------------------------

def real_overflow(layout, steps=60):
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**40, growth_interval=3)
    result = run(layout, scale, [None] * steps)
    # The first steps overflow in the fp16 backward pass until the scale fits the data...
    n_first = result.finite.index(True)
    assert n_first >= 10
    assert result.scales[:n_first + 1] == [2.0 ** (40 - k) for k in range(n_first + 1)]
    # ...then growth runs into the fp16 range again and again: real overflows, each backed off.
    later = result.finite[n_first:]
    assert later.count(False) >= 3
    check_scale_trajectory(result, scale)
    mp = jaxamp.state.find_state(result.state.opt_state)
    assert int(mp.health.applied_steps) == result.finite.count(True)
    # Same applied batches as a run whose scale never overflows: the same loss.
    clean = run(layout, jaxamp.DynamicLossScale(loss_scale=2.0**8, growth_interval=10**6),
                [None] * int(mp.health.applied_steps))
    assert all(clean.finite)
    loss, loss_clean = eval_loss(result.state), eval_loss(clean.state)
    np.testing.assert_allclose(loss, loss_clean, rtol=1e-2)
    return {"layout": layout, "steps": steps, "skipped_at_start": n_first,
            "skipped_later": later.count(False), "scale_settled": result.scales[n_first],
            "scale_max_after": max(result.scales[n_first:]), "loss": loss,
            "loss_clean": loss_clean}


def test_real_fp16_overflows_back_off_and_recover():
    real_overflow("jit")


# --------------------------------------------------------------------------------------------
# Scenario 4: a loss that loss scaling cannot fix
# --------------------------------------------------------------------------------------------

STALL_AFTER = 5


def unfixable_nan_data(layout, seed=0, bad_from=6, n_bad=20, n_after=8):
    """From step ``bad_from`` on, every batch holds a nan; later the data is clean again."""
    rng = np.random.default_rng(seed)
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**6, growth_interval=100, min_scale=1.0)
    bad = Fault("nan_data", int(rng.integers(N_DEVICES)), 0, np.nan)
    schedule = [None] * bad_from + [bad] * n_bad + [None] * n_after
    result = run(layout, scale, schedule, stall_after=STALL_AFTER)

    assert result.finite == [f is None for f in schedule]
    # The scale backs off to min_scale (64 -> 1: six halvings), then stays there.
    bad_scales = result.scales[bad_from:bad_from + n_bad]
    assert bad_scales[:7] == [64.0, 32.0, 16.0, 8.0, 4.0, 2.0, 1.0]
    assert set(bad_scales[6:]) == {1.0}
    # Skips at the minimum scale are counted; `stalled` is raised at the STALL_AFTER-th...
    at_min = result.skips_at_min[bad_from:bad_from + n_bad]
    assert at_min == [0] * 6 + list(range(1, n_bad - 5))
    stalled = result.stalled[bad_from:bad_from + n_bad]
    assert stalled == [False] * (6 + STALL_AFTER - 1) + [True] * (n_bad - 5 - STALL_AFTER)
    # ...and every metric says so while the state keeps refusing the update: it never gives up
    # and applies a non-finite update (each skip was checked bit for bit in `run`).
    mp = jaxamp.state.find_state(result.state.opt_state)
    assert int(mp.health.skipped_steps) == n_bad
    assert int(mp.health.applied_steps) == bad_from + n_after
    # Clean data again: the first finite step ends the stall, and training carries on.
    assert result.skips_at_min[bad_from + n_bad:] == [0] * n_after
    assert not any(result.stalled[bad_from + n_bad:])
    assert np.isfinite(eval_loss(result.state))
    check_scale_trajectory(result, scale)
    first_stalled = bad_from + stalled.index(True) + 1
    return {"layout": layout, "bad_steps": n_bad, "steps_to_min_scale": 6,
            "stalled_at_step": first_stalled, "skipped": int(mp.health.skipped_steps)}


def test_nan_data_at_the_minimum_scale_reports_a_stall_and_never_applies():
    unfixable_nan_data("jit")


def unfixable_divergence(steps=30):
    """A learning rate so high that the first update sends the fp16 working params to inf:
    every later step is non-finite in the forward pass, whatever the scale."""
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**3, growth_interval=3, min_scale=1.0)
    result = run("jit", scale, [None] * steps, lr=1e6, stall_after=STALL_AFTER)
    assert result.finite[0] and not any(result.finite[1:])
    assert result.scales[1:5] == [8.0, 4.0, 2.0, 1.0]
    stall_step = result.stalled.index(True)
    assert stall_step == 4 + STALL_AFTER - 1  # skips at scale 1 from step index 4
    assert all(result.stalled[stall_step:])
    mp = jaxamp.state.find_state(result.state.opt_state)
    assert int(mp.health.applied_steps) == 1
    # The fp32 master holds the huge but finite values; the fp16 working copy is inf.
    master = jax.tree.leaves(mp.master.params)
    assert all(np.isfinite(np.asarray(x)).all() for x in master)
    assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state.params))
    path = jaxamp.gradients.nonfinite_leaf_path(result.state.params, result.first_leaf[-1])
    assert path in LEAF_NAMES
    return {"steps": steps, "stalled_at_step": stall_step + 1, "first_nonfinite_leaf": path}


def test_a_diverged_model_stalls_and_names_the_leaf():
    unfixable_divergence()


def test_the_cli_stops_with_an_error_that_names_the_step_and_the_leaf(tmp_path):
    from train import cli
    from train import train as train_lib
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        # A learning rate that sends the fp16 working params to inf on the second step.
        cli.main(["--config", "tiny", "--no-progress", "--workdir", str(workdir),
                  "--task", "synthetic_text", "--model", "gpt_tiny", "--seq-len", "16",
                  "--precision", "mixed_float16", "--lr", "1e8", "--init-scale", "16",
                  "--min-scale", "1", "--stall-after", "3", "--steps", "50",
                  "--checkpoint-every", "2"])
    message = str(info.value.code)
    assert isinstance(info.value.__cause__, train_lib.TrainingStalled)
    # Steps 1-2 apply; scales 16, 8, 4, 2 back off on steps 3-6; 1 is the minimum: steps 7,
    # 8 and 9 skip at it, and the third stops the run.
    assert "training stalled at step 9: 3 consecutive steps (from step 7)" in message
    assert "minimum loss scale 1," in message and "the loss is nan" in message
    ckpt = [_restore_raw(workdir / "checkpoints" / s / "state") for s in ("4", "8")]
    leaf = jaxamp.gradients.nonfinite_leaf_path(ckpt[0]["params"], 0)
    assert f"first non-finite gradient leaf is {leaf!r}" in message
    metrics = train_lib.read_metrics(str(workdir))
    assert list(metrics["step"]) == list(range(1, 10))
    assert list(metrics["grads_finite"]) == [1, 1] + [0] * 7
    assert list(metrics["loss_scale"]) == [16, 16, 16, 8, 4, 2, 1, 1, 1]
    assert list(metrics["skips_at_min_scale"]) == [0] * 6 + [1, 2, 3]
    assert list(metrics["stalled"]) == [0] * 8 + [1]
    # The checkpoints written while it skipped are identical: no update was applied.
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6", "8"]
    assert_tree_bitwise_equal(ckpt[0]["params"], ckpt[1]["params"])
    assert_tree_bitwise_equal(ckpt[0]["opt_state"]["master"]["params"],
                              ckpt[1]["opt_state"]["master"]["params"])
    assert_tree_bitwise_equal(ckpt[0]["opt_state"]["inner_state"],
                              ckpt[1]["opt_state"]["inner_state"])


def _restore_raw(path):
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path)


# --------------------------------------------------------------------------------------------
# As a script: the figures
# --------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"jax {jax.__version__}, {jax.device_count()} devices, batch {BATCH}, "
          f"{N_CLEAN} clean steps per run")
    print("\n1-2. inf/nan injected into gradients and batches, random device, bursts")
    keys = ["layout", "seed", "faults", "grad", "batch", "devices", "longest_burst", "skipped",
            "hysteresis", "refill", "scale_min", "scale_max", "loss_clean", "loss_faulty",
            "bit_identical_end"]
    print(" ".join(f"{k:>10}" for k in keys))
    totals = {"faults": 0, "skipped": 0, "runs": 0, "max_rel": 0.0}
    for layout in LAYOUTS:
        for seed in range(args.seeds):
            fig = injected_faults(layout, seed)
            print(" ".join(f"{fig[k]:>10.5g}" if isinstance(fig[k], float) else f"{fig[k]!s:>10}"
                           for k in keys))
            totals["faults"] += fig["faults"]
            totals["skipped"] += fig["skipped"]
            totals["runs"] += 1
            totals["max_rel"] = max(totals["max_rel"], abs(fig["loss_faulty"] - fig["loss_clean"])
                                    / abs(fig["loss_clean"]))
    print(f"total: {totals['runs']} runs, {totals['faults']} faults injected, "
          f"{totals['skipped']} steps skipped (every one bit-identical), largest relative "
          f"difference of the final loss to the clean run {totals['max_rel']:.2e}")
    print("\n3. real fp16 overflow: initial scale 2**40, growth every 3 steps")
    for layout in LAYOUTS:
        print(real_overflow(layout))
    print(f"\n4. unfixable: nan data (stall_after={STALL_AFTER}, min_scale=1)")
    for layout in LAYOUTS:
        print(unfixable_nan_data(layout))
    print("   unfixable: diverged model (lr 1e6)")
    print(unfixable_divergence())
    print(f"\nall checks passed in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
