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


def test_readme_says_what_autocast_adds_on_its_own_example_and_where_the_trap_is():
    """The sentences after the autocast quickstart, on that exact example without
    ``autocast=True``, and on the NNX GPT they name (``train/models/nnx_gpt.py``)."""
    import jax.numpy as jnp

    import jaxamp
    text = " ".join(README.read_text().split())
    assert ("this example's matmuls are bf16 too, but its cross-entropy's `exp`, `log` and "
            "`reduce_sum` run in bf16") in text
    assert "(the promotion trap: 98% of its matmul FLOPs); autocast runs them all in bf16" in text
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                if "autocast=True" in b and "jaxamp.fp8" not in b]
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    state, batch, loss_fn = namespace["state"], namespace["batch"], namespace["loss_fn"]
    plain = jaxamp.audit(jaxamp.make_train_step(loss_fn), state, batch)
    assert plain.share("bfloat16") == 1.0
    assert {op.primitive for op in plain.half_sensitive_ops} == {"exp", "log", "reduce_sum"}
    assert jaxamp.audit(namespace["step"], state, batch).half_sensitive_ops == []
    # The trap: the NNX GPT's causal mask is fp32.
    from train.models import nnx_gpt
    gpt_loss, params = nnx_gpt.loss_and_params(vocab=64, width=32, depth=1, heads=2, max_len=16)
    tx = jaxamp.mixed_precision(__import__("optax").sgd(0.1), "mixed_bfloat16")
    gpt = jaxamp.TrainState.create(params=params, tx=tx)
    tokens = {"tokens": jnp.zeros((2, 9), jnp.int32)}
    trapped = jaxamp.audit(jaxamp.make_train_step(gpt_loss, warn_fp32_matmuls=False), gpt,
                           tokens)
    assert round(trapped.share("float32"), 2) == 0.98
    assert jaxamp.audit(jaxamp.make_train_step(gpt_loss, autocast=True), gpt,
                        tokens).share("bfloat16") == 1.0


def test_readme_has_only_tested_examples():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 2, "each python block of README.md needs a test here"


def test_readme_links_resolve():
    """Relative links point to files of the repository (the pages of docs/ among them)."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(local) >= 15
    missing = [link for link in local if not (README.parent / link).exists()]
    assert missing == []


def test_readme_reads_in_two_minutes():
    """The reference lives on the site; the README is the front door (about 450 words a minute
    of prose, code and tables skimmed)."""
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    assert len(text.split()) < 900, len(text.split())
