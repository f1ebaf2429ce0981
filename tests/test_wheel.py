"""The built wheel on its own: installed into a fresh virtualenv (dependencies from this project's
venv), ``mdtk demo`` runs from a temporary folder, reads only files shipped inside the wheel and
writes only under that folder. The same run is the demo's own check (it learns, its export matches
transformers, its output is the story on one screen): one demo run in the suite, not two."""

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


def _run(argv: list, **kwargs) -> str:
    """Run a command; on failure show its output (stdout, stderr) in the assertion."""
    return _run_both(argv, **kwargs)[0]


def _run_both(argv: list, **kwargs) -> tuple[str, str]:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, proc.stderr


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


def _fresh_venv(tmp: Path, wheel: Path, env: dict[str, str]) -> Path:
    """A venv holding only the wheel; a .pth line puts this venv's site-packages after it (a
    plain path line: the .pth files there, such as mdtk's editable install, stay unread). pip
    runs without the checkout on its path too: there it would find the checkout's
    mdtk.egg-info, take mdtk 0.1.0 as installed and skip the wheel."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                env=env)
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site.strip()) / "project_deps.pth").write_text("\n".join(deps) + "\n")
    said = _run_both([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                      "--no-index", wheel], env=env)
    installed = Path(site.strip()) / "toolkit" / "__init__.py"
    assert installed.is_file(), f"pip did not install the wheel's toolkit; it said:\n{said}"
    return venv


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
@pytest.mark.late  # a venv install and the demo: after the background async_io build
def test_wheel_install_runs_the_demo_from_any_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path), env)
    work = tmp_path / "work"  # away from the checkout (python -c puts the current folder first)
    work.mkdir()
    data = Path(_run([venv / "bin" / "python", "-c", "import toolkit.bundled as b; "
                      "print(b.path(b.DATA))"], cwd=work, env=env).strip())
    assert data.is_relative_to(venv) and data.is_dir()  # the wheel's copy, not the checkout's
    package = data.parents[2]  # .../site-packages/toolkit
    before = _files(package)

    stdout, stderr = _run_both([venv / "bin" / "mdtk", "demo"], cwd=work, env=env, timeout=900)

    out = work / "build" / "demo"  # the default --out, under the current folder
    assert (out / "tiny-llama" / "config.json").is_file()
    assert (out / "sft" / "hf" / "config.json").is_file()
    summary = json.loads((out / "sft" / "summary.json").read_text())
    vals = {int(k): v for k, v in summary["val_losses"].items()}
    assert min(vals) == 0 and max(vals) == summary["steps"]
    assert vals[max(vals)] < vals[0] - 0.3  # fine-tuning lowered the validation loss
    assert summary["export_max_abs_diff"] is not None
    assert summary["export_max_abs_diff"] <= 1e-4  # transformers' logits vs the trained model
    resolved = json.loads((out / "sft" / "config.resolved.json").read_text())
    assert resolved["data"]["sources"] == [str(data / "sft.jsonl")]
    assert (work / resolved["output_dir"]).resolve() == (out / "sft").resolve()
    assert _files(package) == before  # nothing written into the installed package
    _assert_story_on_one_screen(stdout + stderr)
    _assert_evals_at_the_interval(out / "sft", resolved, summary["steps"], stdout + stderr)


def _assert_evals_at_the_interval(run: Path, resolved: dict, steps: int, text: str) -> None:
    """The example's eval: section ran lm-eval on the live model at its interval and at the end:
    metrics.jsonl and the log hold its metrics, samples.jsonl its completions."""
    every, (task,) = resolved["eval"]["interval"], resolved["eval"]["tasks"]
    due = sorted({s for s in range(1, steps + 1) if s % every == 0} | {steps})
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: r[f"eval/{task}/acc"] for r in rows if f"eval/{task}/acc" in r}
    assert sorted(acc) == due and len(due) >= 2, (acc, due)
    assert all(0.0 <= v <= 1.0 for v in acc.values()), acc
    assert all("extra" not in r for r in rows)  # flattened into the line, not nested
    for step in due:
        assert f"step {step} eval: {task}/acc " in text, text
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in samples}) == due
    assert all(r["finish_reason"] in ("eos", "length") and r["completion_ids"] for r in samples)


def _assert_story_on_one_screen(text: str) -> None:
    """The demo's output is the story: no library banners or untitled bars around it."""
    lines = text.splitlines()
    assert len(lines) <= 40, text
    for noise in ("Setting accelerator to CPU",  # DeepSpeed, without DS_ACCELERATOR
                  "OMP_NUM_THREADS",  # torchrun's banner when the launcher leaves it unset
                  "Generating train split", "Map", "Writing model shards", "Loading weights",
                  "Traceback", "WARNING"):
        assert noise not in text, (noise, text)
    story = ["model: tiny Llama", "2 ranks, dp=2", "deepspeed: chose ZeRO-", "validation loss "
             "before training", "exported HF checkpoint", "training loss", "max abs diff"]
    for words in story:
        assert words in text, (words, text)
    assert [x.split()[1] for x in lines if x.startswith("tokenising")] == ["train", "validation"]
