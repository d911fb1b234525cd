"""The wheel is the product: pyproject names every package folder, and a plain (non-editable) install renders from
outside the checkout (issue 13 item 1: `pip install .` once shipped without presets and with a top-level `kernels`)
and carries the docs, JSON schemas and SLURM script that `--help` names (issue 29: it shipped none of them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests._mp4 import decode

REPO = Path(__file__).resolve().parents[2]
# Source folder on disk -> import name in the wheel (pyproject [tool.setuptools.package-dir]).
ROOTS = {"h3render": "h3render"}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _packages_on_disk() -> set[str]:
    """Every folder under h3render/ holding an __init__.py, named as imported, plus the presets and the
    docs (data packages)."""
    found = {"h3render.presets", "h3render.docs"}
    for folder, name in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    return found


def test_pyproject_packages_are_the_package_folders_on_disk():
    tool = _pyproject()["tool"]["setuptools"]
    assert sorted(tool["packages"]) == sorted(_packages_on_disk())
    assert tool["package-dir"] == {"h3render": "h3render", "h3render.presets": "presets", "h3render.docs": "docs"}
    # no top-level folder may take the name of an importable package: `kernels/` shadowed PyPI's `kernels`, which
    # transformers 5.25 imports, whenever the checkout's root was on sys.path (README's `python -m pytest`)
    assert not (REPO / "kernels").exists()
    assert (REPO / "presets" / "__init__.py").is_file() and (REPO / "docs" / "__init__.py").is_file()
    assert tool["package-data"] == {"h3render.presets": ["*.yaml"],
                                    "h3render.docs": ["*.md", "schema/*.json", "h3render.sbatch"]}
    # The wheel's copy of the batch script is the checkout's one script, through a link (one home).
    assert (REPO / "docs" / "h3render.sbatch").resolve() == (REPO / "scripts" / "h3render.sbatch").resolve()


def _shipped_docs() -> set[str]:
    """docs/*.md, docs/schema/*.json, the SLURM script and the package's two modules (`python -m h3render.docs`), as
    paths inside the wheel."""
    docs = REPO / "docs"
    files = [*docs.glob("*.md"), *docs.glob("schema/*.json"), docs / "h3render.sbatch", docs / "__init__.py",
             docs / "__main__.py"]
    assert len(files) >= 8  # sidecar, manifest, slurm, performance, fasth3 .md; two schemas; the script
    return {"h3render/docs/" + path.relative_to(docs).as_posix() for path in files}


def _expected_wheel_files() -> set[str]:
    """The .py files of every package and the preset YAMLs, as paths inside the wheel."""
    files = {f"h3render/presets/{p.name}" for p in (REPO / "presets").iterdir() if p.suffix in (".py", ".yaml")}
    files |= _shipped_docs()
    for folder, name in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            relative = path.relative_to(REPO / folder)
            if "__pycache__" not in relative.parts and (path.parent / "__init__.py").is_file():
                files.add("/".join((*name.split("."), *relative.parts)))
    return files


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment of a user who activated the new venv: nothing pointing into the checkout or the outer venv."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "H3RENDER_", "PIP_")) and k != "__PYVENV_LAUNCHER__"}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), PYTHONNOUSERSITE="1")
    return env


def _run(args: list, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:3]} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_renders_from_outside_the_checkout(tmp_path):
    # Build from a copy of the sources the wheel is made of, so the build leaves no build/ or egg-info in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    for folder in ("h3render", "presets", "docs", "scripts"):  # docs/h3render.sbatch links into scripts/
        shutil.copytree(REPO / folder, src / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    # --no-build-isolation: the build backend is this venv's setuptools (the test extra pins its floor), so the build
    # neither reaches for an index nor installs setuptools into a throwaway environment (~10 s of CI time).
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-w", dist, "-q"],
         cwd=tmp_path)
    [wheel] = dist.glob("h3render-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names} == {"h3render", wheel.name.split("-py")[0] + ".dist-info"}
    assert {n for n in names if ".dist-info/" not in n} == _expected_wheel_files()

    # A venv without pip (faster); the outer interpreter's pip installs into it. Its dependencies (torch, av, ...)
    # come from the running interpreter's site-packages through a .pth path line. Python appends such a path to
    # sys.path without reading the .pth files inside it, so the outer venv's editable finder
    # (__editable__.h3render-*.pth) is never installed there; the new site-packages stays first on sys.path.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    outer = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    (site / "_outer_dependencies.pth").write_text("".join(f"{p}\n" for p in outer), encoding="utf-8")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _clean_env(venv)
    probe = _run([python, "-c", "import sys, h3render, h3render.kernels, h3render.presets\n"
                  "print(h3render.__file__); print(h3render.kernels.__file__); print(h3render.presets.__file__)\n"
                  "print(any('editable' in type(f).__name__.lower() or 'editable' in repr(f).lower()"
                  " for f in sys.meta_path))"], cwd=elsewhere, env=env)
    *files, editable_finder = probe.stdout.split()
    for file in files:
        assert Path(file).resolve().is_relative_to(venv.resolve()), file
        assert not Path(file).resolve().is_relative_to(REPO), file
    assert editable_finder == "False"

    # `--help` points at `python -m h3render.docs`, which lists the installed docs, schemas and batch script.
    # Both helps from one interpreter of the venv (each `h3render ... --help` process spends ~5 s importing torch).
    helps = _run([python, "-c", "from click.testing import CliRunner\nfrom h3render.cli import cli\n"
                  "for c in ('prompt', 'batch'):\n    print(c, ' '.join(CliRunner().invoke(cli, [c, '--help']).output.split()))"],
                 cwd=elsewhere, env=env).stdout.splitlines()
    assert [line.split()[0] for line in helps] == ["prompt", "batch"]
    for line in helps:
        assert "python -m h3render.docs" in line, line  # click rewraps the lines
    listing = _run([python, "-m", "h3render.docs"], cwd=elsewhere, env=env).stdout.splitlines()
    installed = Path(listing[0].split(": ", 1)[1])
    assert installed.resolve().is_relative_to(venv.resolve()) and not installed.resolve().is_relative_to(REPO)
    shipped = {line.strip() for line in listing[1:]}
    assert {"sidecar.md", "manifest.md", "slurm.md", "schema/sidecar.schema.json",
            "schema/batch-report.schema.json", "h3render.sbatch"} <= shipped
    for name in shipped:
        source = REPO / "scripts" / name if name == "h3render.sbatch" else REPO / "docs" / name
        assert (installed / name).read_bytes() == source.read_bytes(), name

    presets = _run([venv / "bin" / "h3render", "presets"], cwd=elsewhere, env=env).stdout
    for yaml_file in (REPO / "presets").glob("*.yaml"):
        assert any(line.startswith(yaml_file.stem + " ") for line in presets.splitlines()), yaml_file.stem

    # The tiny built-in model: 22 frames is its shortest clip (17n + 5 within its 22-362), 2 sigma points = 1 step.
    out = tmp_path / "out" / "a.mp4"
    _run([venv / "bin" / "h3render", "prompt", "x", "-o", out, "--frames", "22", "--steps", "2", "--device", "cpu"],
         cwd=elsewhere, env=env)
    frames, samples = decode(out)
    assert frames.shape[0] == 22 and frames.shape[3] == 3
    assert samples.shape[0] == 2 and samples.shape[1] >= 22 * 32000 // 24  # stereo, at least the clip's length
    assert out.with_suffix(".json").is_file()
