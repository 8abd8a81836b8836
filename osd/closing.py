"""A mixin for objects used as ``with`` blocks that end by calling ``close()``."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

__all__ = ["Closeable"]


class Closeable:
    """``with obj:`` returns ``obj`` and calls ``obj.close()`` on the way out."""

    def close(self) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
