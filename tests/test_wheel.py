"""The built wheel on its own: installed into a fresh virtualenv (dependencies from this project's
venv), ``mdtk demo`` runs from a temporary folder, reads only files shipped inside the wheel and
writes only under that folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO_STEPS = 20  # enough for the demo's own check that the losses fall; the full run is in
# test_trainer.py


def _run(argv: list, **kwargs) -> str:
    """Run a command; on failure show its output (stdout, stderr) in the assertion."""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _build_wheel(tmp: Path) -> Path:
    """``pip wheel`` of a copy of the sources (the checkout gets no build/ or egg-info)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("toolkit", "model_adapters"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          dist, src])
    (wheel,) = dist.glob("mdtk-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A venv holding only the wheel; a .pth line puts this venv's site-packages after it (a
    plain path line: the .pth files there, such as mdtk's editable install, stay unread)."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site.strip()) / "project_deps.pth").write_text("\n".join(deps) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
          "--no-index", wheel])
    return venv


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_wheel_install_runs_the_demo_from_any_folder(tmp_path):
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    work = tmp_path / "work"  # away from the checkout (python -c puts the current folder first)
    work.mkdir()
    data = Path(_run([venv / "bin" / "python", "-c", "import toolkit.bundled as b; "
                      "print(b.path(b.DATA))"], cwd=work, env=env).strip())
    assert data.is_relative_to(venv) and data.is_dir()  # the wheel's copy, not the checkout's
    package = data.parents[2]  # .../site-packages/toolkit
    before = _files(package)

    _run([venv / "bin" / "mdtk", "demo", "--steps", DEMO_STEPS], cwd=work, env=env, timeout=600)

    out = work / "build" / "demo"  # the default --out, under the current folder
    assert (out / "tiny-llama" / "config.json").is_file()
    assert (out / "sft" / "hf" / "config.json").is_file()
    summary = json.loads((out / "sft" / "summary.json").read_text())
    assert summary["steps"] == DEMO_STEPS and summary["export_max_abs_diff"] <= 1e-4
    resolved = json.loads((out / "sft" / "config.resolved.json").read_text())
    assert resolved["data"]["sources"] == [str(data / "sft.jsonl")]
    assert (work / resolved["output_dir"]).resolve() == (out / "sft").resolve()
    assert _files(package) == before  # nothing written into the installed package
