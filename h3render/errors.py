"""Errors of the job path that every layer may name (torch-free, so the front end can catch them by class)."""

from __future__ import annotations


class RenderError(RuntimeError):
    """A job could not produce a valid MP4 (non-finite latents, frames or audio; a job this checkpoint or engine
    cannot run). The job fails alone; the queue goes on."""
