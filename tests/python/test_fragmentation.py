"""The allocator experiment runs the real C++ allocator and its numbers add up."""

import pytest

from pagedserve.experiments.fragmentation import WORKLOADS, contiguous, paged, sample_lengths


@pytest.mark.parametrize("workload", WORKLOADS)
def test_paged_holds_more_requests_with_less_waste(workload):
    lengths = sample_lengths(workload, 2000, 2048, seed=1)
    assert all(1 <= p and 1 <= o and p + o <= 2048 for p, o in lengths)
    pg, ct = paged(lengths, 1024, 16), contiguous(lengths, 1024 * 16, 2048)
    # paged reserves whole blocks only: never more than one partial block per request
    assert pg["tokens"] <= pg["reserved"] <= pg["tokens"] + 15 * pg["admitted"]
    assert pg["reserved"] <= 1024 * 16
    expected = sum(-(-(p + o) // 16) for p, o in lengths[:pg["admitted"]]) * 16
    assert pg["reserved"] == expected
    assert ct["admitted"] == 8 and pg["admitted"] >= ct["admitted"]
    assert pg["tokens"] / pg["reserved"] > ct["tokens"] / ct["reserved"]
