"""The import layers of h3render, checked statically: no upward import, no import circle across folders, and a
torch-free front end.

The layer map, top to bottom. A module may import its own layer or any lower one, never a higher one; imports inside
functions count the same as top-level ones (a function-level import does not make an upward edge legal).

=====  ==============  =============================================================================================
layer  name            modules (and why they sit there)
=====  ==============  =============================================================================================
  7    front end       cli, cli_*, settings, runner, manifest, manifest_formats, manifest_fields, suggest, jobs, shards,
                       dry_run, job_keyframes, job_references, job_loras, batch, report, locks, signals: torch-free on import
                       (manifest lines to `Job`s and run settings, the batch loop); they reach the job path's
                       torch modules only inside functions.
  6    job path        engine, warmup, adaln_cache, render, tasks/, seams, sidecar, keyframes, references,
                       ref_packing, media, staging, colour, graphs, timing, outputs, progress, parallel/, memplan,
                       text_phase, block_stream, dit_swap, pinned: what renders one job (torch, PyAV, process groups). sidecar (the sidecar's
                       format, its write, read and compare), outputs (a job's file paths, the resume check) and
                       progress (the denoise loop's step display) are torch-free themselves: the front end imports
                       them at load, and the job path may too.
  5    writers         make_checkpoint/: the on-disk checkpoint writers of `h3render make-checkpoint`; they read
                       checkpoint/ (registry, names, built-in weights), which never reads them.
  4    checkpoint      checkpoint/: layouts, streaming, the built-in random models (`builtin`), the release
                       registry, FastH3 adapters and students.
  3    schedules       sampling: sigma schedules, the Euler step, the denoise loop. Below checkpoint because a
                       FastH3 checkpoint states its few-step schedule (`checkpoint.contract` returns a
                       `sampling.Schedule`); it imports only packing and spec (and the DiT's type).
  2    models          models/: pure torch modules, no I/O.
  1    kernels         h3render.kernels (h3render/kernels/): Triton kernels beside their torch references.
  0    foundation      the package root (`__version__`), spec (geometry facts and request rules, torch-free),
                       windows (a long clip's window plan, torch-free: jobs plan it, render and seams follow it),
                       errors (`RenderError`) and exits (every exit code and the error classes that map to them),
                       both torch-free: every layer names them; and packing (the
                       packed-row layout the DiT itself takes): imported by every layer.
=====  ==============  =============================================================================================

An import circle among modules of one sub-package folder (checkpoint/, parallel/, tasks/) is tolerated by issue #22;
a circle across folders, or among the package root's own modules, is not. `ALLOWED_UPWARD` and `ALLOWED_CYCLES`
name known exceptions, each with the reason it is allowed (none today).
"""

from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Source folder -> import name (pyproject `[tool.setuptools.package-dir]`).
SOURCES = {"h3render": REPO / "h3render"}

LAYERS: dict[int, tuple[str, ...]] = {
    7: ("h3render.__main__", "h3render.cli", "h3render.cli_*", "h3render.settings", "h3render.manifest", "h3render.manifest_formats",
        "h3render.manifest_fields", "h3render.suggest",
        "h3render.jobs", "h3render.dry_run", "h3render.shards", "h3render.job_keyframes", "h3render.job_references", "h3render.job_loras",
        "h3render.batch", "h3render.report", "h3render.locks", "h3render.signals", "h3render.runner"),
    6: ("h3render.engine", "h3render.warmup", "h3render.adaln_cache", "h3render.render", "h3render.tasks", "h3render.tasks.*", "h3render.sidecar",
        "h3render.keyframes", "h3render.references", "h3render.ref_packing", "h3render.media", "h3render.soundtrack",
        "h3render.staging", "h3render.colour",
        "h3render.graphs", "h3render.text_graph", "h3render.timing", "h3render.outputs", "h3render.progress", "h3render.parallel",
        "h3render.parallel.*", "h3render.memplan", "h3render.text_phase", "h3render.block_stream", "h3render.seams",
        "h3render.dit_swap", "h3render.pinned", "h3render.compile_prefetch"),
    5: ("h3render.make_checkpoint", "h3render.make_checkpoint.*"),
    4: ("h3render.checkpoint", "h3render.checkpoint.*"),
    3: ("h3render.sampling",),
    2: ("h3render.models", "h3render.models.*"),
    1: ("h3render.kernels", "h3render.kernels.*"),
    0: ("h3render", "h3render.spec", "h3render.errors", "h3render.exits", "h3render.packing", "h3render.presets",
        "h3render.windows"),
}
LAYER_NAMES = {7: "front end", 6: "job path", 5: "writers", 4: "checkpoint", 3: "schedules", 2: "models",
               1: "kernels", 0: "foundation"}
