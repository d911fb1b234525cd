"""Manifest → Job: canvas and time rules, schema errors with lines, output names, presets, shards."""

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from h3render import jobs as J
from h3render.dry_run import plan_lines
from h3render import manifest as M
from h3render import shards as SH
from h3render import spec as S
from h3render.jobs import Job
from h3render.manifest import load_manifest
from h3render.manifest_formats import MAX_NESTING, ManifestError
from h3render.spec import Limits

REPO = Path(__file__).resolve().parents[2]
RELEASED = Limits(min_frames=107, max_frames=362, default_canvas=(1344, 768), default_frames=243, default_steps=50)
TINY = Limits(min_frames=22, max_frames=362, default_canvas=(128, 96), default_frames=39, default_steps=8)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def errors_of(path, limits=RELEASED, overrides=None):
    with pytest.raises(ManifestError) as info:
        load_manifest(path, limits, overrides)
    return info.value.errors


# --- canvas ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("aspect, canvas", [((9, 5), (1376, 768)), ((2, 1), (1440, 704)), ((16, 9), (1344, 768)),
                                            ((9, 16), (768, 1344)), ((4, 3), (1024, 768)), ((1, 1), (768, 768))])
def test_canvas_for_aspect_examples(aspect, canvas):
    assert S.canvas_for_aspect(*aspect) == canvas


def test_canvas_for_aspect_matches_diffusers_over_a_sweep():
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    aspects = [(w, h) for w in range(1, 41) for h in range(1, 41) if 0.25 <= w / h <= 4]
    aspects += [(2.39, 1), (1.85, 1), (1, 4), (4, 1), (21, 9), (3, 2)]
    mismatches = [(w, h) for w, h in aspects
                  if S.canvas_for_aspect(w, h) != resolve_canvas_size(w, h, 32, 768, 768 * 1344)[::-1]]
    print(f"canvas rule: {len(aspects)} aspects compared with diffusers, {len(mismatches)} mismatches")
    assert not mismatches
    # another checkpoint's rule (short edge, area cap) goes through the same arithmetic
    assert S.canvas_for_aspect(16, 9, short_edge=96, max_pixels=96 * 160) == resolve_canvas_size(
        16, 9, 32, 96, 96 * 160)[::-1]


@pytest.mark.parametrize("aspect", [(5, 1), (1, 5), (0, 1), (-16, 9)])
def test_canvas_for_aspect_refuses_out_of_range(aspect):
    with pytest.raises(ValueError, match="aspect"):
        S.canvas_for_aspect(*aspect)


def test_explicit_canvas_rules():
    S.check_canvas(960, 544)
    S.check_canvas(128, 512)  # exactly 1:4
    for width, height, text in [(1000, 544, "width 1000"), (960, 540, "height 540"), (160, 32, "1:4"),
                                (0, 64, "width 0")]:
        with pytest.raises(ValueError, match=text):
            S.check_canvas(width, height)


def test_parse_aspect():
    assert S.parse_aspect("16:9") == (16, 9)
    assert S.parse_aspect(" 2.39 : 1 ") == (2.39, 1)
    for bad in ["16x9", "16:", "0:1", "a:b", "16:9:1"]:
        with pytest.raises(ValueError, match="16:9"):
            S.parse_aspect(bad)


# --- time ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("duration, frames", [(10, 243), (15, 362), (4.46, 107), (4, 107), (10.125, 243),
                                              (5, 124), (15.08, 362), (1, 39)])
def test_snap_duration(duration, frames):
    assert S.snap_frames(duration=duration) == frames


def test_snap_frames_matches_diffusers_alignment():
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        align_num_frames, audio_latent_num_frames, video_latent_num_frames)

    for frames in range(1, 400):
        snapped = S.snap_frames(frames=frames)
        assert snapped == align_num_frames(frames, 17, 5)
        assert S.latent_frames(snapped) == video_latent_num_frames(snapped, 17, 5)
        assert S.audio_rows(snapped) == 2 * audio_latent_num_frames(snapped)
    assert S.snap_frames(frames=107) == 107 and S.snap_frames(frames=108) == 124


def test_snap_limits_and_bad_requests():
    assert S.snap_frames(duration=4.46, limits=RELEASED) == 107
    with pytest.raises(ValueError, match="107–362 frames") as info:
        S.snap_frames(duration=16, limits=RELEASED)
    assert "4.458–15.083 s" in str(info.value)
    with pytest.raises(ValueError, match="107–362"):
        S.snap_frames(frames=90, limits=RELEASED)
    for kwargs in [dict(frames=0), dict(frames=-17), dict(duration=0), dict(duration=-1.0), dict(), dict(frames=5,
                                                                                                       duration=1)]:
        with pytest.raises(ValueError):
            S.snap_frames(**kwargs)


