"""ParallelLayout: every bad layout fails early, and the message names the number and the fix."""

from __future__ import annotations

import pytest

from toolkit.parallel import LayoutError, ParallelLayout


def test_dp_is_inferred_from_world_size():
    layout = ParallelLayout(tp=2, pp=2).resolve(16)
    assert layout.dp == 4
    assert layout.world_size == 16
    assert ParallelLayout(tp=1, cp=2, ep=4).resolve(8).expert_dp == 2
    assert ParallelLayout(tp=2, cp=2, ep=4).resolve(8).expert_dp == 1


@pytest.mark.parametrize(
    ("layout", "world", "needles"),
    [
        (ParallelLayout(tp=2, pp=2), 6, ["world size 6", "tp*pp*cp", "4"]),
        (ParallelLayout(tp=2, dp=3), 4, ["world size 4", "dp=2"]),
        (ParallelLayout(tp=1, ep=4), 2, ["ep*etp", "4", "dp*cp*tp", "2"]),
        (ParallelLayout(tp=2, ep=2, etp=2), 2, ["ep*etp = 2*2 = 4"]),
    ],
)
def test_world_size_errors_name_the_numbers(layout, world, needles):
    with pytest.raises(LayoutError) as e:
        layout.resolve(world)
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "model", "needles"),
    [
        ({"tp": 3}, dict(num_layers=4, num_heads=8),
         ["num_attention_heads=8", "tp=3", "[1, 2, 4, 8]"]),
        ({"tp": 4}, dict(num_layers=4, num_heads=8, num_query_groups=2),
         ["num_key_value_heads", "=2", "tp=4", "[1, 2]"]),
        ({"pp": 3}, dict(num_layers=4, num_heads=8), ["num_hidden_layers=4", "pp=3"]),
        ({"pp": 2, "vpp": 3}, dict(num_layers=8, num_heads=8), ["pp*vpp = 2*3 = 6", "8"]),
        ({"ep": 3}, dict(num_layers=4, num_heads=8, num_experts=8), ["num_experts=8", "ep=3"]),
        ({"ep": 2}, dict(num_layers=4, num_heads=8), ["ep=2", "mixture-of-experts"]),
        ({"tp": 2}, dict(num_layers=4, num_heads=8, ffn_hidden_size=11),
         ["intermediate_size=11", "tp=2"]),
        ({"cp": 2}, dict(num_layers=4, num_heads=8, seq_len=30), ["seq_len=30", "2*cp = 4"]),
        ({"tp": 2, "sequence_parallel": True}, dict(num_layers=4, num_heads=8, seq_len=7),
         ["seq_len=7", "tp=2"]),
    ],
)
def test_model_errors_name_the_numbers(kwargs, model, needles):
    with pytest.raises(LayoutError) as e:
        ParallelLayout(**kwargs).validate_model(**model)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_seq_len_checked_alone_for_any_5d_layout():
    """The trainer checks the sequence length before the model is known: a layout with ep, pp
    and sp must not be judged against made-up model sizes (tp2 x ep2 + sp was refused)."""
    ParallelLayout(tp=2, pp=2, ep=2, sequence_parallel=True).validate_seq_len(32)
    with pytest.raises(LayoutError, match=r"seq_len=31 is not divisible by tp=2"):
        ParallelLayout(tp=2, ep=2, sequence_parallel=True).validate_seq_len(31)
    with pytest.raises(LayoutError, match=r"2\*cp = 4"):
        ParallelLayout(cp=2).validate_seq_len(30)
    # with cp, sequence parallelism splits each CP rank's part over tp: tp*cp must divide
    ParallelLayout(tp=2, cp=2, sequence_parallel=True).validate_seq_len(32)
    with pytest.raises(LayoutError, match=r"seq_len=36 is not divisible by tp\*cp = 4\*2"):
        ParallelLayout(tp=4, cp=2, sequence_parallel=True).validate_seq_len(36)


def test_valid_model_passes():
    ParallelLayout(tp=2, pp=2, vpp=2, ep=2).validate_model(
        num_layers=8, num_heads=8, num_query_groups=2, num_experts=8, vocab_size=1001,
        ffn_hidden_size=64, seq_len=32,
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tp": 0}, "tp=0"),
        ({"pp": -1}, "pp=-1"),
        ({"tp": 2.0}, "tp=2.0"),
        ({"vpp": 2}, "vpp=2 needs pipeline parallelism"),
        ({"sequence_parallel": True}, "sequence_parallel=True needs tp >= 2"),
    ],
)
def test_bad_sizes_rejected(kwargs, needle):
    with pytest.raises(LayoutError, match=needle.replace("(", r"\(").replace("*", r"\*")):
        ParallelLayout(**kwargs)


def test_describe():
    assert ParallelLayout(tp=2, pp=2, vpp=2).resolve(8).describe() == "dp=2 tp=2 pp=2 vpp=2"


def test_context_parallel_runs_without_transformer_engine():
    from toolkit.parallel import check_supported

    check_supported(ParallelLayout(cp=2))  # mdtk's CP attention: no Transformer Engine needed
    check_supported(ParallelLayout(cp=1))
