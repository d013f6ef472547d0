"""Wrapping for the frontend-language extensions: SGLang's frontend has no hooks."""

from __future__ import annotations

import functools
from typing import Any, Callable


def wrap_method(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """Make `owner.name(first, ...)` call `wrapper(original, first, ...)`; once per wrapper.
    `owner` is a class (`first` is self) or a module (`first` is the function's first argument)."""
    original = getattr(owner, name)
    if getattr(original, "_tokendance_wrapper", None) is wrapper:
        return

    @functools.wraps(original)
    def wrapped(first, *args, **kwargs):
        return wrapper(original, first, *args, **kwargs)

    wrapped._tokendance_wrapper = wrapper
    setattr(owner, name, wrapped)