def test_row_counts_at_the_released_canvas():
    assert S.latent_frames(243) == 72
    assert S.video_rows(1344, 768, 243) == 72_576
    assert S.audio_rows(243) == 810


# --- manifests: success paths ----------------------------------------------------------------------------------------

def test_jsonl_and_yaml_give_the_same_jobs(tmp_path):
    jsonl = write(tmp_path, "m.jsonl", """
        # comment lines and blank lines are skipped
        {"defaults": {"seed": 5, "aspect": "1:1"}}

        {"id": "a", "prompt": "A red fox.", "duration": 10}
        {"prompt": "A blue boat.", "width": 960, "height": 544, "frames": 100, "seed": 1, "output": "shots/boat"}
        {"id": "c", "prompt": "Rain.", "preset": "portrait-9x16", "mode": "fasth3"}
    """)
    yml = write(tmp_path, "m.yaml", """
        defaults:
          seed: 5
          aspect: 1:1          # unquoted: YAML 1.1 would read base-60 969; the text is kept
        jobs:
          - id: a
            prompt: A red fox.
            duration: 10
          - prompt: A blue boat.
            width: 960
            height: 544
            frames: 100
            seed: 1
            output: shots/boat.mp4
          - {id: c, prompt: Rain., preset: portrait-9x16, mode: fasth3}
    """)
    a, b = load_manifest(jsonl, RELEASED), load_manifest(yml, RELEASED)
    assert [j.params() for j in a] == [j.params() for j in b]
    assert [j.output for j in a] == [j.output for j in b] == ["a", "shots/boat", "c"]
    first, second, third = a
    assert (first.width, first.height, first.frames, first.seed, first.steps) == (768, 768, 243, 5, 50)
    assert first.time_note() == "10 s → 243 frames = 10.125 s"
    assert (second.width, second.height, second.frames, second.seed) == (960, 544, 107, 1)
    assert second.mp4_path("out") == Path("out/shots/boat.mp4")
    assert second.sidecar_path("out") == Path("out/shots/boat.json")
    assert (third.width, third.height, third.frames, third.steps, third.mode) == (768, 1344, 124, None, "fasth3")
    assert first.source == J.Source(str(jsonl), 4) and b[1].source == J.Source(str(yml), 8)
    assert first.params() == {"prompt": "A red fox.", "seed": 5, "width": 768, "height": 768, "frames": 243,
                              "steps": 50, "mode": "t2va"}


def test_precedence_job_over_command_line_over_defaults_over_limits(tmp_path):
    path = write(tmp_path, "p.yaml", """
        defaults: {seed: 3, steps: 20, preset: square}
        jobs:
          - {id: plain, prompt: x}
          - {id: own, prompt: x, seed: 9, aspect: "16:9", duration: 10}
          - {id: fast, prompt: x, mode: fasth3}
    """)
    plain, own, fast = load_manifest(path, RELEASED)
    assert (plain.seed, plain.steps, plain.width, plain.height, plain.frames) == (3, 20, 768, 768, 124)
    assert plain.requested.preset == "square"
    assert (own.seed, own.width, own.height, own.frames) == (9, 1344, 768, 243)
    assert fast.steps is None  # an inherited steps does not apply to the adapter's distilled schedule
    plain, own, _ = load_manifest(path, RELEASED, {"seed": 11, "steps": None, "frames": 107})
    assert (plain.seed, plain.steps, plain.frames, own.seed, own.frames) == (11, 20, 107, 9, 243)
    bare = M.job_from_fields({"prompt": "x"}, TINY)
    assert (bare.width, bare.height, bare.frames, bare.steps, bare.seed) == (128, 96, 39, 8, J.DEFAULT_SEED)
    assert bare.time_note() == "39 frames = 1.625 s (default)"


# --- manifests: errors name file, line and field --------------------------------------------------------------------

