"""`h3render batch --dry-run`: the plan, one line per job (what it renders or skips and why) and a total."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from h3render.jobs import Job
from h3render.outputs import output_paths, path_problem, render_reason
from h3render.spec import Limits


def plan_lines(jobs: list[Job], out_dir: Path | None = None, *, overwrite: bool = False,
               run: dict[str, Any] | None = None, current: dict[str, Any] | None = None,
               limits: Limits | None = None) -> list[str]:
    """One line per job for `--dry-run` (output, canvas, frames and s, steps, packed rows, source) and a total.

    With the checkpoint's `limits`, a job whose duration lies outside what the weights were trained on says so
    (`Job.time_note`).

    With `out_dir`, each line names the job's MP4 path and whether the run would render it or skip it (its outputs
    complete and rendered with these parameters: `outputs.render_reason`), or that it would fail before rendering
    (its folder outside the out dir or blocked, a folder at an output name: `outputs.path_problem`); a skip with
    `current` (the run's `{"checkpoint", "encoder"}` settings, as the batch takes them) also says what the earlier render ran with where
    that differs (`sidecar.rendered_with`), as the real run's log does. `run` (checkpoint, precision, adapter)
    comes first as one line of `key value` pairs, the ones that are None left out.
    """
    def skip_note(sidecar: Path) -> str:
        if current is None:
            return "skip: done"
        from h3render.sidecar import read_sidecar, rendered_with

        earlier = rendered_with(read_sidecar(sidecar), **current)
        return "skip: done" if earlier is None else f"skip: done, {earlier}"

    lines = [] if run is None else ["run: " + ", ".join(f"{k} {v}" for k, v in run.items() if v is not None)]
    out_real = None if out_dir is None else Path(out_dir).resolve()
    for number, job in enumerate(jobs, start=1):
        label = job.output if job.id is None or job.id == job.output else f"{job.id} → {job.output}"
        if out_dir is not None:
            mp4, sidecar = output_paths(out_dir, job)
            reason = render_reason(job, mp4, sidecar, overwrite=overwrite)
            note = skip_note(sidecar) if reason is None else "render: " + reason
            problem = path_problem(mp4, sidecar, out_real)  # the job would fail before its render, alone
            label = f"{label} ({mp4}, {note if problem is None else 'will fail: ' + problem})"
        turbo = any(r.turbo and r.strength != 0 for r in job.loras)
        steps = ("turbo LoRA schedule" if turbo else "adapter schedule") if job.steps is None else \
            f"{job.steps} sigma points"
        if job.lora_set:
            steps += ", LoRAs " + " + ".join(f"{Path(r.given).name}×{r.strength:g}" for r in job.loras if r.strength)
        task = f"fl2va ({', '.join(k.describe() for k in job.keyframes)}), " if job.keyframes else ""
        if job.task == "ref2va":
            task = f"ref2va ({', '.join(r.describe() for r in job.references)}), "
        lines.append(f"[{number}/{len(jobs)}] {label}: {task}{job.canvas_note()}, {job.time_note(limits)}, {job.mode} "
                     f"{steps}, seed {job.seed}, rows video {job.video_rows:,} + audio "
                     f"{job.audio_rows:,} ({job.source})")
    total = sum(job.seconds for job in jobs)
    lines.append(f"{len(jobs)} job(s), {total:.3f} s of video")
    return lines
