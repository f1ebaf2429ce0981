"""Property-based: damaged real inputs, every command that reads them, never a traceback.

hypothesis (derandomized, so a failure replays as it is) mutates the real files a user hands
mdtk: the demo model's config.json (values and types of the family's fields, missing keys, bad
JSON) and model.safetensors (header entries, the length field, garbage, and the payload cut,
extended or shifted), the trainer's YAML (every schema key given a value of the wrong type or
range, unknown keys, bad YAML), SFT data rows, and DeepSpeed JSON. Each input goes through every
command that reads that kind of file, run by ``toolkit.cli.main`` in this process; each must exit
non-zero without a traceback, with exactly one `error:` line (`mdtk inspect` lists its problems
instead, `ds-config --check` an `error:` line per problem), and write nothing: no output, no
new file beside the input. The inputs tried per command are in docs/errors.md (the
reliability figure); EXAMPLES sets them.
"""

from __future__ import annotations

import dataclasses
import json
import string
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from dist_checks import bad_input_checks as bic
from dist_checks.bad_input_checks import mdtk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit import bundled
from toolkit.adapters import family_of, read_hf_config
from toolkit.adapters import hfconfig as hc
from toolkit.dsconfig.lint import INT_KEYS, TYPES

ROOT = Path(__file__).resolve().parent.parent
#: Inputs per kind of file (each runs through every command that reads it).
EXAMPLES = {"config": 60, "header": 60, "payload": 30, "yaml": 90, "rows": 40, "deepspeed": 60}


def fuzz(kind: str):
    return settings(max_examples=EXAMPLES[kind], derandomize=True, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def fresh(work: Path) -> Path:
    """A new empty folder for one example."""
    return Path(tempfile.mkdtemp(dir=work))


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def refused(outcome: bic.Outcome, *, lists: bool = False) -> None:
    """Non-zero, no traceback, one `error:` line (``lists``: a problem list instead)."""
    assert outcome.code != 0, outcome.text[-2000:]
    assert "Traceback" not in outcome.text, outcome.text[-4000:]
    if not lists:
        assert len(outcome.errors) == 1, outcome.text[-2000:]


def run_all(commands: list[tuple[list[str], bool]], folder: Path, out: Path) -> None:
    """Each command refused; nothing appears in ``out`` or beside the input in ``folder``."""
    before = listing(folder)
    for argv, lists in commands:
        outcome = mdtk(*argv)
        refused(outcome, lists=lists)
        if lists and "problems:" not in outcome.out:  # inspect's own report, or one line
            assert len(outcome.errors) == 1, outcome.text[-2000:]
        assert listing(out) == [], (argv, listing(out))
        assert listing(folder) == before, argv


# -- values of the wrong JSON type or range ----------------------------------------------------

WORDS = st.text(string.ascii_letters, min_size=1, max_size=8)
LISTS = st.lists(st.integers(-3, 3), min_size=1, max_size=3)
OBJECTS = st.dictionaries(WORDS, st.integers(0, 9), min_size=1, max_size=2)
FRACTIONS = st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: not float(x).is_integer())
NOT_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def wrong_for(kind: hc.Kind) -> st.SearchStrategy:
    """JSON values ``kind`` refuses (each a type or range error)."""
    if kind in (hc.SIZE, hc.COUNT):
        low = 0 if kind is hc.SIZE else -1
        return st.one_of(WORDS, FRACTIONS, st.booleans(), LISTS, OBJECTS,
                         st.integers(-10**6, low))
    if kind is hc.NUMBER:
        return st.one_of(WORDS, st.booleans(), LISTS, OBJECTS, NOT_FINITE)
    if kind is hc.FLAG:
        return st.one_of(WORDS, st.integers(), LISTS, OBJECTS)
    if kind is hc.TEXT:
        return st.one_of(st.integers(), FRACTIONS, st.booleans(), LISTS, OBJECTS)
    if kind is hc.OBJECT:
        return st.one_of(st.integers(), WORDS, LISTS)
    return st.one_of(st.integers(), WORDS, OBJECTS, st.lists(st.integers(), min_size=1))


