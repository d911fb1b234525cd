"""Running `h3render` from tests: in-process through click's CliRunner (usage errors, which stop before any weights
load, and renders that need no process of their own), or as a real subprocess (exit codes, signals, a fresh
interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

from h3render.cli import cli
from tests._env import REPO, repo_pythonpath


def invoke(*args: str, env: dict | None = None):
    """`h3render ARGS` in this process (no H3RENDER_CHECKPOINT unless `env` sets it); the click Result."""
    return CliRunner().invoke(cli, list(args), env={"H3RENDER_CHECKPOINT": None, **(env or {})})


def one_error_line(result) -> str:
    """The single `h3render: error:` line of a usage error (exit 2, no traceback); returns it."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.stderr.splitlines() if line.startswith("h3render: error")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.output
    return errors[0]


def click_error(result) -> str:
    """click's own usage error (a bad option value): exit 2, one `Error:` line naming the option."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.stderr
    return errors[0]


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": repo_pythonpath(), **(env or {})}
    full_env.pop("H3RENDER_CHECKPOINT", None) if env is None or "H3RENDER_CHECKPOINT" not in env else None
    return subprocess.run([sys.executable, "-m", "h3render.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=600)


@dataclass
class Ran:
    """What `run_here` returns: the fields of `subprocess.CompletedProcess` that the tests read."""

    returncode: int
    stdout: str
    stderr: str


def run_here(*args: str, env: dict | None = None, cwd: Path | None = None) -> Ran:
    """`h3render ARGS` in this process through click's CliRunner, with `run_cli`'s result fields.

    A fresh interpreter spends about 5 s of CPU importing torch and transformers' Qwen3-VL before it renders (and on
    a GPU host it starts CUDA again), which made most of the suite's time; renders that need no process of their own
    run here. Multi-rank runs (`--gpus N`) end their process with `os._exit`, so they stay in `run_cli`. An
    exception that escapes the command is appended to stderr as a traceback, as a subprocess would have printed it.
    `cwd`: the folder relative paths in ARGS are read from (restored afterwards).
    """
    before = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = invoke(*args, env=env)
    finally:
        os.chdir(before)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return Ran(result.exit_code, result.stdout, stderr)