def test_jsonl_errors_are_collected_with_lines(tmp_path):
    path = write(tmp_path, "bad.jsonl", """
        {"id": "a", "prompt": "ok"}
        {"id": "b", "prompt": "x", "seed": "7"}
        {"id": "c", "prompt": "x", "sed": 7}
        {"id": "a", "prompt": "again"}
        {"id": "e", "prompt": "x", "preset": "square", "width": 960}
        {"id": "f", "prompt": "x", "duration": 5, "frames": 124}
        {"id": "g", "prompt": "x", "output": "../escape"}
        {"id": "h", "prompt": "x", "duration": 200}
        {"id": "i", "prompt": "x"
        {"id": "j"}
        {"defaults": {"seed": 1}}
        {"id": "k", "prompt": "x", "width": 1000, "height": 544, "mode": "t2v"}
        {"id": "l", "prompt": "x", "prompt": "y"}
    """)
    errors = errors_of(path)
    print("\n".join(errors))
    expected = [
        (2, "seed: must be an integer"), (3, "sed: unknown field (did you mean seed?)"), (4, "id: duplicate id 'a'"),
        (5, "preset: conflicts with"), (6, "duration: conflicts with frames"), (7, "output: path components"),
        (8, "duration: 200 s is 4800 frames (200 s), longer than the 120 s (2880 frames) h3render renders"),
        (9, "not valid JSON"), (10, "prompt: missing"), (11, "defaults: a defaults line"),
        (12, "width: 1000 is not a positive multiple of 32"), (12, "mode: 't2v' is not one of t2va, fasth3"),
        (13, "prompt: field given twice"),
    ]
    for line, text in expected:
        assert any(e.startswith(f"{path}:{line}: ") and text in e for e in errors), (line, text)
    assert len(errors) == len(expected)
    assert not any(f"{path}:1:" in e for e in errors)


def test_yaml_errors_point_at_the_field_line(tmp_path):
    path = write(tmp_path, "bad.yaml", """
        defaults:
          seed: -1
          prompt: not here
        jobs:
          - id: a
            prompt: ok
          - id: b
            prompt: x
            steps: many
          - id: c
            prompt: x
            colour: red
          - id: a
            prompt: twin
          - id: e
            prompt: x
            width: 960
            preset: square
          - id: f
            prompt: x
            output: /abs/path
          - id: g
            prompt: x
            aspect: "5:1"
          - id: g2
            prompt: x
            prompt: y
          - just a string
    """)
    errors = errors_of(path)
    print("\n".join(errors))
    expected = [
        (2, "seed: -1 is outside"), (3, "prompt: may only be set on a job"), (9, "steps: must be an integer"),
        (12, "colour: unknown field"), (13, "id: duplicate id 'a' (first at"), (18, "preset: conflicts"),
        (21, "output: must be relative"), (24, "aspect: aspect 5:1 is outside"), (27, "prompt: field given twice"),
        (28, "each job must be a mapping"),
    ]
    for line, text in expected:
        assert any(e.startswith(f"{path}:{line}: ") and text in e for e in errors), (line, text)
    assert len(errors) == len(expected)


def test_yaml_syntax_error_and_file_level_errors(tmp_path):
    broken = write(tmp_path, "broken.yaml", """
        jobs:
          - id: a
            prompt: "unterminated
          - id: b
    """)
    [error] = errors_of(broken)
    assert error.startswith(f"{broken}:") and "not valid YAML" in error
    empty = write(tmp_path, "empty.jsonl", "# nothing\n")
    assert errors_of(empty) == [f"{empty}: the manifest has no jobs"]
    # every suffix read is named (a trial: .ndjson and .yml were left out)
    assert errors_of(write(tmp_path, "m.txt", "x"))[0].endswith(
        "unknown manifest type '.txt'; use .jsonl (or .ndjson) or .yaml (or .yml)")
    assert errors_of(tmp_path / "missing.yaml") == [f"{tmp_path / 'missing.yaml'}: manifest not found"]
    wrong_top = write(tmp_path, "top.yaml", "job:\n  - prompt: x\n")
    assert any("top.yaml:1: job: unknown top-level key (did you mean jobs?)" in e for e in errors_of(wrong_top))
    far_top = write(tmp_path, "far.yaml", "renders:\n  - prompt: x\n")
    assert any("far.yaml:1: renders: unknown top-level key; expected defaults and jobs" in e for e in errors_of(far_top))


def test_yaml_anchors_and_merges(tmp_path):
    path = write(tmp_path, "a.yaml", """
        x-wide: &wide {aspect: "2:1", seed: 4}
        jobs:
          - <<: *wide
            id: one
            prompt: first
          - <<: *wide
            id: two
            prompt: second
            seed: 5
    """)
    one, two = load_manifest(path, RELEASED)
    assert (one.width, one.height, one.seed, two.seed, two.source.line) == (1440, 704, 4, 5, 6)


def test_command_line_defaults_are_validated(tmp_path):
    path = write(tmp_path, "ok.jsonl", '{"prompt": "x"}\n')
    errors = errors_of(path, overrides={"seed": "1", "output": "x"})
    assert "<command line>: seed: must be an integer, got a string" in errors
    assert "<command line>: output: may only be set on a job, not in defaults" in errors


