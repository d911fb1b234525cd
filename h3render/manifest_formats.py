"""Manifest file formats: JSONL and YAML text read into field layers (`Layer`: a job line or the `defaults`, each
value with its own 1-based line), every problem collected with its place (`Errors`) and raised at once as a
`ManifestError` of `file:line: field: problem` lines. What the fields mean and how layers resolve into `Job`s is
`h3render.manifest`; each value's own type and range is `h3render.manifest_fields`. Schema: docs/manifest.md.
"""

from __future__ import annotations

import difflib
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import yaml

from h3render.exits import UsageError
from h3render.jobs import one_line
from h3render.manifest_fields import MAX_INT_DIGITS, STRING_FIELDS, TooLong

MAX_NESTING = 64  # YAML levels; a manifest needs 3. PyYAML composes recursively: 100,000 levels overflow the stack


class ManifestError(UsageError):
    """Every problem found in one manifest; `errors` holds the message lines in file order, each of the form
    `file:line: field: problem`."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class Value(NamedTuple):
    """A field's value and where it was given."""

    value: Any
    line: int  # 1-based line of the field; 0 when not from a file
    # a list value's places and their lines, where the file gives them (YAML): {"[1]": 7, "[1].strength": 8}
    lines: Mapping[str, int] | None = None
    # a command-line list's names for the field and its entries, as typed: {"": "--lora", "[0]": "--lora #1 (x:0.8)"}
    labels: Mapping[str, str] | None = None


@dataclass
class Layer:
    """The fields set at one level (a job line, manifest defaults, command-line defaults), with their lines."""

    file: str
    line: int
    fields: dict[str, Value] = field(default_factory=dict)

    def where(self, name: str | None = None, at: str = "") -> Where:
        """The place to blame: the field's own line when it has one, else the job's. `at`, a place inside the
        field's value (`"[1].strength"`), is added to the field's name (`loras[1].strength`) and blamed on its own
        line, else its entry's (`"[1]"`), when the file gives them. A command-line value with `labels` names the
        option instead: `--lora #2 (b.safetensors:0.5)`, `--lora #2 (b.safetensors:nan): strength`."""
        value = self.fields.get(name) if name else None
        if value is not None and value.labels:  # an option's value: named as typed, not `loras[0].path` (a trial)
            entry = at[:at.find("]") + 1]  # "[1].strength" -> "[1]"; "" -> ""
            if entry in value.labels:
                key = at[len(entry):].removeprefix(".")
                return Where(value.labels[entry], 0, key if key not in ("", "path") else None)
        line = value.line if value is not None and value.line else self.line
        lines = (value.lines or {}) if value is not None else {}
        place = at
        while place and place not in lines:  # "[1].strength" -> "[1]" -> ""
            place = place[:max(place.rfind("."), place.rfind("["))]
        return Where(self.file, lines.get(place, line), f"{name}{at}" if name else None)

    def blame(self, name: str, problem: str | tuple[str, str]) -> tuple[Where, str]:
        """`Errors.add`'s arguments for a problem of field `name`: a message, or `(at, message)` for a place inside
        its value (`manifest_fields.field_problems`)."""
        at, message = problem if isinstance(problem, tuple) else ("", problem)
        return self.where(name, at), message

    def get(self, name: str) -> Any:
        return self.fields[name].value if name in self.fields else None


class Where(NamedTuple):
    """A place to blame: file, 1-based line (0: none) and field; prints as `file:line: field`."""

    file: str
    line: int = 0
    field: str | None = None

    def __str__(self) -> str:
        location = f"{self.file}:{self.line}" if self.line else self.file
        return f"{location}: {self.field}" if self.field else location


class Errors:
    """Collects problems from every pass; reports them in file order (command-line defaults first)."""

    def __init__(self) -> None:
        self.found: list[tuple[Where, str]] = []
        self._seen: set[tuple[Where, str]] = set()

    def add(self, where: Where, message: str) -> None:
        # A defaults layer (the command line's, a manifest's defaults line) is resolved once per job it reaches:
        # its problem is one line, not one per job (a trial: `batch --lora f:abc` printed the same line 4 times).
        if (where, message) not in self._seen:
            self._seen.add((where, message))
            self.found.append((where, message))

    def raise_if_any(self) -> None:
        if self.found:  # sorted by line; the sort is stable, so same-line problems keep pass order
            raise ManifestError([_printable(f"{where}: {message}")
                                 for where, message in sorted(self.found, key=lambda item: item[0].line)])


def _printable(line: str) -> str:
    """A problem line with what it quotes from the file made safe to print and log: a lone surrogate (a JSON
    "\\udc80" escape) cannot be encoded to UTF-8, a control or format character (a newline, U+202E) would break
    the line or reorder it on a terminal; each is written as its escape."""
    return "".join(c if unicodedata.category(c) not in ("Cc", "Cf", "Cs") else
                   f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}" for c in line)


