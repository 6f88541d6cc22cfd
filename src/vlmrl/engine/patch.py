"""`replaced(obj, name, value)`: an attribute replaced for the duration of a block and put back exactly: the
instance's own attribute again, or none, so that the class's shows through. The rollout engine and its
benchmark plugins wrap model methods this way (`generate`, `prepare_inputs_for_generation`, `get_compiled_call`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def replaced(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` is `value` inside the block; afterwards the instance's own attribute again, or none.

    >>> class A:
    ...     def f(self): return "class"
    >>> a = A()
    >>> with replaced(a, "f", lambda: "block"):
    ...     a.f()
    'block'
    >>> a.f(), "f" in vars(a)
    ('class', False)
    """
    own = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)