def test_fasth3_refuses_its_own_steps(tmp_path):
    path = write(tmp_path, "f.jsonl", '{"prompt": "x", "mode": "fasth3"}\n'
                                      '{"prompt": "y", "mode": "fasth3", "steps": 5}\n')
    [error] = errors_of(path)
    assert error.startswith(f"{path}:2: steps: mode fasth3 runs the FastH3 adapter's fixed distilled schedule")


# --- output names -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("output", ["../x", "a/../../b", "/etc/passwd", "C:/x", "c:x", "a\\b", "a//b", "./a", "",
                                    "a/", "batch-report", "Batch-Report.shard-0-of-2", "con", "a\nb", "~/x"])
def test_output_paths_that_escape_or_break_are_refused(tmp_path, output):
    assert J.output_path_problem(output) is not None
    path = tmp_path / "o.jsonl"
    path.write_text(json.dumps({"prompt": "x", "output": output}) + "\n", encoding="utf-8")
    [error] = errors_of(path)
    assert error.startswith(f"{path}:1: output: ")


def test_id_that_is_not_a_safe_name_needs_an_output(tmp_path):
    path = write(tmp_path, "i.jsonl", '{"id": "../up", "prompt": "x"}\n{"id": "../ok", "prompt": "x", "output": "ok"}\n')
    [error] = errors_of(path)
    assert error.startswith(f"{path}:1: id: cannot serve as the output name")


def test_long_non_ascii_prompts_get_safe_short_unique_names(tmp_path):
    long_prompt = ("Ein älterer Fischer flüstert: «Ça va très bien», während die Möwen über dem Hafen kreisen — " * 6
                   + "終わり")
    path = tmp_path / "n.jsonl"
    lines = [{"prompt": long_prompt}, {"prompt": long_prompt}, {"prompt": long_prompt, "seed": 3},
             {"prompt": "東京の夜、雨のネオン街を歩く女性。"}, {"prompt": "東京の朝。"},
             {"prompt": "Sunset", "output": "sunset-s0"}, {"prompt": "Sunset"}, {"prompt": "SUNSET!"},
             {"prompt": "line\u2028separator", "seed": 1}]
    path.write_text("\n".join(json.dumps(line, ensure_ascii=False) for line in lines), encoding="utf-8")
    jobs = load_manifest(path, RELEASED)
    names = [job.output for job in jobs]
    print(names)
    for name in names:
        assert name.isascii() and len(name.encode()) <= J.MAX_AUTO_NAME_BYTES and J.output_path_problem(name) is None
    assert len({n.casefold() for n in names}) == len(names)
    assert names[0].startswith("ein-alterer-fischer-flustert-ca-va-tres-bien") and names[0].endswith("-s0")
    assert names[1] == names[0] + "-2"
    assert names[2].endswith("-s3")
    assert names[3].startswith("h3-") and names[4].startswith("h3-") and names[3] != names[4]
    assert names[5:] == ["sunset-s0", "sunset-s0-2", "sunset-s0-3", "line-separator-s1"]
    assert jobs[-1].prompt == "line\u2028separator" and jobs[-1].source.line == 9
    # a name at the byte limit still fits with a collision counter
    assert len(J.prompt_slug("x" * 500, 2**64 - 1, counter=12)) == J.MAX_AUTO_NAME_BYTES


def test_explicit_outputs_clash_case_insensitively(tmp_path):
    path = write(tmp_path, "c.jsonl", '{"prompt": "x", "output": "Shot"}\n{"id": "shot", "prompt": "y"}\n')
    [error] = errors_of(path)
    assert error.startswith(f"{path}:2: id: output 'shot' is also written by the job at {path}:1")


# --- presets ----------------------------------------------------------------------------------------------------------