# The front end's modules that must import without torch (a manifest is checked before anything heavy loads).
TORCH_FREE = ("h3render.make_checkpoint.targets", "h3render.spec", "h3render.windows", "h3render.errors", "h3render.exits", "h3render.runner", "h3render.sidecar", "h3render.jobs", "h3render.manifest", "h3render.manifest_formats",
              "h3render.manifest_fields", "h3render.suggest", "h3render.shards", "h3render.dry_run",
              "h3render.job_keyframes", "h3render.job_references", "h3render.job_loras", "h3render.outputs",
              "h3render.settings", "h3render.batch", "h3render.report", "h3render.locks", "h3render.progress",
              "h3render.signals", "h3render.cli",
              # what the front end's checks read before any heavy import (a typo answers at once, issue #29): the
              # checkpoint's configs and registry, the student contract's file, the launcher's rank, keyframes
              "h3render.checkpoint.info", "h3render.checkpoint.releases", "h3render.checkpoint.contract",
              "h3render.parallel.launcher", "h3render.keyframes")

# Known exceptions (none since the task seam landed: render no longer imports engine).
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_CYCLES: set[frozenset[str]] = set()


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def scan() -> tuple[dict[str, Path], dict[str, dict[str, list[tuple[int, bool]]]]]:
    """Every module of h3render/ and its imports of our own modules.

    Returns:
        (modules: import name -> file, edges: importer -> imported -> [(line, inside a function)]). An imported
        name resolves to the longest module prefix that exists (`from h3render.spec import FPS` -> `h3render.spec`,
        `from h3render.checkpoint import load` -> `h3render.checkpoint.load`).
    """
    modules = {}
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts and (path.parent / "__init__.py").is_file():
                modules[_module_name(path, root, package)] = path
    modules.setdefault("h3render.presets", REPO / "presets" / "__init__.py")

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, list[tuple[int, bool]]]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        anchor = name if is_package else name.rpartition(".")[0]
                        for _ in range(child.level - 1):
                            anchor = anchor.rpartition(".")[0]
                        base = f"{anchor}.{base}" if base else anchor
                    targets = [f"{base}.{alias.name}" for alias in child.names]
                else:
                    visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                    continue
                for target in targets:
                    if not target.startswith("h3render"):
                        continue
                    home = resolve(target)
                    sites = edges.setdefault(name, {}).setdefault(home, []) if home not in (None, name) else None
                    if sites is not None and (child.lineno, in_function) not in sites:
                        sites.append((child.lineno, in_function))

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return modules, edges


def layer_of(module: str) -> int | None:
    for layer, patterns in LAYERS.items():
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return layer
    return None


def cycles(modules, edges) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(edges.get(start, ())))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _folder(module: str, modules: dict[str, Path]) -> str:
    return str(modules[module].parent)


def test_every_module_has_a_layer():
    modules, _ = scan()
    unplaced = sorted(m for m in modules if layer_of(m) is None)
    assert not unplaced, f"place these modules in LAYERS (tests/unit/test_layering.py): {unplaced}"


def test_no_upward_import():
    modules, edges = scan()
    upward = []
    for importer, imported in edges.items():
        for target, sites in imported.items():
            if (importer, target) in ALLOWED_UPWARD:
                continue
            low, high = layer_of(importer), layer_of(target)
            if low is not None and high is not None and high > low:
                where = ", ".join(f"{modules[importer].relative_to(REPO)}:{line}{' (in a function)' if inner else ''}"
                                  for line, inner in sites)
                upward.append(f"{importer} ({LAYER_NAMES[low]}) imports {target} ({LAYER_NAMES[high]}) at {where}")
    assert not upward, "\n".join(upward)


def test_no_import_circle_across_folders():
    modules, edges = scan()
    bad = []
    for component in cycles(modules, edges):
        folders = {_folder(m, modules) for m in component}
        # one sub-package folder (checkpoint/, parallel/, tasks/, ...) is tolerated; the package root is not.
        if len(folders) == 1 and folders != {str(SOURCES["h3render"])} or component in ALLOWED_CYCLES:
            continue
        bad.append(sorted(component))
    assert not bad, f"import circles: {bad}"


