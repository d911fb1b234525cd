"""A batch queue in its own process, for tests that need two processes, a real signal or a real crash.

    python -m tests._queue_proc OUT CTL N [--gate JOB] [--crash-before JOB] [--crash-between JOB] [--record]
                                [--overwrite] [--tag TEXT] [--elsewhere-wait S]

Jobs j0..j(N-1) write ``OUT/j<i>.mp4`` + ``.json`` through the real temp-and-rename pattern. CTL holds the control
files: ``renders.log`` (one "<pid> <job>" line per render), ``started-<job>`` (touched once the job's temp MP4
exists; with ``--gate`` the render then waits for ``CTL/go``). ``--crash-before`` / ``--crash-between`` end the
process with os._exit(9) (no cleanup, like SIGKILL) after the temp MP4 is written / after the MP4 rename, before
the sidecar. ``--record`` writes the sidecar's MP4 record (`h3render.sidecar.media_record`). Exits with the
report's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from h3render.batch import run_batch


@dataclass(frozen=True)
class Job:
    id: str
    prompt: str
    seed: int
    output: str

    def params(self) -> dict:
        return {"prompt": self.prompt, "seed": self.seed}


class ProcRenderer:
    def __init__(self, args):
        self.args, self.ctl = args, Path(args.ctl)

    def render(self, job, mp4: Path, sidecar: Path) -> dict:
        with open(self.ctl / "renders.log", "a") as f:
            f.write(f"{os.getpid()} {job.id}\n")
        tmp = mp4.with_name(mp4.stem + ".tmp.mp4")
        tmp.write_bytes(f"mp4 {job.prompt} by {os.getpid()} {self.args.tag}".encode())
        (self.ctl / f"started-{job.id}").touch()
        if job.id == self.args.crash_before:
            os._exit(9)
        if job.id == self.args.gate:
            deadline = time.monotonic() + 60
            while not (self.ctl / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        os.replace(tmp, mp4)
        if job.id == self.args.crash_between:
            os._exit(9)
        doc = {"job": job.params()}
        if self.args.record:
            from h3render.sidecar import media_record

            doc["mp4"] = media_record(mp4)
        tmp_json = sidecar.with_name(sidecar.name + ".tmp")
        tmp_json.write_text(json.dumps(doc))
        os.replace(tmp_json, sidecar)
        return {}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ctl")
    p.add_argument("n", type=int)
    p.add_argument("--gate")
    p.add_argument("--crash-before")
    p.add_argument("--crash-between")
    p.add_argument("--record", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--tag", default="")
    p.add_argument("--elsewhere-wait", type=float, default=None)
    args = p.parse_args()
    jobs = [Job(f"j{i}", f"prompt {i}", i, f"j{i}") for i in range(args.n)]
    renderer = ProcRenderer(args)
    report = run_batch(jobs, lambda: renderer, args.out, progress=False, overwrite=args.overwrite,
                       elsewhere_wait_s=args.elsewhere_wait)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