def test_presets_listing():
    infos = {info.name: info for info in J.list_presets()}
    assert {"landscape-16x9", "portrait-9x16", "square", "4x3", "fast-960x544"} <= set(infos)
    expected = {"landscape-16x9": (1344, 768), "portrait-9x16": (768, 1344), "square": (768, 768),
                "4x3": (1024, 768), "fast-960x544": (960, 544)}
    for name, canvas in expected.items():
        info = infos[name]
        assert (info.width, info.height) == canvas
        assert info.video_rows == S.latent_frames(info.frames) * (canvas[0] // 32) * (canvas[1] // 32)
        assert info.audio_rows == 2 * round(info.frames / 24 * 40)
    assert (infos["landscape-16x9"].frames, infos["landscape-16x9"].video_rows) == (124, 37 * 24 * 42)
    lines = J.preset_lines()
    assert lines[0].startswith("preset") and any("fast-960x544" in l and "960x544" in l for l in lines)
    # aspect presets follow the checkpoint's canvas rule; explicit ones do not
    small = Limits(22, 362, (128, 96), 39, 8, canvas_short_edge=96, canvas_max_pixels=96 * 160)
    infos = {info.name: info for info in J.list_presets(small)}
    assert (infos["landscape-16x9"].width, infos["landscape-16x9"].height) == (160, 96)
    assert (infos["fast-960x544"].width, infos["fast-960x544"].height) == (960, 544)


def test_the_tiny_models_preset_table_says_what_it_does_with_each_preset():
    """On the tiny model "fast-960x544" is a fixed 960x544, 18x its canvas budget: its largest, slowest preset, which
    the table listed as "Fast drafts ..." with nothing to say so. The released model has no such note."""
    from h3render.checkpoint.releases import RELEASES

    tiny = RELEASES["tiny"].limits()
    lines = J.preset_lines(tiny, model="the built-in tiny model (random weights)")
    assert lines[0] == ("presets for the built-in tiny model (random weights): an aspect preset takes its canvas rule "
                        "(short edge 128 px, at most 28,672 px); a fixed-size preset keeps its size")
    fast = next(line for line in lines if line.startswith("fast-960x544"))
    assert fast.endswith("[fixed size, 18x this checkpoint's canvas budget (28,672 px): its largest, slowest preset "
                         "here]"), fast
    assert sum("[" in line for line in lines) == 1  # the aspect presets follow the rule: nothing to add
    assert not any("[" in line for line in J.preset_lines(RELEASES["released"].limits()))
    # a preset the checkpoint would refuse says so (rows over its limit)
    cramped = dataclasses.replace(tiny, max_video_rows=1_000)
    notes = {i.name: i.note for i in J.list_presets(cramped)}
    assert notes["landscape-16x9"] == "refused here: 1,036 video rows, over this checkpoint's 1,000"


def test_unknown_and_broken_presets(tmp_path):
    path = write(tmp_path, "u.jsonl", '{"prompt": "x", "preset": "sqare"}\n')
    [error] = errors_of(path)
    assert error.startswith(f"{path}:1: preset: unknown preset 'sqare'; available: ") and "square" in error
    folder = tmp_path / "presets"
    folder.mkdir()
    (folder / "odd.yaml").write_text("description: x\naspect: '16:9'\nwidth: 960\nduration: 5\n")
    with pytest.raises(ValueError, match="odd.yaml: give either aspect or width"):
        J.load_presets(folder)
    (folder / "odd.yaml").write_text("description: x\naspect: '16:9'\nduration: 5\nfps: 30\n")
    with pytest.raises(ValueError, match="odd.yaml: unknown preset key"):
        J.load_presets(folder)


# --- shards -----------------------------------------------------------------------------------------------------------

def _jobs(n):
    return [Job(id=None, prompt=f"p{i}", width=128, height=96, frames=22, seed=i, steps=8, mode="t2va",
                output=f"job-{i}") for i in range(n)]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_shards_cover_every_job_exactly_once(count):
    jobs = _jobs(13)
    shards = [SH.shard_jobs(jobs, index, count) for index in range(count)]
    outputs = [job.output for shard in shards for job in shard]
    assert sorted(outputs) == sorted(job.output for job in jobs) and len(outputs) == len(jobs)
    assert shards == [SH.shard_jobs(jobs, index, count) for index in range(count)]  # deterministic
    assert all(shard == sorted(shard, key=jobs.index) for shard in shards)  # manifest order kept


def test_parse_shard():
    assert SH.parse_shard("0/4") == (0, 4) and SH.parse_shard(" 3 / 4 ") == (3, 4)
    for bad in ["4/4", "1/0", "-1/2", "a/b", "1", "1/2/3"]:
        with pytest.raises(ValueError, match="shard"):
            SH.parse_shard(bad)
    with pytest.raises(ValueError, match="0 … 1"):
        SH.shard_jobs(_jobs(2), 2, 2)


def test_shard_from_slurm():
    assert SH.shard_from_slurm({}) is None
    env = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "3"}
    assert SH.shard_from_slurm(env) == (2, 4)
    assert SH.shard_from_slurm({**env, "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_ID": "3"}) == (3, 4)
    assert SH.shard_from_slurm({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4",
                               "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_STEP": "2"}) == (2, 4)
    bad_envs = [{**env, "SLURM_ARRAY_TASK_ID": "x"}, {"SLURM_ARRAY_TASK_ID": "1"},
                {**env, "SLURM_ARRAY_TASK_ID": "9"}, {**env, "SLURM_ARRAY_TASK_ID": "2"},
                {**env, "SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_STEP": "2"}]
    for bad in bad_envs:
        with pytest.raises(ValueError, match="SLURM"):
            SH.shard_from_slurm(bad)


