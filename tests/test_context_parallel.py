"""Context parallelism without Transformer Engine (toolkit.models.cp_attention), on gloo ranks.

The attention alone against full-sequence SDPA (forward, dq, dk, dv) at cp2 and cp4: causal
GQA, causal MHA, and causal with a right-padding key mask (SFT batches). float64 inputs: the
only difference from the reference is the summation order, so the bound is tight.
"""

from __future__ import annotations

import pytest
from dist_checks import cp_checks

ATOL = 1e-10


@pytest.fixture(scope="module")
def attention_2(rank_pool_2):
    return rank_pool_2.run(cp_checks.attention_checks)


@pytest.fixture(scope="module")
def attention_4(rank_pool_4):
    return rank_pool_4.run(cp_checks.attention_checks)


@pytest.mark.parametrize("kind", ["gqa", "mha", "padded"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_full_sdpa(attention_2, attention_4, cp, kind):
    ranks = attention_2 if cp == 2 else attention_4
    assert len(ranks) == cp
    for r in ranks:
        errs = r[kind]
        assert errs["scale"] > 0.1  # the outputs and grads are not trivially small
        for name in ("out", "dq", "dk", "dv"):
            assert errs[name] < ATOL, (cp, kind, name, errs)
