"""The pybind11 surface of the C++ core: zero-copy arrays, typed errors, names."""

import numpy as np
import pytest

from pagedserve import _core
from pagedserve.errors import BlockPoolError, OutOfBlocksError, RequestRejectedError, UnknownRequestError


def test_scheduler_output_arrays_are_views_without_copies():
    s = _core.Scheduler(_core.SchedulerConfig(4, 64, 256), 8, 16)
    s.add_request("a", list(range(1, 20)), _core.StopCriteria(2))
    out = s.schedule()
    arr = out.slot_mapping
    assert arr.dtype == np.int32 and not arr.flags.owndata
    assert np.shares_memory(arr, out.slot_mapping)  # two reads view the same C++ buffer
    assert out.block_tables.shape == (1, 2)
    np.testing.assert_array_equal(out.query_start_loc, [0, 19])
    np.testing.assert_array_equal(out.positions, np.arange(19))
    np.testing.assert_array_equal(out.logits_indices, [18])
    [u] = s.update([5])
    assert u.request_id == "a" and u.token_id == 5 and not u.finished


def test_typed_errors_cross_into_python():
    pool = _core.BlockPool(2)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free(b)
    pool.allocate(), pool.allocate()
    with pytest.raises(OutOfBlocksError):
        pool.allocate()
    kv = _core.KVCacheManager(2, 16)
    with pytest.raises(UnknownRequestError):
        kv.can_append(3, 1)
    s = _core.Scheduler(_core.SchedulerConfig(4, 64, 32), 8, 16)
    with pytest.raises(RequestRejectedError, match="maximum context length is 32"):
        s.add_request("x", list(range(30)), _core.StopCriteria(3))
    with pytest.raises(ValueError):  # RequestRejectedError is a ValueError too
        s.add_request("y", [], _core.StopCriteria(3))
    assert not s.has_unfinished_requests()
