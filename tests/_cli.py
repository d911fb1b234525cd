"""Running `h3render` from tests: in-process through click's CliRunner (usage errors, which stop before any weights
load, and renders that need no process of their own); in a process of its own forked from a server that has
imported torch, transformers and h3render once (exit codes, `os._exit`, multi-rank runs, state that must not leak
between renders); or as a real subprocess of a fresh interpreter (what only a fresh interpreter shows: imports,
`python -m`, signals around start-up)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

from h3render.cli import cli
from tests._env import REPO, repo_pythonpath


def invoke(*args: str, env: dict | None = None):
    """`h3render ARGS` in this process (no H3RENDER_CHECKPOINT unless `env` sets it); the click Result.

    A render here runs on one rank (`--gpus 1` unless ARGS name a count): the CLI uses every visible GPU by default,
    and on a multi-GPU host it then spawned ranks whose output and warnings this runner could not capture (the GPU
    suite on two H200s, 2026-12-04). Forked and subprocess renders keep the default, so such a host still runs them
    on every GPU over NCCL."""
    args = list(args)
    if args[:1] in (["prompt"], ["batch"]) and not any(a == "--gpus" or a.startswith("--gpus=") for a in args):
        args += ["--gpus", "1"]
    return CliRunner().invoke(cli, args, env={"H3RENDER_CHECKPOINT": None, **(env or {})})


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
    return subprocess.run([sys.executable, "-m", "h3render.cli", *args], capture_output=True, text=True,
                          env=_child_env(env), cwd=cwd or REPO, timeout=600)


def _child_env(env: dict | None) -> dict:
    """A child's whole environment: this process's, this checkout importable, `env` on top, and no
    H3RENDER_CHECKPOINT unless `env` sets it."""
    full_env = {**os.environ, "PYTHONPATH": repo_pythonpath(), **(env or {})}
    if env is None or "H3RENDER_CHECKPOINT" not in env:
        full_env.pop("H3RENDER_CHECKPOINT", None)
    return full_env


class Forked:
    """`h3render ARGS` running in a child forked from `tests._spawn`'s server, which has imported torch,
    transformers' Qwen3-VL and h3render and never rendered: the ~6 s of CPU a fresh interpreter spends importing
    them is spent once per test process. The child runs `h3render.cli.main` as `python -m h3render.cli` would: its
    own pid and exit status (`sys.exit` and `os._exit` alike; -N when killed by signal N), Python's default SIGINT
    handler, `env` (on top of this process's, without H3RENDER_CHECKPOINT unless `env` sets it) as its whole
    environment, `cwd` (default: the checkout) as its folder, stdout and stderr in files read back, and with
    `new_session` a session (and process group) of its own, as `subprocess.Popen(start_new_session=True)`."""

    def __init__(self, *args: str, env: dict | None = None, cwd: Path | None = None, new_session: bool = False):
        from tests._spawn import context

        self.args = args
        self._tmp = tempfile.TemporaryDirectory(prefix="h3render-forked-")
        self._streams = (Path(self._tmp.name) / "stdout", Path(self._tmp.name) / "stderr")
        self._proc = context().Process(target=_forked_main, args=(list(args), _child_env(env), str(cwd or REPO),
                                                                  *map(str, self._streams), new_session))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float = 600) -> "Ran":
        """Wait for the exit; its `Ran`. Past `timeout`: kill it (and its process group if it has one of its own)
        and raise `subprocess.TimeoutExpired`."""
        try:
            self._proc.join(timeout)
            if self._proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, 9) if os.getpgid(self.pid) == self.pid else self._proc.kill()
                self._proc.join()
                raise subprocess.TimeoutExpired(["h3render", *self.args], timeout)
            text = [p.read_text(errors="replace") if p.exists() else "" for p in self._streams]  # none: died starting
            return Ran(self._proc.exitcode, *text)
        finally:
            self._tmp.cleanup()


def run_forked(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600) -> "Ran":
    """`h3render ARGS` in a forked child (`Forked`), waited for: the fields `run_cli` returns, at a fraction of
    its CPU."""
    return Forked(*args, env=env, cwd=cwd).wait(timeout)


def _forked_main(args: list[str], env: dict, cwd: str, stdout: str, stderr: str, new_session: bool) -> None:
    """In the forked child: become `python -m h3render.cli ARGS` with this environment, folder and output files."""
    if new_session:
        os.setsid()
    # What a fresh interpreter has: the server may have inherited an ignored SIGINT (a test run in the background).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read once, when the interpreter starts torch
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    sys.stdout.flush(), sys.stderr.flush()
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [str(REPO / "h3render" / "cli.py"), *args]
    from h3render.cli import main

    main()


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
