"""The pybind11 surface of the C++ core: zero-copy arrays, the decision /
model-input split, typed errors, one set of defaults."""

import numpy as np
import pytest

from pagedserve import _core, errors
from pagedserve.errors import (
    BlockPoolError,
    InvalidArgumentError,
    OutOfBlocksError,
    PagedServeError,
    RequestRejectedError,
    UnknownRequestError,
)


def test_scheduler_output_and_model_input_are_views_without_copies():
    s = _core.Scheduler(_core.SchedulerConfig(4, 64, 256), 8, 16)
    s.add_request("a", list(range(1, 20)), _core.StopCriteria(2))
    out = s.schedule()
    np.testing.assert_array_equal(out.token_ids, np.arange(1, 20))
    np.testing.assert_array_equal(out.num_scheduled_tokens, [19])
    inp = _core.ModelInput(out)
    arr = inp.slot_mapping
    assert arr.dtype == np.int64 and not arr.flags.owndata  # int64 from the block table on
    assert np.shares_memory(arr, inp.slot_mapping)  # two reads view the same C++ buffer
    assert inp.input_ids.dtype == np.int64 and inp.positions.dtype == np.int64
    assert inp.block_tables.shape == (1, 2) and inp.block_tables.dtype == np.int32
    np.testing.assert_array_equal(inp.query_start_loc, [0, 19])
    np.testing.assert_array_equal(inp.positions, np.arange(19))
    np.testing.assert_array_equal(inp.logits_indices, [18])
    blocks = out.block_ids
    np.testing.assert_array_equal(arr, [blocks[p // 16] * 16 + p % 16 for p in range(19)])
    with pytest.raises(ValueError, match="read-only"):  # C++ reads the decision again: Python cannot edit it
        out.block_table_offsets[1] = 10**8
    [u] = s.update([5])
    assert u.request_id == "a" and u.token_id == 5 and not u.finished


def test_an_update_hands_python_the_sequence_record_itself_read_only_and_outliving_the_scheduler():
    s = _core.Scheduler(_core.SchedulerConfig(4, 64, 256), 8, 16)
    s.add_request("a", [1, 2, 3], _core.StopCriteria(2), n_seqs=2)
    s.schedule()
    first, second = (u.sequence for u in s.update([5, 6]))
    assert (first.request_id, first.index, second.index) == ("a", 0, 1)
    assert first.output_token_ids == [5] and second.output_token_ids == [6] and first.num_prompt_tokens == 3
    s.schedule()
    [u, _] = s.update([7, 8])
    assert u.sequence.output_token_ids == [5, 7] and first.output_token_ids == [5, 7]  # one record, read again
    assert u.finished and first.finish_reason == _core.FinishReason.LENGTH and not s.has_unfinished_requests()
    with pytest.raises(UnknownRequestError):  # the scheduler let go of it; the record Python holds stays
        s.output_token_ids("a", 1)
    assert second.output_token_ids == [6, 8] and second.num_output_tokens == 2
    with pytest.raises(AttributeError):  # Python reads the record, never writes it
        first.num_prompt_tokens = 0


def test_a_record_aborted_with_unverified_drafts_keeps_only_its_output():
    s = _core.Scheduler(_core.SchedulerConfig(4, 64, 256), 8, 16)
    s.add_request("a", [1, 2, 3], _core.StopCriteria(10))
    s.schedule()
    [u] = s.update([5])
    assert s.add_draft_tokens("a", 0, [6, 7, 8]) == 3
    s.schedule()  # the drafts are scheduled: a step fails here, say, and the request is aborted
    assert s.abort("a")
    assert u.sequence.output_token_ids == [5] and u.sequence.num_output_tokens == 1


def test_every_core_error_is_a_pagedserve_error_and_the_matching_builtin():
    for cls, builtin in [(RequestRejectedError, ValueError), (UnknownRequestError, KeyError),
                         (InvalidArgumentError, ValueError), (errors.KernelArgumentError, ValueError),
                         (errors.ModelLoadError, ValueError), (errors.BackendUnavailableError, ValueError),
                         (BlockPoolError, Exception), (OutOfBlocksError, Exception)]:
        assert issubclass(cls, PagedServeError) and issubclass(cls, builtin), cls


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
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        _core.Scheduler(_core.SchedulerConfig(0, 64, 32), 8, 16)
    s.add_request("z", [1, 2, 3], _core.StopCriteria(3))
    s.schedule()
    with pytest.raises(InvalidArgumentError, match="sampled tokens"):
        s.update([1, 2])


def test_precondition_failures_are_not_reported_as_out_of_blocks():
    kv = _core.KVCacheManager(8, 16, True)
    kv.allocate(0, 40)
    tokens = list(range(40))
    kv.cache_full_blocks(0, tokens, 40)
    match = kv.match_prefix(tokens + [99], "")
    assert len(match.block_ids) == 2
    with pytest.raises(InvalidArgumentError, match="shorter than the cached prefix"):
        kv.allocate(1, 16, match)


def test_python_defaults_are_the_cxx_ones():
    from pagedserve.config import EngineArgs

    cxx, args = _core.SchedulerConfig(), EngineArgs()
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.enable_prefix_caching) == (
        cxx.max_num_seqs, cxx.max_num_batched_tokens, cxx.enable_prefix_caching)
    assert cxx.max_num_batched_tokens == 2048
    import pagedserve

    assert pagedserve.SchedulerConfig is _core.SchedulerConfig  # one SchedulerConfig, the core's
    assert not hasattr(pagedserve.config, "SchedulerConfig")
