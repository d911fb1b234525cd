"""Output names, paths and text at their limits (issue #28 items 1, 3, 4, 9, 10): final and temp names never meet,
over-long paths fail their job alone, lone surrogates and format characters are refused at validation with one line
naming file:line: field."""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h3render.jobs import MAX_OUTPUT_BYTES, Job, output_key, output_path_problem
from h3render.manifest import job_from_fields, load_manifest
from h3render.manifest_formats import ManifestError
from h3render.outputs import lock_path, output_paths, render_reason, temp_paths
from h3render.spec import Limits

RELEASED = Limits(min_frames=107, max_frames=362, default_canvas=(1344, 768), default_frames=243, default_steps=50)
# Every Unicode form: any code point (surrogates included: exclude_categories=()), with the awkward ones drawn
# often enough to be met in 50 examples: lone surrogates (a JSON escape, surrogateescape argv bytes), bidi and
# zero-width format characters, NUL, a combining mark, a line separator.
# st.text() never yields a surrogate, so text is drawn as a list of characters.
_AWKWARD = st.sampled_from(["\ud83d", "\udcff", "\ude00", "\u202e", "\u200b", "\x00", "\u0301", "\u2028",
                            "\U0001f600"])
_TEXT_CHARS = st.one_of(st.characters(codec=None, exclude_categories=()), _AWKWARD)


def any_text(min_size: int = 0, max_size: int = 40):
    return st.lists(_TEXT_CHARS, min_size=min_size, max_size=max_size).map("".join)

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def printable(line: str) -> bool:
    """One line that encodes to UTF-8 and holds no control, format or surrogate character (none breaks or reorders it)."""
    return bool(line.encode("utf-8")) and not any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in line)


def manifest_errors(tmp_path: Path, *lines: str) -> list[str]:
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ManifestError) as info:
        load_manifest(path, RELEASED)
    return [e.replace(str(path), "m.jsonl") for e in info.value.errors]


def names_of(output: str) -> tuple[set[str], set[str]]:
    """(final names, temp and lock names) of an output, as the case-folding file system compares them."""
    mp4, sidecar = output_paths(Path("out"), Job(None, "p", 1344, 768, 243, 0, 50, "t2va", output))
    finals = {output_key(p.as_posix()) for p in (mp4, sidecar)}
    others = {output_key(p.as_posix()) for p in (*temp_paths(mp4, sidecar), lock_path(mp4))}
    return finals, others


# --- 1: final names and temp names are disjoint -----------------------------------------------------------------------

def test_an_output_ending_in_tmp_is_refused_beside_its_namesake(tmp_path):
    # The probe: bt's final b.tmp.mp4 was b's temp name; b's claim deleted it and both reported success.
    errors = manifest_errors(tmp_path, '{"id": "b", "prompt": "x"}', '{"id": "bt", "output": "b.tmp", "prompt": "y"}',
                             '{"output": "c.TMP.mp4", "prompt": "z"}')
    assert errors == [f"m.jsonl:{n}: output: may not end in '.tmp': that suffix is reserved for the temp files of the "
                      "job without it" for n in (2, 3)]
    assert output_path_problem("sub/B.TMP")  # one file with b.tmp on a case-folding file system
    with pytest.raises(ValueError, match="may not end in '.tmp'"):  # a Job built in code meets the same rule
        Job(None, "p", 1344, 768, 243, 0, 50, "t2va", "b.tmp")
    assert output_path_problem("clips.tmp/b") is None  # a folder may: no temp lives at a folder's name


_NAME_PARTS = st.sampled_from(["b", "B", "tmp", ".tmp", ".TMP", ".json", ".mp4", ".lock", "x.", "é", "e\u0301",
                               "sub/", "a b", "ſ", "K"])


@FAST
@given(*[st.lists(_NAME_PARTS, min_size=1, max_size=6).map("".join)] * 2)
def test_no_accepted_final_name_is_another_jobs_temp_or_lock(a, b):
    if output_path_problem(a) or output_path_problem(b):
        return
    finals_a, others_a = names_of(a)
    finals_b, others_b = names_of(b)
    assert not finals_a & others_b and not finals_b & others_a and not finals_a & others_a


def test_the_writers_temp_names_are_outputs_temp_paths(tmp_path, monkeypatch):
    """media's MP4 temp and sidecar.write_sidecar's temp are names `temp_paths` lists (the ones the rule protects)."""
    from h3render import sidecar as sidecar_module
    from h3render.media import temp_path_for

    mp4, side = tmp_path / "a.mp4", tmp_path / "a.json"
    assert temp_path_for(mp4) in temp_paths(mp4, side)
    written = []
    real_replace = os.replace
    monkeypatch.setattr(sidecar_module.os, "replace", lambda src, dst: (written.append(Path(src)),
                                                                         real_replace(src, dst)))
    sidecar_module.write_sidecar(side, job_params={"prompt": "p"}, checkpoint={}, sigmas={}, timings={},
                                 versions={})
    assert written and written[0] in temp_paths(mp4, side)


