"""Handles: what every ``..._async`` call returns.

A handle owns its result and its error; nothing is kept in a global map.
``wait(timeout)`` blocks at most ``timeout`` seconds and then raises
:class:`~commlab.base.errors.CommTimeout` naming what it waited for. The blocking
form of every call is ``call_async(...).wait(timeout)``.

A handle is used once: the first ``wait`` that completes keeps the result (or the
error) and every later ``wait`` returns (or raises) that same outcome without
waiting or repeating a side effect (a ``then`` step, an optimizer update). Only a
wait that ran out of time before the work finished leaves the handle open, so the
caller may wait again.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

from commlab.base import errors
from commlab.base.errors import CommError, CommTimeout


class _NotYet(CommTimeout):
    """Raised by a handle's ``_wait`` when its own deadline passed before the work finished."""


class Handle:
    """An operation in flight. ``what`` says, for error messages, what it is.

    Subclasses implement ``_wait(timeout) -> result`` and ``done()``; :meth:`wait` caches.
    Thread-safety: one thread waits on a handle at a time (a second concurrent waiter blocks
    until the first is through, then sees its outcome).
    """

    what: str = "operation"
    _outcome: tuple | None = None  # ("ok", value) or ("error", exception), once known
    _lock: threading.Lock | None = None

    def done(self) -> bool:
        raise NotImplementedError

    def _wait(self, timeout: float) -> Any:
        raise NotImplementedError

    def wait(self, timeout: float) -> Any:
        """Block until done or ``timeout`` seconds pass; return the result or raise its error.
        Waiting again returns the same result (or raises the same error) at once."""
        if self._lock is None:
            self._lock = threading.Lock()
        with self._lock:
            if self._outcome is None:
                try:
                    self._outcome = ("ok", self._wait(timeout))
                except _NotYet as exc:  # the work may still finish: the caller may wait again
                    raise CommTimeout(str(exc)) from None
                except BaseException as exc:
                    self._outcome = ("error", exc)
            kind, value = self._outcome
        if kind == "error":
            raise value
        return value


class DoneHandle(Handle):
    """An operation that finished when it was started."""

    def __init__(self, value: Any = None, what: str = "done"):
        self.what, self._value = what, value

    def done(self) -> bool:
        return True

    def _wait(self, timeout: float) -> Any:
        return self._value


class CallHandle(Handle):
    """Work that runs on the waiting thread, inside the first :meth:`wait`: ``fn(timeout)``.

    For steps whose remaining work (finishing an exchange, an optimizer update) belongs
    on the training thread; ``done()`` is True once it ran."""

    def __init__(self, fn: Callable[[float], Any], what: str):
        self.what, self._fn = what, fn

    def done(self) -> bool:
        return self._outcome is not None

    def _wait(self, timeout: float) -> Any:
        return self._fn(timeout)


class FutureHandle(Handle):
    """Wraps a ``concurrent.futures.Future`` (work running on a communication thread)."""

    def __init__(self, future: cf.Future, what: str, on_timeout: Callable[[], str] | None = None):
        self.what, self._future, self._on_timeout = what, future, on_timeout

    def done(self) -> bool:
        return self._future.done()

    def _wait(self, timeout: float) -> Any:
        try:
            return self._future.result(timeout=timeout)
        except cf.TimeoutError:
            if self._future.done():  # the work itself raised a TimeoutError (CommTimeout is one): pass it on
                raise
            who = self._on_timeout() if self._on_timeout else ""
            raise _NotYet(f"{self.what} did not complete within {timeout:g}s{who}") from None


class WorkHandle(Handle):
    """Wraps a torch.distributed ``Work``; ``on_timeout`` explains who stalled."""

    def __init__(self, work, what: str, on_timeout: Callable[[], str] | None = None, then: Callable[[], Any] | None = None):
        self.what, self._work, self._on_timeout, self._then = what, work, on_timeout, then

    def done(self) -> bool:
        return self._work.is_completed()

    def _wait(self, timeout: float) -> Any:
        try:
            self._work.wait(timeout=timedelta(seconds=timeout))
        except Exception as exc:  # torch raises RuntimeError/DistBackendError for both timeouts and lost peers
            who = self._on_timeout() if self._on_timeout else ""
            cls, text = errors.from_torch(exc)
            if cls is CommTimeout:
                raise CommTimeout(f"{self.what} did not complete within {timeout:g}s{who} ({text})") from exc
            raise cls(f"{self.what} failed{who}: {text}") from exc
        return self._then() if self._then else None


class GroupHandle(Handle):
    """Waits for several handles under one deadline, then runs ``then`` (once)."""

    def __init__(self, handles: Sequence[Handle], what: str, then: Callable[[list], Any] | None = None):
        self.what, self._handles, self._then = what, list(handles), then

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def _wait(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        try:
            results = [h.wait(max(1e-3, deadline - time.monotonic())) for h in self._handles]
        except CommTimeout as exc:
            if not all(h.done() for h in self._handles):
                raise _NotYet(str(exc)) from None
            raise
        return self._then(results) if self._then else results