def test_the_allow_lists_name_live_problems_only():
    # An entry that no longer matches anything is stale: delete it, so the lists only ever shrink.
    modules, edges = scan()
    live_cycles = set(cycles(modules, edges))
    assert ALLOWED_CYCLES <= live_cycles, f"stale ALLOWED_CYCLES: {ALLOWED_CYCLES - live_cycles}"
    stale = {pair for pair in ALLOWED_UPWARD if pair[1] not in edges.get(pair[0], {})}
    assert not stale, f"stale ALLOWED_UPWARD: {stale}"


def test_the_scan_sees_function_level_and_relative_imports(tmp_path):
    # The scanner itself: a function-level import is an edge, and the known facade-free homes resolve.
    modules, edges = scan()
    assert "h3render.spec" in edges["h3render.checkpoint.releases"]
    assert edges["h3render.dry_run"]["h3render.sidecar"][0][1] is True  # imported inside plan_lines
    assert layer_of("h3render.checkpoint.builtin") == 4 and layer_of("h3render.cli_options") == 7
    assert cycles({"a": 0, "b": 0, "c": 0}, {"a": {"b": []}, "b": {"a": []}, "c": {"a": []}}) == [frozenset("ab")]


def test_the_front_end_imports_no_torch():
    present = [m for m in TORCH_FREE if (REPO / (m.replace(".", "/") + ".py")).is_file()]
    code = ("import importlib, sys\n"
            f"for name in {present!r}:\n"
            "    importlib.import_module(name)\n"
            "heavy = sorted(m for m in ('torch', 'av', 'transformers', 'triton') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]


def _bare_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a Python that sees the venv's packages but not its .pth files, so h3render is NOT installed (the
    editable finder is never set up) and the checkout is not on sys.path: a GPU machine's `python scripts/...`."""
    site = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    prelude = f"import sys; sys.path[:] = [p for p in sys.path if p] + {site!r}\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no wheel on a PYTHONPATH either
    return subprocess.run([sys.executable, "-S", "-c", prelude + code], capture_output=True, text=True, timeout=120,
                          cwd="/", env=env)


def test_a_bare_checkout_on_sys_path_adds_no_top_level_package_of_ours():
    # The package does not append the repository root to its own __path__: from a bare checkout on sys.path,
    # h3render and its kernels import, h3render.scripts and h3render.tests do not; and the root holds no folder that
    # takes a PyPI package's import name (a top-level `kernels/` did: transformers 5.25's `from kernels import ...`
    # then failed on it, and with it `python -m pytest` in the checkout).
    done = _bare_python(f"sys.path.insert(0, {str(REPO)!r})\nimport importlib.util, h3render\n"
                        "print([importlib.util.find_spec(n) is None for n in "
                        "('h3render.kernels', 'h3render.scripts', 'h3render.tests')])\n"
                        # Only a kernels.py or kernels/__init__.py at the root fails: PyPI's (CI's venv lies inside
                        # the checkout) or a namespace portion (no origin: a checkout updated across the move keeps
                        # an ignored kernels/__pycache__, which never shadows an installed package) pass.
                        "import os\nspec = importlib.util.find_spec('kernels')\n"
                        "where = os.path.relpath(spec.origin, sys.path[0]) if spec and spec.origin else '..'\n"
                        "print(where.startswith('..') or where.count(os.sep) > 1)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[False,", "True,", "True]", "True"]


def test_scripts_bootstrap_maps_presets_from_the_checkout():
    # find_spec, not an import, for the kernels: their package imports torch, which this check does not need.
    done = _bare_python(f"sys.path.insert(0, {str(REPO / 'scripts')!r})\nimport _bootstrap\n"
                        "import importlib.util, h3render, h3render.presets, h3render.jobs\n"
                        "kernels = importlib.util.find_spec('h3render.kernels')\n"
                        "print(h3render.__file__, kernels.origin, h3render.jobs.PRESETS_DIR, 'torch' in sys.modules)")
    assert done.returncode == 0, done.stderr[-3000:]
    package, kernel, presets, torch_loaded = done.stdout.split()
    assert Path(package) == REPO / "h3render" / "__init__.py" and torch_loaded == "False"
    assert Path(kernel) == REPO / "h3render" / "kernels" / "__init__.py" and Path(presets) == REPO / "presets"
