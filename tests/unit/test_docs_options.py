"""The docs offer only options the CLI has: every `h3render <command> ... --flag` in README.md and docs/*.md names an
option of that command, unless its paragraph says the option was removed (docs/performance.md offered
`batch --overlap` long after it was gone)."""

from __future__ import annotations

import re
from pathlib import Path

from h3render.cli import cli

REPO = Path(__file__).resolve().parents[2]
# `h3render batch m.jsonl --dry-run`: the command, then the rest of the code span.
COMMAND_SPAN = re.compile(r"`[^`]*?h3render ([a-z-]+)([^`]*)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")


def _paragraphs(path: Path):
    """(first line number, text) of each blank-line separated paragraph of prose; fenced code blocks are left out
    (their command lines span several lines, which this inline-span scan does not follow)."""
    start, lines, fenced = 1, [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines() + [""], start=1):
        if line.lstrip().startswith("```"):
            fenced, line = not fenced, ""  # a fence ends the paragraph before it
        elif fenced:
            continue
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            yield start, " ".join(lines)
            lines = []


def _offered_flags(text: str, options: dict[str, set[str]]):
    for match in COMMAND_SPAN.finditer(text):
        command, rest = match[1], match[2]
        if command in options:
            for flag in FLAG.findall(rest):
                yield command, flag


def test_documented_command_lines_use_existing_options():
    options = {name: {o for p in c.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
               for name, c in cli.commands.items()}
    checked, wrong = 0, []
    for path in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        for line, paragraph in _paragraphs(path):
            for command, flag in _offered_flags(paragraph, options):
                checked += 1
                if flag not in options[command] and "removed" not in paragraph:
                    wrong.append(f"{path.relative_to(REPO)}:{line}: h3render {command} has no {flag}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 3  # the scan found the docs' command lines at all


def test_the_scan_sees_a_missing_option():
    options = {"batch": {"--dry-run"}}
    assert list(_offered_flags("run `h3render batch m.jsonl --overlap --dry-run`", options)) == [
        ("batch", "--overlap"), ("batch", "--dry-run")]