# -- config.json -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(demo_model) -> dict:
    config = json.loads((demo_model / "config.json").read_text())
    fields = family_of(read_hf_config(demo_model)).fields()
    header, data = bic.safetensors_parts(demo_model / "model.safetensors")
    present = {k: v for k, v in fields.items() if hc.value_at(config, k) is not None}
    return {"path": demo_model, "config": config, "fields": present, "header": header,
            "data": data}


REQUIRED = ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
            "intermediate_size", "architectures"]


@st.composite
def bad_config_text(draw, config: dict, fields: dict[str, hc.Kind]) -> str:
    how = draw(st.sampled_from(["value", "value", "value", "missing", "json", "not an object"]))
    if how == "json":  # cut short: never valid JSON
        text = json.dumps(config, indent=1)
        return text[:draw(st.integers(1, len(text) - 1))]
    if how == "not an object":
        return json.dumps(draw(st.one_of(st.integers(), WORDS, LISTS)))
    config = json.loads(json.dumps(config))
    if how == "missing":
        del config[draw(st.sampled_from(REQUIRED))]
        config.pop("model_type")  # architectures missing: no model_type to fall back on
        return json.dumps(config)
    key = draw(st.sampled_from(sorted(fields)))
    head, _, sub = key.partition(".")
    node = config[head] if sub else config
    node[sub or head] = draw(wrong_for(fields[key]))
    return json.dumps(config)


def model_commands(good: Path, bad: Path, out: Path) -> list[tuple[list[str], bool]]:
    return [(["estimate", "--model", str(bad)], False),
            (["ds-config", "--model", str(bad), "-o", str(out / "ds.json")], False),
            (["plan", "--model", str(bad), "--emit", str(out / "plan")], False),
            (["inspect", str(bad)], True),
            (["convert", str(bad), str(out / "converted"), "--to", "mcore"], False),
            (["verify", str(good), str(bad)], False)]


# -- model.safetensors -------------------------------------------------------------------------

OTHER_SIZE_DTYPES = ["F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F31", "", "f32"]


@st.composite
def bad_header_file(draw, header: dict, data: bytes) -> bytes:
    header = json.loads(json.dumps(header))
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    entry = header[name]
    how = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "add", "rename", "metadata",
                                "entry", "not an object", "garbage", "length"]))
    if how == "dtype":
        entry["dtype"] = draw(st.one_of(st.sampled_from(OTHER_SIZE_DTYPES), st.integers()))
    elif how == "shape":
        entry["shape"] = draw(st.one_of(
            st.lists(st.integers(0, 300), max_size=3).filter(lambda s: s != entry["shape"]),
            st.lists(st.integers(-300, -1), min_size=1, max_size=2), WORDS))
    elif how == "offsets":
        begin, end = entry["data_offsets"]
        shift = draw(st.integers(-64, 64).filter(bool))
        which = draw(st.sampled_from(["begin", "end", "both"]))
        entry["data_offsets"] = [begin + (shift if which != "end" else 0),
                                 end + (shift if which != "begin" else 0)]
    elif how == "drop":
        del header[name]
    elif how == "add":  # a well-formed extra tensor the model does not have
        extra = draw(st.integers(1, 16))
        header[f"model.extra_{draw(WORDS)}"] = {"dtype": "F32", "shape": [extra],
                                                "data_offsets": [len(data), len(data) + 4 * extra]}
        data += bytes(4 * extra)
    elif how == "rename":
        header[f"{name}_{draw(WORDS)}"] = header.pop(name)
    elif how == "metadata":
        header["__metadata__"] = draw(st.one_of(LISTS, st.dictionaries(WORDS, LISTS,
                                                                        min_size=1)))
    elif how == "entry":
        header[name] = draw(st.one_of(WORDS, LISTS, st.integers()))
    elif how == "not an object":
        header = draw(st.one_of(LISTS, WORDS, st.integers()))
    elif how == "garbage":
        raw = draw(st.binary(min_size=1, max_size=64))
        return len(raw).to_bytes(8, "little") + raw + data
    else:
        good = bic.safetensors_bytes(header, data)
        n = int.from_bytes(good[:8], "little")
        wrong = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(n - 64, n + 64)))
        return wrong.to_bytes(8, "little") + good[8:] if wrong != n else good[:4]
    return bic.safetensors_bytes(header, data)


