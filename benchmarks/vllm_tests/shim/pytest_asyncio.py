"""A minimal stand-in for pytest-asyncio (not installed here): ``@pytest.mark.asyncio`` tests
run on a fresh event loop each, and ``@pytest_asyncio.fixture`` async fixtures (vLLM's tests
use function-scoped async-generator ones) are entered on that same loop, before the test, and
closed after it."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest

STAND_IN = True  # the shim's conftest registers this module as a plugin only when it is ours


class _AsyncFixture:
    """An async fixture's function and its resolved arguments, entered on the test's loop."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.fn, self.kwargs = fn, kwargs


def fixture(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    def wrap(f: Callable[..., Any]) -> Any:
        @functools.wraps(f)
        def deferred(**resolved: Any) -> _AsyncFixture:
            return _AsyncFixture(f, resolved)

        return pytest.fixture(**kwargs)(deferred)

    return wrap(fn) if fn is not None else wrap


async def _run(test: Callable[..., Any], funcargs: dict[str, Any]) -> None:
    opened: list[Any] = []
    args = dict(funcargs)
    try:
        for name, value in funcargs.items():
            if isinstance(value, _AsyncFixture):
                made = value.fn(**value.kwargs)
                if inspect.isasyncgen(made):
                    opened.append(made)
                    args[name] = await made.__anext__()
                else:
                    args[name] = await made
        await test(**args)
    finally:
        for agen in reversed(opened):
            try:
                await agen.__anext__()
            except StopAsyncIteration:
                pass


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    funcargs = {name: pyfuncitem.funcargs[name] for name in names}
    asyncio.run(_run(pyfuncitem.obj, funcargs))
    return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "asyncio: run the coroutine test on an event loop")