# --- Job and examples ---------------------------------------------------------------------------------------------------

def test_job_invariants():
    good = dict(id=None, prompt="x", width=128, height=96, frames=22, seed=0, steps=8, mode="t2va", output="x")
    Job(**good)
    for change, text in [({"frames": 23}, "17n\\+5"), ({"width": 100}, "width"), ({"mode": "i2v"}, "mode"),
                         ({"output": "../x"}, "output")]:
        with pytest.raises(ValueError, match=text):
            Job(**{**good, **change})
    with pytest.raises(ValueError, match="default_frames"):
        Limits(107, 362, (1344, 768), 100, 50)


def test_showcase_examples_render_on_the_default_canvas():
    from_yaml = load_manifest(REPO / "examples/prompts/showcase.yaml", TINY)
    from_jsonl = load_manifest(REPO / "examples/prompts/showcase.jsonl", TINY)
    assert len(from_yaml) >= 8
    assert [j.params() for j in from_yaml] == [j.params() for j in from_jsonl]
    assert [j.output for j in from_yaml] == [j.output for j in from_jsonl]
    assert all((j.width, j.height, j.frames) == (128, 96, 39) for j in from_yaml)
    assert sum('[Speaker 1]: "' in j.prompt for j in from_yaml) >= 4
    assert plan_lines(from_yaml)[-1] == f"{len(from_yaml)} job(s), {len(from_yaml) * 1.625:.3f} s of video"
    released = load_manifest(REPO / "examples/prompts/showcase.yaml", RELEASED)
    assert all((j.width, j.height, j.frames) == (1344, 768, 243) for j in released)


# --- validation before load: FastH3 adapters, bounded inputs, Unicode names, encoder options -----------------------

def test_fasth3_jobs_without_an_adapter_are_refused_per_line(tmp_path):
    path = write(tmp_path, "mix.jsonl", """
        {"id": "a", "prompt": "base"}
        {"id": "b", "prompt": "fast", "mode": "fasth3"}
        {"id": "c", "prompt": "base again"}
        {"id": "d", "prompt": "fast again", "mode": "fasth3"}
    """)
    with pytest.raises(ManifestError) as info:
        load_manifest(path, RELEASED, adapter_available=False)
    assert [e.split(": ")[0:2] for e in info.value.errors] == [[f"{path}:2", "mode"], [f"{path}:4", "mode"]]
    assert "needs a FastH3 adapter" in info.value.errors[0] and "--adapter" in info.value.errors[0]
    # with an adapter at hand the mixed queue is accepted, in manifest order; unchecked (None) stays as before
    for available in (True, None):
        assert [j.mode for j in load_manifest(path, RELEASED, adapter_available=available)] == [
            "t2va", "fasth3", "t2va", "fasth3"]


def test_fasth3_inherited_from_defaults_or_command_line_names_its_origin(tmp_path):
    path = write(tmp_path, "d.yaml", """
        defaults:
          mode: fasth3
        jobs:
          - {id: a, prompt: x}
          - {id: b, prompt: y, mode: t2va}
    """)
    [error] = errors_of_kw(path, adapter_available=False)
    assert error.startswith(f"{path}:4: mode: fasth3 (from the defaults at {path}:2) needs a FastH3 adapter")
    plain = write(tmp_path, "p.jsonl", '{"prompt": "x"}\n')
    [error] = errors_of_kw(plain, overrides={"mode": "fasth3"}, adapter_available=False)
    assert error.startswith(f"{plain}:1: mode: fasth3 (from --mode) needs")