def read_jsonl(text: str, file: str, errors: Errors) -> tuple[Layer, list[Layer]]:
    """A JSONL manifest: one job object a line, an optional `{"defaults": {...}}` line before the first job, `#`
    comments. Returns (defaults, jobs); problems go to `errors`."""
    defaults = Layer(file, 0)
    jobs: list[Layer] = []
    # split on "\n" only: str.splitlines() also breaks at U+2028, which json.dumps(ensure_ascii=False) leaves raw
    for number, raw in enumerate(text.split("\n"), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        duplicates: list[str] = []

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            seen: dict[str, Any] = {}
            for key, value in items:
                if key in seen:
                    duplicates.append(key)
                seen[key] = value
            return seen

        try:
            obj = json.loads(stripped, object_pairs_hook=pairs, parse_int=_parse_int)
        except json.JSONDecodeError as exc:
            errors.add(Where(file, number), f"not valid JSON: {exc.msg} (column {exc.colno})")
            continue
        except RecursionError:  # the decoder recurses per level: 100,000 nested brackets exhaust the stack
            errors.add(Where(file, number), "nested too deeply to read (a job is one flat object)")
            continue
        for key in duplicates:
            errors.add(Where(file, number, key), "field given twice")
        if not isinstance(obj, dict):
            errors.add(Where(file, number), "each line must be a JSON object (one job)")
            continue
        if "defaults" in obj:
            if jobs or defaults.line or len(obj) != 1 or not isinstance(obj["defaults"], dict):
                errors.add(Where(file, number, "defaults"),
                           'a defaults line is {"defaults": {...}} alone on a line, before the first job')
                continue
            defaults = Layer(file, number, {k: Value(v, number) for k, v in obj["defaults"].items()})
            continue
        jobs.append(Layer(file, number, {k: Value(v, number) for k, v in obj.items()}))
    return defaults, jobs


def _parse_int(text: str) -> int | TooLong:
    digits = len(text.lstrip("-"))
    return TooLong(digits) if digits > MAX_INT_DIGITS else int(text)


def _too_deep(text: str) -> int:
    """The line where the YAML nests deeper than `MAX_NESTING`, or 0 (the event parser keeps its own stack)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_NESTING:
                return event.start_mark.line + 1
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return 0


def read_yaml(text: str, file: str, errors: Errors) -> tuple[Layer, list[Layer]]:
    """A YAML manifest: a mapping of `defaults:` and `jobs:` (or a bare list of jobs), `<<` merges applied, text
    fields kept as written. Returns (defaults, jobs); problems go to `errors`."""
    defaults = Layer(file, 0)
    try:
        deep_line = _too_deep(text)
        if deep_line:
            errors.add(Where(file, deep_line), f"nested more than {MAX_NESTING} levels deep (a manifest needs 3)")
            return defaults, []
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        errors.add(*_syntax_error(file, text, exc))
        return defaults, []
    except yaml.YAMLError as exc:
        errors.add(Where(file), f"not valid YAML: {one_line(exc)}")
        return defaults, []
    loader = yaml.SafeLoader("")
    if root is None:
        return defaults, []
    if _explicit_tag(root):  # `!!python/object:...` or `!foo` on the root would otherwise be dropped unread
        errors.add(Where(file, _line(root)), f"the document has the YAML tag {root.tag!r}; a manifest takes no tags "
                                             "(a plain mapping of defaults: and jobs:, or a list of jobs)")
        return defaults, []
    if isinstance(root, yaml.SequenceNode):
        job_nodes = root
    elif isinstance(root, yaml.MappingNode):
        job_nodes = None
        for key, value in _yaml_pairs(root, loader, file, errors):
            if key.value == "defaults":
                if _explicit_tag(value):
                    errors.add(Where(file, _line(value), "defaults"), f"has the YAML tag {value.tag!r}; defaults are "
                                                                      "a plain mapping of fields")
                elif isinstance(value, yaml.MappingNode):
                    defaults = _yaml_layer(value, loader, file, errors)
                elif not _is_null(value):
                    errors.add(Where(file, _line(value), "defaults"), "must be a mapping of fields")
            elif key.value == "jobs":
                job_nodes = value
                if _explicit_tag(value):
                    errors.add(Where(file, _line(value), "jobs"), f"has the YAML tag {value.tag!r}; jobs are a plain "
                                                                  "list")
                    return defaults, []
            elif not str(key.value).startswith("x-"):  # x-… keys hold YAML anchors for `<<` merges
                close = difflib.get_close_matches(str(key.value), ("defaults", "jobs"), n=1)
                hint = f" (did you mean {close[0]}?)" if close else "; expected defaults and jobs"
                errors.add(Where(file, _line(key), key.value), f"unknown top-level key{hint}")
        if job_nodes is None:
            errors.add(Where(file, _line(root)), "missing the jobs: list")
            return defaults, []
        if not isinstance(job_nodes, yaml.SequenceNode):
            errors.add(Where(file, _line(job_nodes), "jobs"), "must be a list of jobs")
            return defaults, []
    else:
        errors.add(Where(file, _line(root)), "a YAML manifest is a mapping with defaults: and jobs:")
        return defaults, []
    jobs = []
    for node in job_nodes.value:
        if _explicit_tag(node):
            errors.add(Where(file, _line(node)), f"the job has the YAML tag {node.tag!r}; a job is a plain mapping")
        elif isinstance(node, yaml.MappingNode):
            jobs.append(_yaml_layer(node, loader, file, errors))
        else:
            errors.add(Where(file, _line(node)), "each job must be a mapping of fields")
    return defaults, jobs


def _syntax_error(file: str, text: str, exc: yaml.MarkedYAMLError) -> tuple[Where, str]:
    """Where PyYAML's syntax error is and what it says, with the place the unfinished construct opened (its
    `context_mark`) when that is another line. Found at the end of the file, the error is blamed on that opening
    line, since the end is never the mistake: a trial's `prompt: "hello` (a quote never closed) was blamed on the
    file's last line, with nothing naming the line the quote opened on."""
    problem, context = exc.problem_mark, exc.context_mark
    line = problem.line + 1 if problem else 0
    if context is None or not exc.context or (problem is not None and context.line == problem.line):
        return Where(file, line), f"not valid YAML: {exc.problem or exc.context}"
    column = context.column + 1
    if problem is not None and problem.index >= len(text):
        what = exc.context.removeprefix("while scanning ").removeprefix("while parsing ")
        what = "the quote" if what == "a quoted scalar" else what  # PyYAML's name for a quoted string
        return Where(file, context.line + 1), (f"not valid YAML: {what} opened here (column {column}) is never "
                                               f"closed: {exc.problem} at line {line}")
    return Where(file, line), (f"not valid YAML: {exc.problem} ({exc.context} at line {context.line + 1}, column "
                               f"{column})")


