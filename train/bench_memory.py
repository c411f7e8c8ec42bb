"""Activation bytes saved for backward, mixed ÷ fp32, for ResNet-50 and BERT-Large.

Traces abstractly (nothing runs): ``jaxamp.audit_grad(...).saved_bytes`` sums JAX's saved
residuals, arguments excluded.

    python -m train.bench_memory
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxamp
from train import models

CASES = {
    "resnet50 (batch 8, 224x224)": ("resnet50", lambda: {
        "image": jax.ShapeDtypeStruct((8, 224, 224, 3), jnp.float32),
        "label": jax.ShapeDtypeStruct((8,), jnp.int32)}),
    "bert_large (batch 8 x 128)": ("bert_large", lambda: {
        "tokens": jax.ShapeDtypeStruct((8, 128), jnp.int32),
        "targets": jax.ShapeDtypeStruct((8, 128), jnp.int32)}),
}


def saved(name: str, policy: str, batch) -> jaxamp.AuditReport:
    model = models.build(name, policy)  # params are created for real (fp32)
    graphdef, params, model_state = models.split(model)
    params = jaxamp.get_policy(policy).cast_params_to_compute(params)
    batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in batch.items()}
    if model_state is not None:
        loss = models.classification_loss(graphdef)

        def loss_fn(p, b):
            return loss(p, b, model_state=model_state)[0]
    else:
        mlm = models.mlm_loss(graphdef)

        def loss_fn(p, b):
            return mlm(p, b)[0]
    return jaxamp.audit_grad(loss_fn, params, batch)


def main():
    print("| model | fp32 MB | mixed_bfloat16 MB | mixed / fp32 | fp32 left in mixed |")
    print("|---|---:|---:|---:|---|")
    for label, (name, batch) in CASES.items():
        f32 = saved(name, "float32", batch())
        bf16 = saved(name, "mixed_bfloat16", batch())
        left = bf16.saved_bytes_by_dtype.get("float32", 0)
        print(f"| {label} | {f32.saved_bytes / 1e6:.1f} | {bf16.saved_bytes / 1e6:.1f} | "
              f"{bf16.saved_bytes / f32.saved_bytes:.3f} | {left / 1e6:.2f} MB "
              f"({100 * left / bf16.saved_bytes:.2f}%) |")
        del f32, bf16


if __name__ == "__main__":
    main()
