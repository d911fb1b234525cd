"""`h3render.compile_prefetch`: the compile stack's import runs once, on its own thread, and `wait` joins it."""

from __future__ import annotations

import sys

from h3render import compile_prefetch


def test_prefetch_imports_once_on_a_thread(monkeypatch):
    monkeypatch.setattr(compile_prefetch, "_thread", None)
    monkeypatch.delitem(sys.modules, compile_prefetch.MODULE, raising=False)  # as in a new process
    seen = []
    monkeypatch.setattr(compile_prefetch, "_import", lambda: seen.append(compile_prefetch.threading.current_thread()))
    assert compile_prefetch.start() is True
    compile_prefetch.wait()
    assert len(seen) == 1 and seen[0].name == "h3render-compile-import"
    assert seen[0] is not compile_prefetch.threading.main_thread()
    assert compile_prefetch.start() is False  # once per process
    compile_prefetch.wait()
    assert len(seen) == 1


def test_prefetch_is_a_no_op_when_the_stack_is_loaded(monkeypatch):
    monkeypatch.setattr(compile_prefetch, "_thread", None)
    monkeypatch.setitem(sys.modules, compile_prefetch.MODULE, object())
    assert compile_prefetch.start() is False
    compile_prefetch.wait()  # nothing started: returns at once


def test_a_failing_import_is_swallowed_for_the_main_thread_to_raise(monkeypatch):
    monkeypatch.setattr(compile_prefetch, "MODULE", "h3render_no_such_module_for_the_test")
    compile_prefetch._import()  # no exception: the compile in prepare imports again and raises there
