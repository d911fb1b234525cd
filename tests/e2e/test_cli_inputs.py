"""The issue #28 probes from the public CLI (in-process, nothing loads): each bad input is one `file:line: field`
(or `<command line>: field`) line and exit 2 before any weights load, never a traceback or a queue that runs."""

from __future__ import annotations

import json

from tests._cli import invoke, one_error_line


def test_batch_dry_run_refuses_every_probe_input_at_once(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join([
        json.dumps({"id": "b", "prompt": "x"}),
        json.dumps({"id": "bt", "output": "b.tmp", "prompt": "y"}),  # 1: its finals were b's temps
        json.dumps({"id": "s", "prompt": "\ud83d text"}),  # 4: a JSON escape, kept as the lone surrogate
        json.dumps({"prompt": "z", "output": "x\ud83d"}),
        json.dumps({"prompt": "z", "output": "a\u202egpj.exe"}),  # 9: displays as "aexe.jpg"
        json.dumps({"prompt": "z", "output": "/".join(["d" * 200] * 21)}),  # 3: over PATH_MAX with any out dir
        json.dumps({"prompt": "z", "width": 32000, "height": 32000}),  # 5: 72,000,000 rows on the tiny model
    ]) + "\n", encoding="utf-8")
    result = invoke("batch", str(manifest), "--dry-run", "--out-dir", str(tmp_path / "out"))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("h3render: error:")]
    assert [line.split(": ")[2].split(":")[1] for line in errors] == ["2", "3", "4", "5", "6", "7"], errors
    assert [line.split(": ")[3] for line in errors] == ["output", "prompt", "output", "output", "output", "width"]
    assert all(line.encode("utf-8") and "\u202e" not in line for line in errors)


def test_prompt_refuses_a_lone_surrogate_before_load(tmp_path):
    # `h3render prompt $'a \xff'`: the argv byte decodes to U+DCFF; it failed every job at the warm-up's encode
    line = one_error_line(invoke("prompt", "a \udcff", "-o", str(tmp_path / "a.mp4")))
    assert line == ("h3render: error: <command line>: prompt: contains a lone surrogate U+DCFF at character 3 (not "
                    "valid Unicode text)")
    assert not list(tmp_path.iterdir())
