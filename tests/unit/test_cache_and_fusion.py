import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mpitrain.engine import buckets as buckets_module
from mpitrain.engine.cache import ResponseCache
from mpitrain.engine.fusion import Piece, plan
from mpitrain.engine.negotiation import Response
from mpitrain.engine.request import Entry, Kind, Request, describe_mismatch


def test_cache_assigns_bits_in_order_and_reuses_lowest_free():
    cache = ResponseCache(capacity=4)
    assert [cache.insert(n, n)[0] for n in "abc"] == [0, 1, 2]
    cache.evict(1)
    cache.evict(0)
    assert cache.insert("e", "e") == (0, None)
    assert cache.lookup("e") == 0 and cache.lookup("a") is None
    assert cache.num_bits == 3 and len(cache) == 2


def test_full_cache_evicts_least_recently_run():
    cache = ResponseCache(capacity=3)
    for n in "abc":
        cache.insert(n, n)
    cache.touch(cache.lookup("a"))  # a ran again: b is now the oldest
    bit, evicted = cache.insert("d", "d")
    assert evicted == 1 and bit == 1 and cache.lookup("b") is None
    assert cache.lookup("d") == 1 and len(cache) == 3


def test_zero_capacity_caches_nothing():
    cache = ResponseCache(capacity=0)
    assert cache.insert("a", 1) == (None, None) and len(cache) == 0


def test_cache_update_in_place():
    cache = ResponseCache(capacity=2)
    cache.insert("a", 1)
    assert cache.insert("a", 2) == (0, None) and cache.entry(0) == ("a", 2)


def _piece(nbytes, dtype="float32"):
    resp = Response("x", (0,), None)
    a = np.zeros(nbytes // 4, np.float32)
    return Piece(resp, 0, a, a, dtype)


def test_fusion_groups_by_key_and_threshold():
    pieces = [("f32", _piece(40)), ("f64", _piece(40)), ("f32", _piece(40)), ("f32", _piece(40))]
    buckets = plan(pieces, threshold=80)
    assert [len(b) for b in buckets] == [2, 1, 1]
    assert buckets[0][0] is pieces[0][1] and buckets[0][1] is pieces[2][1]


def test_fusion_oversized_piece_travels_alone():
    buckets = plan([("k", _piece(400)), ("k", _piece(4))], threshold=100)
    assert [len(b) for b in buckets] == [1, 1]


def test_fusion_disabled_with_zero_threshold():
    buckets = plan([("k", _piece(4)) for _ in range(3)], threshold=0)
    assert len(buckets) == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["f32", "f64"]), st.integers(0, 8)), max_size=12),
       st.integers(0, 40))
def test_fusion_cuts_as_gradient_buckets_are_cut(items, threshold):
    """Fusion's shortcut for one key within the threshold cuts as buckets.plan does."""
    pieces = [(key, _piece(4 * n)) for key, n in items]
    expected = [[pieces[i][1] for i in group]
                for group in buckets_module.plan([(k, p.nbytes) for k, p in pieces], threshold)]
    assert plan(pieces, threshold) == expected


def _meta(shape, dtype="float32", kind=Kind.ALLREDUCE, op=0, root=-1):
    e = Entry(input=np.zeros(shape, np.float32), shape=shape, dtype=dtype)
    return Request("t", kind, [e], root=root).meta() if op == 0 else \
        Request("t", kind, [e], op=op, root=root).meta()


def test_mismatch_messages_name_tensor_and_both_values():
    msg = describe_mismatch("grad", _meta((3, 4)), 0, _meta((3, 5)), 1)
    assert "'grad'" in msg and "(3, 4)" in msg and "(3, 5)" in msg and "rank 1" in msg
    msg = describe_mismatch("w", _meta((2,), "float32"), 0, _meta((2,), "float64"), 3)
    assert "dtype" in msg and "float32" in msg and "float64" in msg
    msg = describe_mismatch("b", _meta((2,), kind=Kind.BROADCAST, root=0), 0,
                            _meta((2,), kind=Kind.BROADCAST, root=1), 1)
    assert "root rank" in msg
