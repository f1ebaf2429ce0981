"""What tests/test_bad_inputs.py runs: `mdtk` in a process (``mdtk``), damaged copies of a real
model folder (``damage``), and the two sides of "one plain process trains like a 1-rank launch".

- ``python -m dist_checks.bad_input_checks CASES.json RESULTS.json``: one plain process (no
  launcher environment), as a user types `mdtk train ...`. Each case but the last runs
  ``toolkit.cli.main`` in turn (all are refused) and its exit status and output go to
  RESULTS.json; the last one (a valid config) then trains as a world of one and ends the
  process as `mdtk train` does.
- ``train_reference``: the same valid run on a 1-rank pool, in the launcher's environment
  (RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun sets them for one rank).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import typer.main


@dataclass
class Outcome:
    """What a shell would see of one `mdtk` command."""

    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    @property
    def errors(self) -> list[str]:
        """The `error:` lines (stdout and stderr)."""
        return [line for line in self.text.splitlines() if line.startswith("error:")]


#: typer's own builder of an app's click command
_build_command = typer.main.get_command


@functools.cache
def _command(app: Any) -> Any:
    """typer's click command of ``app``, built once: typer builds the whole command tree at
    every call of the app (every command's signature and type hints read, ~20 ms), which a
    real `mdtk` process does once; the fuzz tests run ~1000 commands in one process."""
    return _build_command(app)


def mdtk(*argv: str) -> Outcome:
    """`mdtk ARGV` run by ``toolkit.cli.main`` in this process: its exit status, stdout and
    stderr. An exception that escapes ``main`` is what the process would die of: it is recorded
    as its traceback with status 1. MDTK_DEBUG is unset meanwhile (it keeps tracebacks). The
    command tree is built once per process (``_command``), as `mdtk` builds it once."""
    from toolkit import cli, errors

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch.object(sys, "argv", ["mdtk", *argv]), mock.patch.dict(os.environ), \
            mock.patch.object(typer.main, "get_command", _command):
        os.environ.pop(errors.DEBUG_ENV, None)
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except Exception:  # noqa: BLE001 - a bug: the traceback the user would see
            err.write(traceback.format_exc())
            code = 1
    return Outcome(code, out.getvalue(), err.getvalue())


# -- damaged copies of a model folder --------------------------------------------------------

def safetensors_parts(path: Path) -> tuple[dict[str, Any], bytes]:
    """(header dict, data bytes) of a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def safetensors_bytes(header: Any, data: bytes) -> bytes:
    """A safetensors file of ``header`` (any JSON) and ``data``, the length field right."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def copy_model(src: Path, dst: Path) -> Path:
    """A copy of an HF folder whose files can be replaced one by one (the weights linked, so a
    case that damages only config.json costs no copy)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).symlink_to(f.resolve())
    return dst


def replace_file(folder: Path, name: str, content: bytes | str) -> None:
    (folder / name).unlink()
    if isinstance(content, str):
        (folder / name).write_text(content)
    else:
        (folder / name).write_bytes(content)


def damage(src: Path, dst: Path, how: str) -> Path:
    """``src`` copied to ``dst`` with one damage a user meets: ``header`` (the safetensors
    header's JSON overwritten), ``truncated`` (half the file), ``shape`` (one tensor 6 columns
    short), ``type`` (config.json's hidden_size a word)."""
    folder = copy_model(src, dst)
    weights = folder / "model.safetensors"
    if how == "header":
        raw = bytearray(weights.read_bytes())
        raw[8:20] = b"garbage!!!!!"
        replace_file(folder, weights.name, bytes(raw))
    elif how == "truncated":
        raw = weights.read_bytes()
        replace_file(folder, weights.name, raw[:len(raw) // 2])
    elif how == "shape":
        header, data = safetensors_parts(weights)
        name = "model.layers.0.mlp.down_proj.weight"
        rows, cols = header[name]["shape"]
        header, data = _reshaped(header, data, name, (rows, cols - 6))
        replace_file(folder, weights.name, safetensors_bytes(header, data))
    elif how == "type":
        config = json.loads((folder / "config.json").read_text())
        config["hidden_size"] = "sixty-four"
        replace_file(folder, "config.json", json.dumps(config, indent=1))
    else:
        raise ValueError(how)
    return folder


def _reshaped(header: dict, data: bytes, name: str, shape: tuple[int, ...]
              ) -> tuple[dict, bytes]:
    """A consistent file where ``name`` has ``shape`` (its bytes cut or zero-padded)."""
    itemsize = {"F32": 4, "BF16": 2, "F16": 2}[header[name]["dtype"]]
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"][0])
    out, parts, at = dict(header), [], 0
    for key, entry in entries:
        begin, end = entry["data_offsets"]
        chunk = data[begin:end]
        if key == name:
            size = itemsize
            for n in shape:
                size *= n
            chunk = (chunk + bytes(size))[:size]
        out[key] = {**entry, "shape": list(shape) if key == name else entry["shape"],
                    "data_offsets": [at, at + len(chunk)]}
        parts.append(chunk)
        at += len(chunk)
    return out, b"".join(parts)


# -- one plain process vs a 1-rank launch ----------------------------------------------------

def train_argv(model: Path, out: Path) -> list[str]:
    """`mdtk train` of the bundled SFT example on ``model`` (the demo's tiny Llama), short."""
    return ["train", "bundled:examples/sft_tiny.yaml", "parallel.tp=1", "parallel.pp=1",
            f"model.path={model}", f"output_dir={out}", f"export.hf_dir={out / 'hf'}",
            "train.steps=6", "optim.warmup_steps=2", "train.eval_interval=0",
            "checkpoint.interval=0", "checkpoint.resume=none"]


def train_reference(argv: list[str]) -> dict[str, Any]:
    """Rank function: ``argv`` (a `train_argv`) trained by the trainer in this rank."""
    from toolkit.train import trainer
    from toolkit.train.config import load_config

    result = trainer.run(load_config(argv[1], argv[2:]))
    return {"losses": result.losses, "export_dir": result.export_dir,
            "export_diff": result.export_max_abs_diff}


def main(cases_file: str, results_file: str) -> None:
    cases = json.loads(Path(cases_file).read_text())
    *refused, valid = cases
    results: dict[str, Any] = {}
    for case in refused:
        results[case["name"]] = asdict(mdtk(*case["argv"]))
        Path(results_file).write_text(json.dumps(results))  # the valid run ends the process
    sys.argv = ["mdtk", *valid["argv"]]
    from toolkit import cli

    cli.main()


if __name__ == "__main__":
    main(*sys.argv[1:])
