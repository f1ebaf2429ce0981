"""One home for each rule (``toolkit.rules``): every place that applies a compatibility rule (the
trainer's checks and engine, the DeepSpeed lint and generator, the memory model, the planner)
refuses exactly what the rule refuses, with the rule's words; each rule, the recompute choices
and the precision table are written once; every error a user can fix derives from ``UserError``.
All in-process and torch-free (pure functions on a grid), so the whole file runs in about a
second."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from toolkit import rules
from toolkit.dsconfig.generator import Request, validate_request
from toolkit.dsconfig.lint import lint
from toolkit.errors import ConfigError, UserError
from toolkit.memory import Cluster, TrainShape, ZeroOptions, estimate, load_model_shape
from toolkit.memory.model import model_shape_from_hf
from toolkit.parallel.layout import LayoutError, ParallelLayout, ResolvedLayout
from toolkit.planner.search import zero_allowed
from toolkit.train.loop.engine_rules import EngineError, check_supported

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5)
GRID = [(stage, pp, experts, clip) for stage in (0, 1, 2, 3) for pp in (1, 2)
        for experts in (False, True) for clip in (True, False)]


def _refusal(call, *args, **kwargs) -> str | None:
    try:
        call(*args, **kwargs)
    except (UserError, ValueError) as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def shapes():
    return {False: model_shape_from_hf(TINY), True: load_model_shape("qwen1.5-moe-a2.7b")}


def test_the_rules_themselves():
    """The truth the engine tests established (tests/test_train_engine.py, docs/training.md):
    the engine runs ZeRO 1-2 with pp>1, ZeRO-0 only without clipping; the configs leave out
    ZeRO-2 with pp>1; ZeRO-3 never with pp>1 or experts. The advice names what is allowed."""
    engine = {s for s in (0, 1, 2, 3) if rules.zero_problem(s, pp=2, configs=False) is None}
    configs = {s for s in (0, 1, 2, 3) if rules.zero_problem(s, pp=2) is None}
    assert engine == {1, 2} and configs == {1}
    assert rules.zero_problem(0, pp=2, clipping=False) is None
    assert {s for s in (0, 1, 2, 3) if rules.zero_problem(s, experts=True) is None} == {1, 2}
    z3 = rules.zero_problem(3, pp=2)
    assert "zero_stage 1 with pp>1" in z3 and "1 or 2" not in z3
    assert "zero_stage 1 or 2 with pp>1" in rules.zero_problem(3, pp=2, configs=False)
    assert rules.zero_problem(4) == "zero_optimization.stage=4: choose 0, 1, 2 or 3."
    assert rules.offload_problems(3, "nvme", "nvme") == []
    assert len(rules.offload_problems(2, "nvme", "cpu")) == 2
    assert rules.zeropp_stage_problem(3) is None and rules.zeropp_groups_problem(1, 1) is None


def test_every_caller_refuses_what_the_rules_refuse(shapes):
    """The trainer's check, the generator (a fixed stage), the planner, the lint and the memory
    model, over stage x pp x experts x clipping: the same verdict and the rule's own words."""
    for stage, pp, experts, clip in GRID:
        want = rules.zero_problem(stage, pp=pp, experts=experts, clipping=clip)
        ds = {"zero_optimization": {"stage": stage}, "gradient_clipping": float(clip)}
        case = (stage, pp, experts, clip)
        trainer = _refusal(check_supported, ds, pp=pp, has_experts=experts, configs=True)
        assert trainer == want, case
        req = Request(model=shapes[experts], cluster=Cluster(1, 2), stage=str(stage),
                      layout=ParallelLayout(pp=pp), gradient_clipping=float(clip))
        assert _refusal(validate_request, req) == want, case
        if clip:
            assert zero_allowed(stage, pp, experts) == (want is None), case
        pipeline = rules.zero_with_pipeline(stage, pp, clipping=clip)
        report = lint({**ds, "train_batch_size": 2 // pp, "train_micro_batch_size_per_gpu": 1,
                       "gradient_accumulation_steps": 1}, world_size=2,
                      layout=ParallelLayout(pp=pp), run_deepspeed=False)
        assert report.errors == ([pipeline] if pipeline else []), case
        layout = ParallelLayout(pp=pp).resolve(2)
        memory = _refusal(estimate, shapes[False], TrainShape(seq_len=64), layout,
                          ZeroOptions(stage=stage))
        assert memory == rules.zero_with_pipeline(stage, pp, clipping=False), case