# --- 3: paths over the OS limits --------------------------------------------------------------------------------------

def test_an_output_longer_than_the_path_limit_is_refused_up_front():
    long = "/".join(["d" * 200] * 6)
    assert len(long.encode()) > MAX_OUTPUT_BYTES
    assert "more than 1,024" in output_path_problem(long)


@pytest.mark.parametrize("unit", ["d", "é", "\U0001f600"])  # 1, 2 and 4 UTF-8 bytes a character
def test_component_and_path_lengths_at_their_limits(unit):
    width = len(unit.encode())
    component = unit * (200 // width)  # the largest component, in bytes, made of this character
    assert output_path_problem(component) is None and output_path_problem(component + unit)
    whole = "/".join([component] * 5)  # 1,004 bytes
    assert output_path_problem(whole) is None
    longer = whole + "/" + "d" * 20  # 1,025 bytes
    assert len(longer.encode()) == 1025 and "bytes long, more than 1,024" in output_path_problem(longer)
    assert output_path_problem(longer[:-1]) is None
    mp4, sidecar = output_paths(Path("out"), Job(None, "p", 1344, 768, 243, 0, 50, "t2va", component))
    assert max(len(p.name.encode()) for p in (*temp_paths(mp4, sidecar), lock_path(mp4))) <= 255  # NAME_MAX


def test_render_reason_of_a_path_over_path_max_is_a_reason_not_a_crash(tmp_path):
    deep = tmp_path.joinpath(*["d" * 200] * 21)  # > 4,096 bytes: is_file() raises ENAMETOOLONG
    job = Job(None, "p", 1344, 768, 243, 0, 50, "t2va", "x")
    reason = render_reason(job, deep / "x.mp4", deep / "x.json")
    assert reason.startswith("cannot check its files:") and "too long" in reason


# --- 4: lone surrogates -----------------------------------------------------------------------------------------------

def test_lone_surrogates_in_prompt_and_output_are_refused_with_their_line(tmp_path):
    errors = manifest_errors(tmp_path, r'{"id": "a", "prompt": "\ud83d then text"}',
                             r'{"prompt": "ok", "output": "x\ud83d"}')
    assert errors == ["m.jsonl:1: prompt: contains a lone surrogate U+D83D at character 1 (not valid Unicode text)",
                      "m.jsonl:2: output: contains a lone surrogate U+D83D at character 2 (not valid Unicode text)"]


def test_the_prompt_commands_surrogate_is_refused_before_load():
    # `h3render prompt $'\xff'`: argv decodes the byte to U+DCFF (surrogateescape)
    with pytest.raises(ManifestError, match=r"<command line>: prompt: contains a lone surrogate U\+DCFF"):
        job_from_fields({"prompt": "a \udcff", "output": "a"}, RELEASED)


# --- 9: format characters ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("char", ["\u202e", "\u200b", "\ufeff", "\u2028", "\x85", "\u061c"])
def test_format_and_control_characters_are_refused_in_output_names(char):
    problem = output_path_problem(f"a{char}gpj.exe")
    assert problem.startswith("contains characters not allowed in file names: U+")
    assert char not in problem  # named, never printed (a U+202E would reverse the error line itself)


# --- 10: property tests over text and names ---------------------------------------------------------------------------

@FAST
@given(any_text(max_size=40))
def test_any_prompt_text_is_a_job_or_one_line_errors(text):
    try:
        job = job_from_fields({"prompt": text, "output": "a"}, RELEASED)
    except ManifestError as exc:
        assert all(printable(e) for e in exc.errors)
        return
    assert job.prompt == text and job.prompt.encode("utf-8")  # accepted text always encodes (the tokenizer's input)


@FAST
@given(any_text(min_size=1, max_size=30))
def test_any_output_text_is_a_job_or_one_line_errors(text):
    try:
        job = job_from_fields({"prompt": "p", "output": text}, RELEASED)
    except ManifestError as exc:
        assert all(printable(e) for e in exc.errors)
        return
    mp4, sidecar = output_paths(Path("out"), job)
    os.fsencode(mp4), os.fsencode(sidecar)  # a name that is accepted can be written
    assert all(len(p.encode()) <= 255 for p in mp4.name.split("/"))


@FAST
@given(st.one_of(any_text(max_size=200), st.text(st.sampled_from('{}[]":,\n -#!\\u0a'), max_size=80)),
       st.sampled_from([".jsonl", ".yaml"]))
def test_any_manifest_text_is_jobs_or_file_line_errors(tmp_path, text, suffix):
    path = tmp_path / f"m{suffix}"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_manifest(path, RELEASED)
    except ManifestError as exc:
        assert exc.errors and all(e.startswith(str(path)) and printable(e) for e in exc.errors)


@FAST
@given(st.lists(st.fixed_dictionaries({"prompt": any_text(max_size=8)},
                                      optional={"output": any_text(max_size=8),
                                                "id": any_text(max_size=8)}),
                max_size=4))
def test_any_jsonl_jobs_with_escapes_are_jobs_or_errors(tmp_path, jobs):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(j) for j in jobs), encoding="utf-8")  # ensure_ascii: "\udXXX" escapes
    try:
        for job in load_manifest(path, RELEASED):
            job.prompt.encode("utf-8"), os.fsencode(job.output)
    except ManifestError as exc:
        assert all(printable(e) for e in exc.errors)


