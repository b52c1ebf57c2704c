"""Handles: what every ``..._async`` call returns.

A handle owns its result and its error; nothing is kept in a global map.
``wait(timeout)`` blocks at most ``timeout`` seconds and then raises
:class:`~commlab.errors.CommTimeout` naming what it waited for. The blocking
form of every call is ``call_async(...).wait(timeout)``.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

from commlab.errors import CommError, CommTimeout


class Handle:
    """An operation in flight. ``what`` says, for error messages, what it is."""

    what: str

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float) -> Any:
        """Block until done or ``timeout`` seconds pass; return the result or raise its error."""
        raise NotImplementedError


class DoneHandle(Handle):
    """An operation that finished when it was started."""

    def __init__(self, value: Any = None, what: str = "done"):
        self.what, self._value = what, value

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> Any:
        return self._value


class FutureHandle(Handle):
    """Wraps a ``concurrent.futures.Future`` (work running on a communication thread)."""

    def __init__(self, future: cf.Future, what: str, on_timeout: Callable[[], str] | None = None):
        self.what, self._future, self._on_timeout = what, future, on_timeout

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float) -> Any:
        try:
            return self._future.result(timeout=timeout)
        except cf.TimeoutError:
            if self._future.done():  # the work raised CommTimeout (a TimeoutError, as cf's is): keep its culprit
                raise
            who = self._on_timeout() if self._on_timeout else ""
            raise CommTimeout(f"{self.what} did not complete within {timeout:g}s{who}") from None


class WorkHandle(Handle):
    """Wraps a torch.distributed ``Work``; ``on_timeout`` explains who stalled."""

    def __init__(self, work, what: str, on_timeout: Callable[[], str] | None = None, then: Callable[[], Any] | None = None):
        self.what, self._work, self._on_timeout, self._then = what, work, on_timeout, then

    def done(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout: float) -> Any:
        try:
            self._work.wait(timeout=timedelta(seconds=timeout))
        except Exception as exc:  # torch raises RuntimeError/DistBackendError for both timeouts and lost peers
            who = self._on_timeout() if self._on_timeout else ""
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CommTimeout(f"{self.what} did not complete within {timeout:g}s{who} ({text})") from exc
            raise CommError(f"{self.what} failed{who}: {text}") from exc
        return self._then() if self._then else None


class GroupHandle(Handle):
    """Waits for several handles under one deadline, then runs ``then``."""

    def __init__(self, handles: Sequence[Handle], what: str, then: Callable[[list], Any] | None = None):
        self.what, self._handles, self._then = what, list(handles), then

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        results = [h.wait(max(1e-3, deadline - time.monotonic())) for h in self._handles]
        return self._then(results) if self._then else results
