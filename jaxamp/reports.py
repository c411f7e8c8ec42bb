"""The reports of the diagnostics, by name: for an annotation or an ``isinstance`` check.

:func:`jaxamp.audit` and :func:`jaxamp.audit_grad` return an :class:`AuditReport`;
:func:`jaxamp.explain_overflow` returns an :class:`OverflowReport`, whose ``events`` are each
an :class:`OverflowEvent`. A report is read through its attributes, never built by hand.

>>> import jax.numpy as jnp, jaxamp
>>> report = jaxamp.audit(lambda x: x @ x, jnp.ones((2, 2), jnp.bfloat16))
>>> isinstance(report, jaxamp.reports.AuditReport), report.share("bfloat16")
(True, 1.0)
"""

from jaxamp._diagnoses._audit import AuditReport
from jaxamp._diagnoses._overflow import OverflowEvent
from jaxamp._diagnoses._overflow import OverflowReport

__all__ = ["AuditReport", "OverflowEvent", "OverflowReport"]
