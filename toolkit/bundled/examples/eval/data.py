"""The bundled tasks' data: JSON lines beside this file, read offline (lm-eval's
``custom_dataset`` hook, so the tasks work from any folder)."""

from pathlib import Path

import datasets


def arithmetic(**kwargs):
    return _jsonl("arithmetic.jsonl")


def sentences(**kwargs):
    return _jsonl("sentences.jsonl")


def _jsonl(name: str) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).parent / name)})
