"""Our DiT (native names) vs diffusers 0.42.1 `MiniMaxH3Transformer3DModel` on the same random tiny weights, fp32.

The reference is loaded through diffusers' own converter with `qkv_layout="interleaved"`, so these tests also prove
our native parameter names, the per-head q/k/v row order and the gate-first SwiGLU rows.
"""

import dataclasses

import pytest
import torch

from h3render.models.dit import DiT, timestep_sinusoid
from h3render.models.dit_config import DIT_SMALL, DIT_TINY, DiTConfig
from h3render.packing import step_timesteps, t2va_layout
from h3render.sampling import schedule_timesteps, sigma_schedule
from tests._diffusers_ref import diffusers_transformer, random_dit
from tests._numerics import assert_close, rel_err

TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    dit = random_dit(DIT_TINY, seed=1)
    return dit, diffusers_transformer(dit)


@pytest.fixture(scope="module")
def request_inputs():
    layout = t2va_layout(text_len=6, height=64, width=96, frames=22)  # 42 video rows, 74 audio rows
    g = torch.Generator().manual_seed(3)
    video = torch.randn(layout.num_video_rows, DIT_TINY.video_patch_dim, generator=g)
    audio = torch.randn(layout.num_audio_rows, DIT_TINY.audio_in_channels, generator=g)
    text = torch.randn(layout.text_len, DIT_TINY.text_dim, generator=g)
    return layout, video, audio, text


def reference_forward(ref, layout, video, audio, text, timesteps, index):
    with torch.no_grad():
        out_v, out_a = ref(
            hidden_states=video[None], audio_hidden_states=audio[None], encoder_hidden_states=text[None],
            timestep=timesteps, timestep_indices=index, token_tags=layout.token_tags, position_ids=layout.positions,
            video_indices=layout.video_index, audio_indices=layout.audio_index, text_indices=layout.text_index,
            return_dict=False,
        )
    return out_v[0], out_a[0]


def test_config_from_dict_matches_diffusers_init():
    import inspect

    from diffusers import MiniMaxH3Transformer3DModel

    params = inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters
    names = [p for p in params if p != "self"]
    ours = [f.name for f in dataclasses.fields(DiTConfig) if f.name not in DiTConfig.FASTVIDEO_FIELDS]
    assert ours == names  # plus FastVideo's FastH3 Trim field(s), last
    defaults = DiTConfig()
    for name in names:
        assert getattr(defaults, name) == params[name].default, name
    d = dict(dataclasses.asdict(DIT_TINY), _class_name="MiniMaxH3Transformer3DModel", _diffusers_version="0.42.1")
    d["patch_size"] = [1, 2, 2]
    assert DiTConfig.from_dict(d) == DIT_TINY
    with pytest.raises(ValueError, match="unknown keys"):
        DiTConfig.from_dict({"hidden_size": 64, "num_heads": 4})
    with pytest.raises(ValueError, match="rope_freq_dim"):
        DiTConfig(attention_head_dim=64, rope_freq_dim=16)


def test_rope_tables(models, request_inputs):
    dit, ref = models
    layout = request_inputs[0]
    cos, sin = dit.rope_tables(layout.positions)
    ref_cos, ref_sin = ref.rope(layout.positions)
    assert cos.shape == (layout.seq_len, 6 * DIT_TINY.rope_freq_dim) and cos.dtype == torch.float32
    e = max(rel_err(cos, ref_cos), rel_err(sin, ref_sin))
    print(f"rope rel err {e:.2e}")
    assert e <= TOL


def test_modulation_tables(models):
    dit, ref = models
    ts = torch.tensor([0.0, 0.25, 0.9173], dtype=torch.float32)
    tables = dit.modulation_tables(ts)
    with torch.no_grad():
        temb = ref.time_embedder(ref.time_proj(ts))
        errs = []
        for block, ref_block in zip(tables.blocks, ref.transformer_blocks):
            ref_slots = ref_block.adaln_proj(temb)  # six [K*3, hidden] in diffusers' order
            assert block.shape == (3 * 3, 6, DIT_TINY.hidden_size)
            errs += [rel_err(block[:, j], ref_slots[j]) for j in range(6)]
        shift, scale = ref.norm_out.linear(torch.nn.functional.silu(temb)).chunk(2, dim=-1)
        errs += [rel_err(tables.final[:, 0], shift), rel_err(tables.final[:, 1], scale)]
    print(f"AdaLN tables max rel err {max(errs):.2e}")
    assert max(errs) <= TOL


def test_timestep_sinusoid():
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([0.0, 0.003, 0.5, 1.0])
    ref = get_timestep_embedding(t, 32, flip_sin_to_cos=True, downscale_freq_shift=0)
    assert torch.equal(timestep_sinusoid(t, 32), ref)


def test_token_refiner(models, request_inputs):
    dit, ref = models
    text = request_inputs[3]
    with torch.no_grad():
        ours = dit.token_refiner(dit.condition_proj(text))
        theirs = ref.token_refiner(ref.context_embedder(text)[None])[0]
    assert_close(ours, theirs, TOL, "token refiner")


