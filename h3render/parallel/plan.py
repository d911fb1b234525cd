"""The parallel plan of one engine: what each rank does in a job, decided once at load and handed to the job path.

One rank: the DiT forward is the model itself, the video decode streams locally, this rank decodes the audio and
writes the MP4. Several ranks: the DiT forward is Ulysses over row shards (`parallel.dit.sharded_forward`), the decode
splits its (window x tile) work items (`parallel.vae.decode_stream_split`, frames arrive on rank 0), the last rank
decodes the audio and sends it to rank 0, and rank 0 alone writes. `h3render.render.render_job` reads the same top to
bottom on every rank; only this object differs.
"""

from __future__ import annotations

from typing import Iterator

import torch

from h3render.parallel.groups import ParallelContext


class ParallelPlan:
    """This rank's part of every job.

    Attributes:
        writes: whether this rank writes the MP4 and sidecar (rank 0).
        decodes_audio: whether this rank runs the audio VAE.
        audio_rank: the rank that does.
    """

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx
        self.writes = ctx.is_main
        if ctx.distributed:
            from h3render.parallel.vae import audio_rank

            self.audio_rank = audio_rank(ctx)
        else:
            self.audio_rank = 0
        self.decodes_audio = ctx.rank == self.audio_rank or not ctx.distributed

    def dit_forward(self, dit):
        """The forward of `dit` (a `models.dit.DiT`, applied once per DiT the engine holds): a callable with
        `DiT.forward`'s arguments `(video_rows, audio_rows, text, layout, tables, timestep_index, rope)` returning
        the full `(video_velocity [Nv, 96], audio_velocity [Na, 32])` on every rank. One rank: the model itself;
        several: Ulysses over row shards (`parallel.dit.sharded_forward`)."""
        if not self.ctx.distributed:
            return dit
        from h3render.parallel.dit import sharded_forward

        ctx = self.ctx
        return lambda *args: sharded_forward(dit, ctx, *args)

    def decode_stream(self, vae, latent: torch.Tensor, batch_size: int) -> Iterator[tuple[int, torch.Tensor]]:
        """`(first_frame, frames [3, n, H, W] float in [0, 1])` window by window; on several ranks only rank 0
        receives frames (the others yield their progress and must be drained to the end)."""
        if self.ctx.distributed:
            from h3render.parallel.vae import decode_stream_split

            return decode_stream_split(vae, latent, self.ctx, batch_size)
        return vae.decode_stream(latent, batch_size=batch_size)

    def share_waveform(self, waveform: torch.Tensor | None, shape: tuple[int, int], seconds: float
                       ) -> tuple[torch.Tensor | None, float]:
        """Hand the audio rank's waveform `[2, samples]` and its decode's `seconds` to the writing rank (identity on
        one rank)."""
        if not self.ctx.distributed:
            return waveform, seconds
        from h3render.parallel.vae import share_waveform

        return share_waveform(waveform, shape, self.ctx, seconds)

    def warm_up(self) -> None:
        """Create the point-to-point communicator of the audio hand-over before the first job (several ranks)."""
        if self.ctx.distributed:
            tiny = torch.zeros(2, 8, device=self.ctx.device) if self.decodes_audio else None
            self.share_waveform(tiny, (2, 8), 0.0)
