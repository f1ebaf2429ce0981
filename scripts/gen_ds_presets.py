"""Regenerate ds_configs/ (presets + README table) from mdtk's DeepSpeed config generator."""

from __future__ import annotations

from pathlib import Path

from toolkit.dsconfig.presets import write_presets

if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    for path in write_presets(root / "ds_configs"):
        print(path.relative_to(root))