@st.composite
def bad_payload_file(draw, header: dict, data: bytes) -> bytes:
    good = bic.safetensors_bytes(header, data)
    how = draw(st.sampled_from(["cut", "append", "insert", "delete"]))
    start = len(good) - len(data)
    if how == "cut":
        return good[:draw(st.integers(0, len(good) - 1))]
    if how == "append":
        return good + draw(st.binary(min_size=1, max_size=256))
    at = draw(st.integers(start, len(good) - 1))
    if how == "insert":
        return good[:at] + draw(st.binary(min_size=1, max_size=256)) + good[at:]
    return good[:at] + good[at + draw(st.integers(1, len(good) - at)):]


def weight_commands(good: Path, bad: Path, out: Path) -> list[tuple[list[str], bool]]:
    return [(["inspect", str(bad)], True),
            (["convert", str(bad), str(out / "converted"), "--to", "mcore"], False),
            (["verify", str(good), str(bad)], False)]


#: kind -> (the file of the model folder damaged, how, the commands that read it)
MODEL_FILES = {
    "config": ("config.json", lambda m: bad_config_text(m["config"], m["fields"]),
               model_commands),
    "header": ("model.safetensors", lambda m: bad_header_file(m["header"], m["data"]),
               weight_commands),
    "payload": ("model.safetensors", lambda m: bad_payload_file(m["header"], m["data"]),
                weight_commands),
}


@pytest.mark.parametrize("kind", list(MODEL_FILES))
def test_model_folder(model, work, kind):
    name, damage, commands = MODEL_FILES[kind]

    @fuzz(kind)
    @given(st.data())
    def check(data):
        content = data.draw(damage(model))
        case, out = fresh(work), fresh(work)
        bad = bic.copy_model(model["path"], case / "model")
        bic.replace_file(bad, name, content)
        run_all(commands(model["path"], bad, out), bad, out)

    check()


# -- the trainer's YAML ------------------------------------------------------------------------

def schema_fields() -> dict[str, tuple[dataclasses.Field, typing.Any]]:
    """Every key of the trainer's schema by its dotted YAML name: (field, its type)."""
    from toolkit.train.config import TrainConfig
    from toolkit.train.config.typed import key_of

    out: dict[str, tuple[dataclasses.Field, typing.Any]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, tp = f"{prefix}{key_of(f)}", hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, key + ".")
            else:
                out[key] = (f, tp)

    walk(TrainConfig, "")
    return out


BOOL_WORDS = {"true", "false", "yes", "no", "on", "off"}


def wrong_yaml_value(f: dataclasses.Field, tp: typing.Any) -> st.SearchStrategy:
    """Values the schema refuses for field ``f`` of type ``tp`` (type, choices, minimum)."""
    meta = f.metadata
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if type(None) in typing.get_args(tp) and len(args) == 1 else tp
    if meta.get("choices"):
        choices = {str(c) for c in meta["choices"]}
        return st.one_of(WORDS.filter(lambda w: w not in choices), LISTS, OBJECTS)
    options = []
    if base is int:
        options += [WORDS, FRACTIONS, st.booleans(), LISTS, OBJECTS]
    elif base is float:
        options += [WORDS.filter(lambda w: w.lower() not in ("e",)), st.booleans(), LISTS,
                    OBJECTS]
    elif base is bool:
        options += [WORDS.filter(lambda w: w.lower() not in BOOL_WORDS), st.integers(), LISTS,
                    OBJECTS]
    elif base is str:
        options += [LISTS, OBJECTS]
    elif typing.get_origin(base) is list:
        options += [st.lists(LISTS, min_size=1, max_size=2), st.lists(OBJECTS, min_size=1,
                                                                      max_size=2)]
    elif typing.get_origin(base) is tuple:
        options += [st.lists(st.floats(0, 1), max_size=4).filter(lambda v: len(v) != 2), WORDS]
    if meta.get("min") is not None and base in (int, float):
        low = meta["min"]
        options.append(st.integers(-1000, int(low) - 1) if base is int
                       else st.floats(-1e6, low, exclude_max=True, allow_nan=False))
    return st.one_of(options)


