"""`h3render.compile_prefetch`: the compile stack's import runs once, on its own thread; `wait` joins it and says
what went wrong."""

from __future__ import annotations

import sys

import pytest

from h3render import compile_prefetch


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not imported the compile stack nor started the prefetch."""
    monkeypatch.setattr(compile_prefetch, "_thread", None)
    monkeypatch.setattr(compile_prefetch, "_error", None)
    monkeypatch.delitem(sys.modules, compile_prefetch.MODULE, raising=False)


def test_prefetch_imports_once_on_a_thread(fresh, monkeypatch):
    seen = []
    monkeypatch.setattr("builtins.__import__", _recording(seen))
    assert compile_prefetch.start() is True
    assert compile_prefetch.wait() is None
    mine = [t for name, t in seen if name == compile_prefetch.MODULE]
    assert len(mine) == 1 and mine[0].name == "h3render-compile-import"
    assert mine[0] is not compile_prefetch.threading.main_thread()
    assert compile_prefetch.start() is False  # once per process
    assert compile_prefetch.wait() is None and len([n for n, _ in seen if n == compile_prefetch.MODULE]) == 1


def _recording(seen):
    real = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__

    def record(name, *args, **kwargs):
        if name == compile_prefetch.MODULE:
            seen.append((name, compile_prefetch.threading.current_thread()))
            return None  # the real import would cost this test seconds
        return real(name, *args, **kwargs)

    return record


def test_prefetch_is_a_no_op_when_the_stack_is_loaded(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, compile_prefetch.MODULE, object())
    assert compile_prefetch.start() is False
    assert compile_prefetch.wait() is None  # nothing started: returns at once


def test_a_failing_import_is_reported_by_wait(fresh, monkeypatch):
    monkeypatch.setattr(compile_prefetch, "MODULE", "h3render_no_such_module_for_the_test")
    assert compile_prefetch.start() is True
    problem = compile_prefetch.wait()
    assert problem.startswith("the compile stack's background import failed: ModuleNotFoundError")
    assert "h3render_no_such_module_for_the_test" in problem


def test_a_stuck_import_is_reported_after_the_timeout(fresh, monkeypatch):
    release = compile_prefetch.threading.Event()
    monkeypatch.setattr(compile_prefetch, "_import", lambda device: release.wait(5))
    assert compile_prefetch.start() is True
    assert compile_prefetch.wait(timeout=0.05) == (
        "the compile stack's background import was still running after 0 s")
    release.set()
    assert compile_prefetch.wait() is None


def test_a_load_wants_the_import_only_where_the_video_decoder_compiles():
    """`Engine.load` starts the import on CUDA with `compile_vae`, for bf16 runs only: FP8 decoder blocks run their
    fused kernels eagerly (`VideoVAE.compile_pays`), so an FP8 load would import the stack for nothing."""
    assert compile_prefetch.wanted("cuda", True, "bf16")
    assert not compile_prefetch.wanted("cuda", True, "fp8")
    assert not compile_prefetch.wanted("cuda", False, "bf16")
    assert not compile_prefetch.wanted("cpu", True, "bf16")
