"""A backend wrapper that records every driver call made through it, in order (the
allocator tests check which calls a path makes; cudalab.testing.count_calls counts calls
made through the process's backend instead)."""

from __future__ import annotations

__all__ = ["CountingBackend"]


class CountingBackend:
    """Wraps a backend and counts every driver call made through it."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def wrapper(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return wrapper