def test_adapter_named_in_the_manifest_defaults(tmp_path):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "student.safetensors").write_bytes(b"\0")
    path = write(tmp_path, "a.yaml", """
        defaults:
          adapter: adapters/student.safetensors
        jobs:
          - {id: a, prompt: x}
          - {id: b, prompt: y, mode: fasth3}
    """)
    manifest = M.read_manifest(path, RELEASED, adapter_available=False)
    assert manifest.adapter == tmp_path / "adapters" / "student.safetensors"
    assert [j.mode for j in manifest.jobs] == ["t2va", "fasth3"]
    assert M.read_manifest(write(tmp_path, "n.jsonl", '{"prompt": "x"}\n'), RELEASED).adapter is None
    # relative to the manifest's folder, not the working directory; a missing file is reported now
    missing = write(tmp_path, "m.jsonl", '{"defaults": {"adapter": "nope.safetensors"}}\n{"prompt": "x"}\n')
    assert errors_of_kw(missing) == [f"{missing}:1: adapter: no such file: {tmp_path / 'nope.safetensors'}"]
    # a defaults-only field: not on a job, not as a command-line default
    on_job = write(tmp_path, "j.jsonl", '{"prompt": "x", "adapter": "a"}\n')
    assert errors_of_kw(on_job) == [f"{on_job}:1: adapter: may only be set in the manifest's defaults"]
    assert errors_of_kw(write(tmp_path, "c.jsonl", '{"prompt": "x"}\n'), overrides={"adapter": "a"}) == [
        "<command line>: adapter: may only be set in the manifest's defaults (on the command line: --adapter)"]


def test_steps_and_prompt_length_are_bounded_by_the_limits(tmp_path):
    path = write(tmp_path, "b.jsonl", f"""
        {{"id": "ok", "prompt": "{'x' * 20_000}", "steps": 1000}}
        {{"id": "huge", "prompt": "x", "steps": 1000000000}}
        {{"id": "long", "prompt": "{'x' * 20_001}"}}
    """)
    errors = errors_of(path)
    assert errors == [f"{path}:2: steps: 1000000000 sigma points is more than this checkpoint's limit of 1,000",
                      f"{path}:3: prompt: 20,001 characters is longer than this checkpoint's limit of 20,000 "
                      "characters"]
    strict = Limits(107, 362, (1344, 768), 243, 50, max_sigma_points=60, max_prompt_chars=10)
    errors = errors_of(path, strict)
    assert [e.split(": ")[0] for e in errors] == [f"{path}:1", f"{path}:1", f"{path}:2", f"{path}:3"]
    assert "limit of 60" in errors[1] and "limit of 10 " in errors[0]
    with pytest.raises(ValueError, match="default_steps 50 must be within 2–40"):
        Limits(107, 362, (1344, 768), 243, 50, max_sigma_points=40)


def test_huge_integers_and_deep_nesting_are_line_errors(tmp_path):
    digits = "9" * 5001
    jsonl = tmp_path / "big.jsonl"
    jsonl.write_text('{"prompt": "ok"}\n'
                     f'{{"prompt": "x", "seed": {digits}}}\n'
                     f'{{"prompt": "x", "frames": -{digits}}}\n'
                     '{"prompt": "x", "seed": ' + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")
    assert errors_of(jsonl) == [f"{jsonl}:2: seed: an integer of 5,001 digits is out of range",
                                f"{jsonl}:3: frames: an integer of 5,001 digits is out of range",
                                f"{jsonl}:4: nested too deeply to read (a job is one flat object)"]
    yml = tmp_path / "big.yaml"
    yml.write_text(f"jobs:\n  - prompt: x\n    seed: {digits}\n  - prompt: y\n", encoding="utf-8")
    assert errors_of(yml) == [f"{yml}:3: seed: an integer of 5,001 digits is out of range"]
    deep = tmp_path / "deep.yaml"
    deep.write_text("jobs:\n  - prompt: x\n    seed:\n      " + "[" * 100_000 + "]" * 100_000 + "\n", encoding="utf-8")
    assert errors_of(deep) == [f"{deep}:4: nested more than {MAX_NESTING} levels deep (a manifest needs 3)"]


def test_ids_and_outputs_that_differ_only_in_unicode_normalization_clash(tmp_path):
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    assert nfc != nfd and J.output_key(nfc) == J.output_key(nfd) == J.output_key("CAFE\u0301")
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"id": nfc, "prompt": "x"}) + "\n" + json.dumps({"id": nfd, "prompt": "y"}) + "\n",
                   encoding="utf-8")
    [error] = errors_of(ids)
    assert error.startswith(f"{ids}:2: id: duplicate id {nfd!r} (first at {ids}:1)")
    outs = tmp_path / "outs.jsonl"
    outs.write_text(json.dumps({"prompt": "x", "output": f"shots/{nfd}"}) + "\n"
                    + json.dumps({"prompt": "y", "output": f"Shots/{nfc.upper()}"}) + "\n", encoding="utf-8")
    [error] = errors_of(outs)
    assert error.startswith(f"{outs}:2: output: output 'Shots/CAFÉ' is also written by the job at {outs}:1")
    # a lone NFD name is written in NFC
    outs.write_text(json.dumps({"id": nfd, "prompt": "x"}) + "\n", encoding="utf-8")
    [job] = load_manifest(outs, RELEASED)
    assert job.output == nfc and job.id == nfd


