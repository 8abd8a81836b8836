"""Errors that carry what was wrong as data, so callers never parse a message's text.

A :class:`ParamError` names the request parameter whose value is refused; a server answers it
with a 400 whose ``param`` is that name (OpenAI's error body), and a library caller can read it
the same way. It is a ``ValueError``, so code that catches those keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ParamError"]


class ParamError(ValueError):
    """A request parameter's value is refused.

    Args:
        param: the parameter's name as a request spells it (e.g. ``"top_p"``).
        message: what is wrong, naming the parameter and the bad value.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles (e.g. across Ray) with both arguments; the default would pass the message alone.
        return type(self), (self.param, str(self))