def test_text_quoted_in_an_error_is_escaped_not_printed(tmp_path):
    # an unknown key is quoted as the field: raw, U+202E reversed the rest of the terminal line, a newline split it
    errors = manifest_errors(tmp_path, json.dumps({"prompt": "x", "de\u202efaults\n\udc80": 1}))
    assert errors[0].startswith("m.jsonl:1: de\\u202efaults\\u000a\\udc80: unknown field") and printable(errors[0])


def test_a_jobs_folder_may_not_be_another_jobs_file(tmp_path):
    # "a.mp4/x" needs a folder a.mp4 where job a writes its MP4: whichever rendered second failed at render time
    errors = manifest_errors(tmp_path, '{"id": "a", "prompt": "x"}', '{"output": "A.mp4/x", "prompt": "y"}',
                             '{"output": "a.lock/y", "prompt": "z"}', '{"output": "a/z", "prompt": "w"}')
    assert errors == ["m.jsonl:2: output: 'A.mp4/x' needs a folder 'A.mp4', which is the file a.mp4 of the "
                      "job at m.jsonl:1",
                      "m.jsonl:3: output: 'a.lock/y' needs a folder 'a.lock', which is the file a.lock of the "
                      "job at m.jsonl:1"]


def test_render_reason_names_the_job_fields_that_changed(tmp_path):
    """A trial: after a keyframe picture was edited, `--dry-run` said only `render: parameters changed`, while the
    resume's skip line names what differs; now the reason lists the job fields that changed."""
    import json

    from h3render.manifest import job_from_fields

    limits = Limits(min_frames=22, max_frames=362, default_canvas=(224, 128), default_frames=39, default_steps=8)
    job = job_from_fields({"prompt": "a", "seed": 3, "steps": 4, "output": "x"}, limits)
    mp4, side = tmp_path / "x.mp4", tmp_path / "x.json"
    mp4.write_bytes(b"\0" * 16)
    recorded = json.loads(json.dumps(job.params()))
    side.write_text(json.dumps({"job": {**recorded, "seed": 4, "steps": 8}}))
    assert render_reason(job, mp4, side) == "parameters changed (seed, steps)"
    side.write_text(json.dumps({"job": recorded}))  # the same job (and a sidecar with no MP4 record): done
    assert render_reason(job, mp4, side) is None


def test_dry_run_names_the_jobs_whose_paths_would_fail(tmp_path):
    """A trial: `--dry-run` said `render: no MP4` for a job whose folder was blocked by a file and for one whose folder
    was a symlink leading out of the out dir; the real run then failed both. The dry run now says so."""
    from h3render.dry_run import plan_lines

    limits = Limits(min_frames=22, max_frames=362, default_canvas=(224, 128), default_frames=39, default_steps=8)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir(), elsewhere.mkdir()
    (out / "blocked").write_text("a file where a folder goes")
    (out / "link").symlink_to(elsewhere)
    (out / "taken.mp4").mkdir()
    jobs = [job_from_fields({"prompt": "a", "output": name}, limits) for name in ("blocked/x", "link/y", "taken", "ok")]
    lines = plan_lines(jobs, out)
    assert f"will fail: cannot create the job's folder {out / 'blocked'}: {out / 'blocked'} is a file" in lines[0]
    assert f"will fail: {out / 'link'}: the job's folder leads out of the out dir" in lines[1]
    assert f"will fail: {out / 'taken.mp4'}: a folder stands at the job's output name" in lines[2]
    assert "render: no MP4" in lines[3] and "will fail" not in lines[3]