@st.composite
def bad_yaml_text(draw, config: dict, fields: dict[str, tuple]) -> str:
    how = draw(st.sampled_from(["value"] * 6 + ["unknown", "section", "yaml", "not a mapping"]))
    config = json.loads(json.dumps(config))
    if how == "yaml":  # an unclosed flow sequence: never valid YAML
        return yaml.safe_dump(config) + f"{draw(WORDS)}: [1, 2\n"
    if how == "not a mapping":
        return yaml.safe_dump(draw(st.one_of(LISTS, WORDS, st.integers())))
    sections = [k for k, v in config.items() if isinstance(v, dict)]
    if how == "unknown":
        where = draw(st.sampled_from([None, *sections]))
        node = config if where is None else config[where]
        node[draw(WORDS.filter(lambda w: w not in node and w not in fields))] = 1
    elif how == "section":
        config[draw(st.sampled_from(sections))] = draw(st.one_of(st.integers(), WORDS, LISTS))
    else:
        key = draw(st.sampled_from(sorted(fields)))
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = draw(wrong_yaml_value(*fields[key]))
    return yaml.safe_dump(config)


@pytest.fixture(scope="module")
def trainer_yaml(demo_model) -> dict:
    config = yaml.safe_load(bundled.path(bundled.SFT_EXAMPLE).read_text())
    config["model"]["path"] = str(demo_model)
    return config


def yaml_commands(config: Path, out: Path) -> list[tuple[list[str], bool]]:
    return [(["train", str(config), "--check"], False),
            (["data", "preview", str(config), f"data.cache_dir={out / 'cache'}"], False)]


def test_trainer_yaml(trainer_yaml, work):
    # data.cache_dir is set by the preview's override (yaml_commands): a damaged value of it in
    # the file is replaced, so the preview rightly runs
    fields = {k: v for k, v in schema_fields().items() if k != "data.cache_dir"}

    @fuzz("yaml")
    @given(st.data())
    def check(data):
        case, out = fresh(work), fresh(work)
        config = {**trainer_yaml, "output_dir": str(out / "run")}
        (case / "train.yaml").write_text(data.draw(bad_yaml_text(config, fields)))
        run_all(yaml_commands(case / "train.yaml", out), case, out)

    check()


# -- SFT data rows -----------------------------------------------------------------------------

NOT_TEXT = st.one_of(st.integers(), FRACTIONS, st.booleans(), LISTS, OBJECTS)


@st.composite
def bad_rows_text(draw, rows: list[dict]) -> str:
    """The rows as JSON Lines with one row damaged as its format allows."""
    rows = json.loads(json.dumps(rows))
    i = draw(st.integers(0, len(rows) - 1))
    row, lines = rows[i], [json.dumps(r) for r in rows]
    own = ["field", "drop"] if "prompt" in row else ["turns", "turn"]
    how = draw(st.sampled_from(["json", "not an object", *own, *own]))
    if how == "json":  # cut short: never valid JSON
        lines[i] = lines[i][:draw(st.integers(1, len(lines[i]) - 1))]
    elif how == "not an object":
        lines[i] = json.dumps(draw(st.one_of(st.integers(), WORDS, LISTS)))
    else:
        if how == "field":
            row[draw(st.sampled_from(["prompt", "response"]))] = draw(NOT_TEXT)
        elif how == "drop":
            del row["prompt"]
        elif how == "turns":
            row["messages"] = draw(st.one_of(WORDS, st.integers(), OBJECTS))
        else:  # one turn without a role, or content that is not text (roles pass as given:
            # chat templates define their own)
            turn = draw(st.sampled_from(row["messages"]))
            if draw(st.booleans()):
                del turn["role"]
            else:
                turn["content"] = draw(st.one_of(st.integers(), st.booleans(), OBJECTS))
        lines[i] = json.dumps(row)
    return "\n".join(lines) + "\n"


