"""`with sglang_tokendance.lang.round("r1", 4):`: every gen built inside belongs to round r1
(`simulation="sim-7"` also routes them by that key behind SGLang's router, lang/routing).

The block sets a context variable that `sgl.gen` (lang/gen_options.py) reads when it builds
a gen, so it tags the gens of programs run inside it: `program.run(...)` executes the program
body in the caller's context, and `program.run_batch(...)`, whose worker threads do not
inherit it, runs each body inside the block's round (SGLang's `run_program_batch` wrapped
here, with every other context variable of the caller's, such as lang/routing's simulation
key). A gen that names its own `round` keeps it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from typing import Any, Callable, Iterator

from sglang.lang import interpreter

from sglang_tokendance.lang import routing
from sglang_tokendance.lang.wrapping import wrap_method

_CURRENT: contextvars.ContextVar[tuple[str, int | None] | None] = contextvars.ContextVar(
    "tokendance_round", default=None)


def current_round() -> tuple[str, int | None] | None:
    """(round id, round size) of the enclosing `round(...)` block, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def round(round_id: str, size: int | None = None, simulation: str | None = None) -> Iterator[None]:
    """Tag every gen built inside with `"tokendance": {"round": round_id, "round_size": size}`;
    with `simulation`, also route them by that key (lang/routing's `simulation(...)` block)."""
    token = _CURRENT.set((round_id, size))
    try:
        with routing.simulation(simulation) if simulation is not None else contextlib.nullcontext():
            yield
    finally:
        _CURRENT.reset(token)


def _in_context(func: Callable[..., Any], context: contextvars.Context) -> Callable[..., Any]:
    @functools.wraps(func)
    def body(*args: Any, **kwargs: Any) -> Any:
        return context.copy().run(func, *args, **kwargs)  # one copy per thread: a context runs once at a time

    return body


def _run_program_batch(original: Callable[..., Any], program, *args: Any, **kwargs: Any) -> Any:
    program = copy.copy(program)
    program.func = _in_context(program.func, contextvars.copy_context())
    return original(program, *args, **kwargs)


def install() -> None:
    """Carry the block's round (and the caller's other context) into run_batch's worker threads."""
    wrap_method(interpreter, "run_program_batch", _run_program_batch)
