"""requirements.lock stays in step with pyproject.toml (`make lock` after changing either)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import lockfile  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest brings tomli there
    import tomli as tomllib


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]
            + project["optional-dependencies"]["test"]]


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12"])
def test_lock_pins_every_requirement_within_its_range(python):
    env = {"python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux"}
    pinned: dict[str, list[str]] = {}
    for name, version, marker in lockfile.pins(ROOT / "requirements.lock"):
        if not marker or Requirement(f"x ; {marker}").marker.evaluate(env):
            pinned.setdefault(name, []).append(version)
    for req in _requirements():
        versions = pinned.get(lockfile._name(req.name), [])
        assert len(versions) == 1, (req.name, python, versions)  # one version per Python
        assert req.specifier.contains(versions[0], prereleases=True), (req, versions)
    assert pinned["torch"] == ["2.13.0"] and pinned["uv"]  # the CPU build here; the installer


def test_lock_lines_parse(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("# header\nNumPy==2.2.6 ; python_full_version < '3.11'\n    # via x\n"
                    "numpy==2.4.6 ; python_full_version >= '3.11'\ntyping_extensions==4.16.0\n")
    assert lockfile.pins(lock) == [("numpy", "2.2.6", "python_full_version < '3.11'"),
                                   ("numpy", "2.4.6", "python_full_version >= '3.11'"),
                                   ("typing-extensions", "4.16.0", "")]
    assert lockfile._by_key(lock) == {
        "numpy": "2.2.6 ; python_full_version < '3.11', 2.4.6 ; python_full_version >= '3.11'",
        "typing-extensions": "4.16.0"}
    lock.write_text("torch>=2.4\n")
    with pytest.raises(SystemExit, match="not name==version"):
        lockfile.pins(lock)