@pytest.mark.parametrize("video_t,audio_t", [(0.0, 0.0), (0.31, 0.62)])
def test_forward_both_heads(models, request_inputs, video_t, audio_t):
    dit, ref = models
    layout, video, audio, text = request_inputs
    timesteps, index = step_timesteps(layout, video_t, audio_t)
    with torch.no_grad():
        v, a = dit(video, audio, text, layout, dit.modulation_tables(timesteps), index)
    ref_v, ref_a = reference_forward(ref, layout, video, audio, text, timesteps, index)
    ev, ea = rel_err(v, ref_v), rel_err(a, ref_a)
    print(f"forward t=({video_t}, {audio_t}): video rel err {ev:.2e}, audio rel err {ea:.2e}")
    assert v.shape == video.shape and a.shape == audio.shape and v.dtype == torch.float32
    assert ev <= TOL and ea <= TOL


def test_forward_with_schedule_tables_and_dropped_adaln(request_inputs):
    """Tables built once for a whole schedule, AdaLN weights dropped afterwards: same velocities as diffusers."""
    dit = random_dit(DIT_TINY, seed=5)
    ref = diffusers_transformer(dit)
    layout, video, audio, text = request_inputs
    vs, as_ = sigma_schedule(5, 12.0), sigma_schedule(5, 3.0)
    tables = dit.modulation_tables(schedule_timesteps(vs, as_))
    dit.drop_adaln_weights_()
    assert not any("adaln_proj" in k for k in dit.state_dict())
    with pytest.raises(RuntimeError, match="dropped"):
        dit.modulation_tables(torch.zeros(1))
    video_t, audio_t = 1.0 - vs[2], 1.0 - as_[2]
    index = layout.row_timestep_index(tables.index_of(video_t), tables.index_of(audio_t))
    with torch.no_grad():
        v, a = dit(video, audio, text, layout, tables, index)
    ref_v, ref_a = reference_forward(ref, layout, video, audio, text, *step_timesteps(layout, video_t, audio_t))
    ev, ea = rel_err(v, ref_v), rel_err(a, ref_a)
    print(f"schedule tables, dropped AdaLN: video rel err {ev:.2e}, audio rel err {ea:.2e}")
    assert ev <= TOL and ea <= TOL


def test_small_config_forward():
    dit = random_dit(DIT_SMALL, seed=2)
    ref = diffusers_transformer(dit)
    layout = t2va_layout(text_len=9, height=64, width=64, frames=22)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(layout.num_video_rows, 96, generator=g)
    audio = torch.randn(layout.num_audio_rows, 32, generator=g)
    text = torch.randn(layout.text_len, DIT_SMALL.text_dim, generator=g)
    timesteps, index = step_timesteps(layout, 0.5, 0.7)
    with torch.no_grad():
        v, a = dit(video, audio, text, layout, dit.modulation_tables(timesteps), index)
    ref_v, ref_a = reference_forward(ref, layout, video, audio, text, timesteps, index)
    ev, ea = rel_err(v, ref_v), rel_err(a, ref_a)
    print(f"DIT_SMALL forward: video rel err {ev:.2e}, audio rel err {ea:.2e}")
    assert ev <= TOL and ea <= TOL


def test_attention_swap_point(models, request_inputs):
    dit, _ = models
    layout, video, audio, text = request_inputs
    timesteps, index = step_timesteps(layout, 0.2, 0.4)
    tables = dit.modulation_tables(timesteps)
    with torch.no_grad():
        base = dit(video, audio, text, layout, tables, index)
    seen = []

    def spy(q, k, v):
        seen.append(q.shape)
        return torch.zeros_like(q)

    dit.set_attention(spy)
    try:
        with torch.no_grad():
            out = dit(video, audio, text, layout, tables, index)
    finally:
        from h3render.models.dit import sdpa_attention

        dit.set_attention(sdpa_attention, refiner=True)
    H, D = DIT_TINY.num_attention_heads, DIT_TINY.attention_head_dim
    assert seen == [(1, layout.seq_len, H, D)] * DIT_TINY.num_layers  # blocks only, [B, S, H, D]
    assert rel_err(out[0], base[0]) > 1e-2  # the hook really is the attention


def test_bad_rows_raise(models, request_inputs):
    dit, _ = models
    layout, video, audio, text = request_inputs
    timesteps, index = step_timesteps(layout, 0.0, 0.0)
    with pytest.raises(ValueError, match="video_rows"):
        dit(video[:-1], audio, text, layout, dit.modulation_tables(timesteps), index)


def test_bf16_precision_split(request_inputs):
    """Release precision split: fp32 islands stay fp32, the rest bf16; output close to the fp32 model."""
    layout, video, audio, text = request_inputs
    dit32 = random_dit(DIT_TINY, seed=1)
    dit16 = random_dit(DIT_TINY, seed=1).apply_precision_(torch.bfloat16)
    for name, p in dit16.named_parameters():
        fp32 = name.startswith(DiT.FP32_MODULES)
        assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), name
    timesteps, index = step_timesteps(layout, 0.3, 0.6)
    with torch.no_grad():
        v32, a32 = dit32(video, audio, text, layout, dit32.modulation_tables(timesteps), index)
        tables16 = dit16.modulation_tables(timesteps)
        assert tables16.blocks[0].dtype == torch.bfloat16
        v16, a16 = dit16(video, audio, text, layout, tables16, index)
    assert v16.dtype == torch.float32 and a16.dtype == torch.float32
    ev, ea = rel_err(v16, v32), rel_err(a16, a32)
    print(f"bf16 vs fp32: video rel err {ev:.2e}, audio rel err {ea:.2e}")
    assert ev < 5e-2 and ea < 5e-2
