"""Deprecated: the old path of a private module, whose names ``jaxamp`` exports.

``jaxamp.autocasting`` is removed in the next release."""

from jaxamp import _deprecated

_deprecated.alias(__name__)
