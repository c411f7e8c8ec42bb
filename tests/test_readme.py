"""The README's usage example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    metrics = namespace["metrics"]
    assert set(metrics) >= {"loss", "loss_scale", "grads_finite", "skipped_steps", "grad_norm",
                            "nonfinite_leaves"}
    assert int(namespace["state"].step) == 20


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block.splitlines()[0].startswith("make demo")
    assert first_block.splitlines()[1].startswith("make test")


def test_readme_autocast_quickstart_runs():
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if "autocast=True" in b and "jaxamp.fp8" not in b]
    assert len(blocks) == 1, "README.md has no autocast quickstart"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    state, step, batch = namespace["state"], namespace["step"], namespace["batch"]
    assert int(state.step) == 10
    import jaxamp
    assert jaxamp.audit(step, state, batch).share("bfloat16") >= 0.99


def test_readme_sharded_state_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    sharded = [b for b in blocks if "jaxamp.state_sharding(" in b]
    assert len(sharded) == 1, "README.md has no sharded-state example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102  (state, batch, loss_fn)
    exec(compile(sharded[0], str(README), "exec"), namespace)  # noqa: S102
    import jax

    import jaxamp
    state = namespace["state"]
    assert int(state.step) == 21 and float(namespace["metrics"]["loss"]) > 0
    master = jaxamp.find_state(state.opt_state).master_params["w1"]
    assert master.sharding.spec == jax.sharding.PartitionSpec(None, "batch")   # (64, 128)
    assert master.addressable_shards[0].data.shape == (64, 16)


def test_readme_fp8_example_runs():
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if "jaxamp.fp8.Linear" in b]
    assert len(blocks) == 1, "README.md has no FP8 example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    import jaxamp
    state = namespace["state"]  # the delayed recipe's, after 10 steps
    assert int(state.step) == 10 and bool(namespace["metrics"]["grads_finite"])
    metas = jaxamp.fp8.find_fp8_states(state.model_state)
    assert len(metas) == 2 and all(float(m.amax_history[0, 9]) > 0 for m in metas)