def test_the_engine_alone_runs_zero2_with_pipelines():
    ds = {"zero_optimization": {"stage": 2}}
    check_supported(ds, pp=2)  # build_engine's check
    with pytest.raises(EngineError, match="ZeRO stage 2 with pp=2"):
        check_supported(ds, pp=2, configs=True)  # the trainer's


def test_offload_and_zeropp_rules_say_the_same_everywhere():
    key, reason = rules.offload_problems(2, "none", "cpu")[0]
    assert key == "offload_param"
    with pytest.raises(ValueError) as e:
        ZeroOptions(stage=2, offload_param="cpu")
    assert reason in str(e.value)
    report = lint({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                  run_deepspeed=False)
    assert any(reason in err for err in report.errors), report.errors
    stage = rules.zeropp_stage_problem(2)
    with pytest.raises(ValueError, match=re.escape(stage)):
        ZeroOptions(stage=2, hpz=8)
    with pytest.raises(ConfigError, match=re.escape(stage)):
        validate_request(Request(model=model_shape_from_hf(TINY), cluster=Cluster(2, 8),
                                 stage="2", hpz=8))


def test_recompute_choices_come_from_the_rules():
    from toolkit.commands.options import RECOMPUTE as option
    from toolkit.planner.cost import Candidate
    from toolkit.planner.search import SearchSpace
    from toolkit.train.config.schema import TrainSection

    assert rules.RECOMPUTE == ("none", "selective", "full")
    assert SearchSpace().recomputes == rules.RECOMPUTE
    schema = TrainSection.__dataclass_fields__["recompute"].metadata
    assert tuple(schema["choices"]) == rules.RECOMPUTE
    assert option.help == "none, selective, full."
    for bad in (TrainShape, Candidate):
        assert _refusal(bad, recompute="some") == rules.recompute_problem("some")


def test_a_resolved_layout_is_its_own_type():
    layout = ParallelLayout(tp=2, ep=2).resolve(8)
    assert isinstance(layout, ResolvedLayout) and (layout.dp, layout.world_size) == (4, 8)
    assert layout.resolve(8) is layout and layout.dp_cp == 4 and layout.expert_dp == 2
    assert not hasattr(ParallelLayout(), "world_size")  # unresolved: no world to ask
    with pytest.raises(LayoutError, match="ep\\*etp = 4\\*1 = 4 must divide"):
        ResolvedLayout(tp=1, ep=4, dp=2)  # the cross checks hold however it is made


def _sources() -> list[Path]:
    return sorted(p for d in ("toolkit", "model_adapters") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("needle", [
    r"with pp>1 is not supported", r"cannot combine ZeRO-2/3", r"ZeRO-0 clipping norm counts",
    r"\"none\",\s*\"selective\",\s*\"full\"", r"consecutive world ranks, not from",
    r"parameter offload needs ZeRO stage 3", r"only ZeRO-3 uses it",
])
def test_each_rule_is_written_once(needle):
    where = [str(p.relative_to(ROOT)) for p in _sources() if re.search(needle, p.read_text())]
    assert where == ["toolkit/rules.py"], where


def test_precisions_are_one_table():
    from toolkit.checkpoint.torchfree.dtypes import PRECISIONS
    from toolkit.convert.run import DTYPES
    from toolkit.memory.states import DTYPE_BYTES

    assert DTYPES is PRECISIONS and DTYPE_BYTES == {"bf16": 2, "fp16": 2, "fp32": 4}
    tables = [str(p.relative_to(ROOT)) for p in _sources()
              if re.search(r"\"bf16\":\s*(\d|torch\.|dtypes\.|BFLOAT16)", p.read_text())]
    assert tables == ["toolkit/checkpoint/torchfree/dtypes.py"], tables


def test_every_error_a_user_can_fix_derives_from_user_error():
    """Every class named ``...Error`` in toolkit/ reaches ``UserError`` through its bases (the
    CLI prints those as one ``error:`` line)."""
    bases: dict[str, list[str]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def reaches_user_error(name: str) -> bool:
        return name == "UserError" or any(reaches_user_error(b) for b in bases.get(name, ()))

    errors = [n for n in bases if n.endswith("Error") and n != "UserError"]
    assert len(errors) > 15
    assert [n for n in errors if not reaches_user_error(n)] == []


def test_cp_attention_problem_names_what_it_cannot_compute():
    """One rule for the CP attention (at build) and the families' early check (before build)."""
    assert rules.cp_attention_problem() is None
    assert "sliding-window" in rules.cp_attention_problem(window_size=(4, 0))
    assert "softmax_type=learnable" in rules.cp_attention_problem(softmax_type="learnable")
