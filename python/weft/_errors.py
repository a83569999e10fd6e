"""weft's exceptions: WeftError (the extension's, a RuntimeError) and its ValueError / TypeError kinds."""
from __future__ import annotations

from . import _weft

WeftError = _weft.WeftError
WeftError.__doc__ = "Everything weft raises: environment and GPU problems, failed device waits (a RuntimeError)."


class WeftValueError(WeftError, ValueError):
    """An argument with a bad value (shape, size, device, layout, alignment, world-size divisibility)."""


class WeftTypeError(WeftError, TypeError):
    """An argument of the wrong kind or dtype."""
