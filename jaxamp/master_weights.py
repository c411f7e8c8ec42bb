"""Deprecated: the old path of a private module, whose names ``jaxamp`` exports.

``jaxamp.master_weights`` is removed in the next release."""

from jaxamp import _deprecated

_deprecated.alias(__name__)