def test_x264_preset_names_are_checked_up_front():
    assert J.X264_PRESETS[0] == "ultrafast" and J.X264_PRESETS[-1] == "placebo" and len(J.X264_PRESETS) == 10
    for name in J.X264_PRESETS:
        assert J.check_x264_preset(name) == name
    with pytest.raises(ValueError, match=r"--x264-preset 'ultrafastt' is not an x264 preset \(did you mean "
                                         r"ultrafast\?\)"):
        J.check_x264_preset("ultrafastt")
    with pytest.raises(ValueError, match="one of ultrafast, superfast"):
        J.check_x264_preset("Medium ")


def test_spec_facts_are_not_restated():
    for name in ("FPS", "CANVAS_MULTIPLE", "FRAMES_PER_CHUNK", "FRAMES_REMAINDER", "AUDIO_LATENTS_PER_SECOND",
                 "AUDIO_CHANNELS", "RELEASED_SHORT_EDGE", "RELEASED_MAX_PIXELS", "MIN_ASPECT", "MAX_ASPECT",
                 "canvas_for_aspect", "is_snapped", "latent_frames", "video_rows", "audio_rows", "Limits",
                 "check_canvas", "parse_aspect", "snap_frames"):
        for module in (J, M):  # what jobs and manifest hold of these is spec's own object, never a copy
            assert getattr(module, name, getattr(S, name)) is getattr(S, name), (module.__name__, name)
    source = (REPO / "h3render" / "jobs.py").read_text() + (REPO / "h3render" / "manifest.py").read_text()
    assert "FPS = " not in source and "def canvas_for_aspect" not in source and "class Limits" not in source


def errors_of_kw(path, limits=RELEASED, overrides=None, **kw):
    with pytest.raises(ManifestError) as info:
        load_manifest(path, limits, overrides, **kw)
    return info.value.errors


# --- durations outside what the weights were trained on -------------------------------------------------------------

def _job_of(limits, **fields):
    return M.job_from_fields({"prompt": "a fox", "output": "clip", **fields}, limits)


@pytest.mark.parametrize("duration, outside", [(4, True), (4.9, False), (5, False), (10, False), (14.375, False),
                                               (15, True)])  # 4.9 s snaps up to 124 frames = 5.167 s; 15 s to 362 = 15.083 s
def test_released_plan_line_names_durations_outside_the_trained_5_to_15_s(duration, outside):
    from h3render.checkpoint.releases import RELEASES

    limits = RELEASES["released"].limits()
    job = _job_of(limits, duration=duration)
    note = "outside the 5–15 s the model was trained on"
    assert (note in job.time_note(limits)) is outside
    assert (note in plan_lines([job], limits=limits)[0]) is outside
    assert note not in job.time_note()  # without the checkpoint's limits nothing is claimed


def test_the_note_follows_the_checkpoints_own_limits_not_5_to_15():
    from h3render.checkpoint.releases import RELEASES

    tiny = RELEASES["tiny"].limits()  # a random model: trained on nothing, so no range is claimed
    assert tiny.trained_seconds is None
    assert "trained" not in plan_lines([_job_of(tiny, frames=22)], limits=tiny)[0]
    own = Limits(min_frames=22, max_frames=362, default_canvas=(128, 96), default_frames=39, default_steps=8,
                 trained_seconds=(1.0, 2.0))
    assert _job_of(own, frames=22).time_note(own) == "22 frames = 0.917 s, outside the 1–2 s the model was trained on"
    assert _job_of(own, frames=39).time_note(own) == "39 frames = 1.625 s"
    assert "outside the 1–2 s" in _job_of(own, duration=4).time_note(own)
    with pytest.raises(ValueError, match="trained_seconds"):
        Limits(min_frames=22, max_frames=362, default_canvas=(128, 96), default_frames=39, default_steps=8,
               trained_seconds=(3.0, 2.0))


def test_a_frame_count_outside_the_range_is_named_once(tmp_path):
    """The location names the field; the message goes on with the value, not with the field again (a trial saw
    `frames: frames 3 snaps to 5 frames, ...`)."""
    path = write(tmp_path, "m.jsonl", """
        {"id": "a", "prompt": "x", "frames": 3}
        {"id": "b", "prompt": "x", "duration": 0.1}
    """)
    errors = errors_of(path)
    assert errors[0].startswith(f"{path}:1: frames: 3 snaps to ") and "frames: frames" not in errors[0]
    assert errors[1].startswith(f"{path}:2: duration: 0.1 s (2 frames) snaps to "), errors[1]
