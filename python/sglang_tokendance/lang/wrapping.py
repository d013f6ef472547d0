"""Method wrapping for the frontend-language extensions: SGLang's frontend has no hooks."""

from __future__ import annotations

import functools
from typing import Any, Callable


def wrap_method(cls: type, name: str, wrapper: Callable[..., Any]) -> None:
    """Make `cls.name(self, ...)` call `wrapper(original, self, ...)`; once per wrapper."""
    original = getattr(cls, name)
    if getattr(original, "_tokendance_wrapper", None) is wrapper:
        return

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    wrapped._tokendance_wrapper = wrapper
    setattr(cls, name, wrapped)
