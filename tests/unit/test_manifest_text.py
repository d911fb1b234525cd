"""YAML tags in a manifest (issue #28 item 9): a tag on the root or on a job is an error naming its line, not silently
ignored; `!!map`/`!!seq` written out are the plain tags. A YAML syntax error names the line where the unfinished
construct opened. Any manifest text at all: tests/unit/test_output_names.py."""

from __future__ import annotations

import textwrap

import pytest

from h3render.manifest import load_manifest
from h3render.manifest_formats import ManifestError
from h3render.spec import Limits

RELEASED = Limits(min_frames=107, max_frames=362, default_canvas=(1344, 768), default_frames=243, default_steps=50)


def yaml_errors(tmp_path, text: str):
    """`text` as m.yaml, which must not load: (its path, the manifest's errors)."""
    path = tmp_path / "m.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ManifestError) as info:
        load_manifest(path, RELEASED)
    return path, info.value.errors


@pytest.mark.parametrize("text, tag", [("!!python/object:os.system\njobs:\n- prompt: p\n",
                                        "tag:yaml.org,2002:python/object:os.system"),
                                       ("--- !jobs\n- prompt: p\n", "!jobs")])
def test_a_yaml_root_tag_is_an_error_naming_its_line(tmp_path, text, tag):
    path, errors = yaml_errors(tmp_path, text)
    assert errors[0].startswith(f"{path}:1: the document has the YAML tag {tag!r}")


def test_a_tagged_job_is_an_error_and_plain_tags_are_fine(tmp_path):
    path, errors = yaml_errors(tmp_path, textwrap.dedent("""\
        !!map
        jobs: !!seq
        - !!map {prompt: a}
        - !thing {prompt: b}
        """))
    assert errors == [f"{path}:4: the job has the YAML tag '!thing'; a job is a plain mapping"]




def test_tagged_defaults_and_jobs_are_errors_naming_their_lines(tmp_path):
    path, errors = yaml_errors(tmp_path, "defaults: !custom {seed: 1}\njobs: !more\n- prompt: a\n")
    assert errors == [f"{path}:1: defaults: has the YAML tag '!custom'; defaults are a plain mapping of "
                      "fields", f"{path}:2: jobs: has the YAML tag '!more'; jobs are a plain list"]


@pytest.mark.parametrize("quote", ['"', "'"])
def test_an_unclosed_quote_is_blamed_on_the_line_it_opens(tmp_path, quote):
    """A trial: `prompt: "hello` with no closing quote was blamed on the end of the file (`m.yaml:7: not valid YAML:
    found unexpected end of stream`); PyYAML's context mark says where the quote opened."""
    path, errors = yaml_errors(tmp_path, f"jobs:\n  - id: a\n    prompt: {quote}hello\n    seed: 3\n  - id: b\n"
                                         "    prompt: x\n")
    assert errors == [f"{path}:3: not valid YAML: the quote opened here (column 13) is never closed: found "
                      "unexpected end of stream at line 7"]


def test_a_syntax_error_inside_a_construct_names_where_it_opened(tmp_path):
    path, errors = yaml_errors(tmp_path, 'jobs:\n  - id: a\n    keyframes: ["0:a.png",\n    seed: 3\n  - prompt: x\n')
    assert errors == [f"{path}:5: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow "
                      "sequence at line 3, column 16)"]