def _yaml_pairs(node: yaml.MappingNode, loader: yaml.SafeLoader, file: str, errors: Errors):
    """A mapping's (key, value) nodes with `<<` merges applied; keys given twice on the mapping itself are errors
    (PyYAML would silently keep the last)."""
    seen: set[str] = set()
    for key, _ in node.value:
        if key.tag != "tag:yaml.org,2002:merge" and key.value in seen:
            errors.add(Where(file, _line(key), key.value), "field given twice")
        seen.add(key.value)
    try:
        loader.flatten_mapping(node)
    except yaml.YAMLError as exc:
        errors.add(Where(file, _line(node)), f"bad YAML merge: {one_line(exc)}")
    return [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]


def _yaml_layer(node: yaml.MappingNode, loader: yaml.SafeLoader, file: str, errors: Errors) -> Layer:
    layer = Layer(file, _line(node))
    for key, value in _yaml_pairs(node, loader, file, errors):
        layer.fields[key.value] = Value(_yaml_value(key.value, value, loader, file, errors), _line(key),
                                        _entry_lines(value))
    return layer


def _entry_lines(node: yaml.Node) -> dict[str, int] | None:
    """The line of each entry of a list value, and of each key of an entry that is a mapping, by its place under
    the field (`"[1]"`, `"[1].strength"`), for `Layer.where`: an entry's problem is blamed on the entry, not on
    the line of the list's key. Two levels only (a manifest's lists hold paths or flat mappings), so an alias
    that nests a list in itself is not followed."""
    if not isinstance(node, yaml.SequenceNode):
        return None
    lines = {}
    for i, item in enumerate(node.value):
        lines[f"[{i}]"] = _line(item)
        if isinstance(item, yaml.MappingNode):  # merged in by construction: `<<` keys gone, own keys last (they win)
            lines.update((f"[{i}].{k.value}", _line(k)) for k, _ in item.value if isinstance(k, yaml.ScalarNode))
    return lines


def _yaml_value(name: str, node: yaml.Node, loader: yaml.SafeLoader, file: str, errors: Errors) -> Any:
    # Text fields take the scalar's own text: YAML 1.1 would read `aspect: 16:9` as the base-60 integer 969 and
    # `id: 007` as 7.
    if name in STRING_FIELDS and isinstance(node, yaml.ScalarNode) and not _is_null(node):
        return node.value
    if node.tag == "tag:yaml.org,2002:int" and isinstance(node, yaml.ScalarNode):
        digits = sum(c.isdigit() for c in node.value)  # YAML ints may hold "_" and a sign
        if digits > MAX_INT_DIGITS:
            return TooLong(digits)
    try:
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        errors.add(Where(file, _line(node), name), f"bad value: {one_line(exc)}")
        return None


def _explicit_tag(node: yaml.Node) -> bool:
    """Whether a mapping or list node carries a tag other than its plain one (`!!map`/`!!seq` written out are
    plain): composing keeps any tag, and reading the node's items as fields would ignore it."""
    plain = {yaml.MappingNode: "tag:yaml.org,2002:map", yaml.SequenceNode: "tag:yaml.org,2002:seq"}
    return type(node) in plain and node.tag != plain[type(node)]


def _is_null(node: yaml.Node) -> bool:
    return node.tag == "tag:yaml.org,2002:null"


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1