def rows_commands(config: Path) -> list[tuple[list[str], bool]]:
    return [(["data", "preview", str(config)], False)]


def test_data_rows(trainer_yaml, work):
    rows = [json.loads(line) for line in
            bundled.path("examples/data/sft.jsonl").read_text().splitlines()[:24]]

    @fuzz("rows")
    @given(st.data())
    def check(data):
        case, out = fresh(work), fresh(work)
        (case / "rows.jsonl").write_text(data.draw(bad_rows_text(rows)))
        config = {**trainer_yaml, "output_dir": str(out / "run")}
        config["data"] = {**config["data"], "sources": [str(case / "rows.jsonl")],
                          "validation_split": 0.0, "cache_dir": str(out / "cache")}
        (case / "train.yaml").write_text(yaml.safe_dump(config))
        run_all(rows_commands(case / "train.yaml"), case, out)

    check()


# -- DeepSpeed JSON ----------------------------------------------------------------------------

@st.composite
def bad_deepspeed_text(draw, configs: list[dict]) -> str:
    config = json.loads(json.dumps(draw(st.sampled_from(configs))))
    how = draw(st.sampled_from(["typed"] * 4 + ["stage", "zero int", "json", "not an object"]))
    if how == "json":
        text = json.dumps(config, indent=1)
        return text[:draw(st.integers(1, len(text) - 1))]
    if how == "not an object":
        return json.dumps(draw(st.one_of(st.integers(), WORDS, LISTS)))
    zero = config["zero_optimization"]
    if how == "stage":
        zero["stage"] = draw(st.one_of(st.integers().filter(lambda s: s not in range(4)),
                                       WORDS, LISTS))
    elif how == "zero int":
        key = draw(st.sampled_from([k for k in INT_KEYS if k in zero]))
        zero[key] = draw(st.one_of(WORDS, LISTS, OBJECTS, FRACTIONS))
    else:
        present = [k for k in TYPES if hc.value_at(config, k) is not None]
        key = draw(st.sampled_from(present))
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[last] = draw(wrong_for(TYPES[key]).filter(lambda v: v != "auto"))
    return json.dumps(config, indent=1)


def deepspeed_commands(config: Path) -> list[tuple[list[str], bool]]:
    return [(["ds-config", "--check", str(config)], True)]


def test_deepspeed_json(work):
    configs = [json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
               for name in ("zero1", "zero2", "zero3", "zero2_offload_cpu")]

    @fuzz("deepspeed")
    @given(st.data())
    def check(data):
        case, out = fresh(work), fresh(work)
        (case / "ds.json").write_text(data.draw(bad_deepspeed_text(configs)))
        ((argv, _),) = deepspeed_commands(case / "ds.json")
        outcome = mdtk(*argv)
        refused(outcome, lists=True)
        assert outcome.errors, outcome.text[-2000:]  # one `error:` line per problem
        assert listing(out) == [] and listing(case) == ["ds.json"]

    check()


# -- the reliability figure --------------------------------------------------------------------

def inputs_per_command() -> dict[str, int]:
    """`mdtk COMMAND` -> the damaged inputs it is given per run of this file."""
    p = Path("x")
    readers = {kind: commands(p, p, p) for kind, (_, _, commands) in MODEL_FILES.items()}
    readers.update(yaml=yaml_commands(p, p), rows=rows_commands(p),
                   deepspeed=deepspeed_commands(p))
    out: dict[str, int] = {}
    for kind, commands in readers.items():
        for argv, _ in commands:
            words = argv[:2] if argv[0] == "data" else argv[:1]
            name = " ".join(words + [a for a in ("--model", "--check") if a in argv])
            out[name] = out.get(name, 0) + EXAMPLES[kind]
    return out


def test_reliability_figure_is_documented():
    """docs/errors.md states the inputs each command gets here, and their total."""
    text = (ROOT / "docs" / "errors.md").read_text()
    counts = inputs_per_command()
    for name, n in counts.items():
        assert f"| `mdtk {name}` | {n} |" in text, (name, n)
    assert f"{sum(EXAMPLES.values())} damaged inputs" in text
    assert f"{sum(counts.values())} command runs" in text
