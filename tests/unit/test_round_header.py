"""The round's ride areas (engine/header.py): what a rank packs, and what every rank reduces.

Each "rank" here is a RoundWire over a stand-in communicator, all sharing one cache as the
real ranks share identical ones; the exchange itself is an MPI all-gather (tests/mpi).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpitrain.core.dtypes import ReduceOp
from mpitrain.engine.cache import ResponseCache
from mpitrain.engine.header import RoundWire, can_ride
from mpitrain.engine.request import Entry, Kind, Request
from mpitrain.ops import reference


class _Comm:
    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size


def _request(name, values, op=ReduceOp.SUM, pre=1.0, post=1.0, kind=Kind.ALLREDUCE,
             device="cpu"):
    x = np.asarray(values)
    dtype = {np.float32: "float32", np.float64: "float64", np.int64: "int64",
             np.float16: "float16"}[x.dtype.type]
    entry = Entry(input=x, shape=x.shape, dtype=dtype, output=np.empty_like(x))
    return Request(name=name, kind=kind, entries=[entry], op=op, prescale=pre, postscale=post,
                   device=device)


def _ranks(size, area_bytes=256):
    cache = ResponseCache(64)
    return cache, [RoundWire(_Comm(size), cache, 0, area_bytes) for _ in range(size)]


def _cached(cache, request):
    bit, _ = cache.insert(request.name, request.meta())
    return bit


def _areas(wires, per_rank):
    """Each rank offers its requests (bit -> request) and packs its area."""
    areas = []
    for wire, hits in zip(wires, per_rank):
        for bit, request in hits.items():
            wire.offer(bit, request)
        areas.append(wire._area(hits))
    return areas


def test_only_small_single_cpu_elementwise_allreduces_ride():
    assert can_ride(_request("a", np.ones(4, np.float32)), 256)
    assert not can_ride(_request("a", np.ones(100, np.float32)), 256)  # 400 bytes
    assert not can_ride(_request("a", np.ones(4, np.float32), op=ReduceOp.ADASUM), 256)
    assert not can_ride(_request("a", np.ones(4, np.float32), kind=Kind.BROADCAST), 256)
    assert not can_ride(_request("a", np.ones(4, np.float32), device="cuda"), 256)


def test_both_ranks_reduce_the_gathered_inputs_as_the_reference_does():
    size = 2
    cache, wires = _ranks(size)
    cases = [("sum", np.float32, ReduceOp.SUM, 1.0, 1.0),
             ("avg", np.float64, ReduceOp.AVERAGE, 2.0, 1.0),
             ("max", np.int64, ReduceOp.MAX, 1.0, 1.0),
             ("h", np.float16, ReduceOp.SUM, 0.5, 3.0)]
    per_rank = [{} for _ in range(size)]
    bits = {}
    for name, dtype, op, pre, post in cases:
        for r in range(size):
            request = _request(name, (np.arange(5) * (r + 1) + 0.25 * r).astype(dtype),
                               op, pre, post)
            bits[name] = _cached(cache, request)
            per_rank[r][bits[name]] = request
    areas = _areas(wires, per_rank)
    ready = sum(1 << b for b in bits.values())
    results = [wire.reduced(areas, ready) for wire in wires]
    for name, _dtype, op, pre, post in cases:
        inputs = [per_rank[r][bits[name]].entries[0].input for r in range(size)]
        plain_op, post_as_sum = (ReduceOp.SUM, post / size) if op == ReduceOp.AVERAGE \
            else (op, post)
        want = reference.reduce(inputs, inputs[0].dtype.name, plain_op, pre, post_as_sum)
        for got in results:
            assert got[bits[name]].tobytes() == want.tobytes(), name
    assert all(wire.rode == len(cases) for wire in wires)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([np.float32, np.float64]), st.sampled_from([ReduceOp.SUM, ReduceOp.AVERAGE]),
       st.sampled_from([1.0, 0.5, 1 / 3, 3.0, 1e30]), st.data())
def test_a_float_sum_that_rode_has_the_reference_s_bits(dtype, op, post, data):
    """The shortcut for float Sum/Average riders (header._float_sum) gives reference.reduce's
    bits, inf and NaN included."""
    values = st.floats(width=32 if dtype is np.float32 else 64, allow_nan=True,
                       allow_infinity=True)
    n = data.draw(st.integers(1, 8))
    cache, wires = _ranks(2)
    per_rank, inputs = [], []
    for _ in range(2):
        x = np.array(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)
        request = _request("m", x, op, 1.0, post)
        bit = _cached(cache, request)
        per_rank.append({bit: request})
        inputs.append(x)
    got = wires[0].reduced(_areas(wires, per_rank), 1 << bit)[bit]
    want = reference.reduce(inputs, np.dtype(dtype).name, ReduceOp.SUM, 1.0,
                            post / 2 if op == ReduceOp.AVERAGE else post)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_an_allreduce_not_ready_everywhere_gets_no_result():
    cache, wires = _ranks(2)
    requests = [_request("x", np.ones(2, np.float32) * r) for r in range(2)]
    bit = _cached(cache, requests[0])
    areas = _areas(wires, [{bit: requests[0]}, {bit: requests[1]}])
    assert wires[0].reduced(areas, ready=0) == {}


def test_a_rank_that_carried_nothing_means_nothing_rode():
    cache, wires = _ranks(2)
    request = _request("x", np.ones(2, np.float32))
    bit = _cached(cache, request)
    areas = _areas(wires, [{bit: request}, {}])  # rank 1 has not submitted it (or joined)
    assert wires[0].reduced(areas, ready=1 << bit) == {}


def test_what_does_not_fit_one_rank_s_area_is_left_to_the_data_plane_on_every_rank():
    # 64 bytes: count (4), then per rider 4 bytes of bit + 24 of input: two fit, not three.
    cache, wires = _ranks(2, area_bytes=64)
    per_rank = [{}, {}]
    for i in range(3):
        for r in range(2):
            request = _request(f"t{i}", np.full(6, float(r + i), np.float32))
            per_rank[r][_cached(cache, request)] = request
    areas = _areas(wires, per_rank)
    ready = (1 << 3) - 1
    got = [wire.reduced(areas, ready) for wire in wires]
    assert sorted(got[0]) == sorted(got[1]) == [0, 1]  # lowest bits first; bit 2 did not fit
    assert np.array_equal(got[0][1], np.full(6, 3.0, np.float32))


def test_a_hit_given_up_since_no_longer_rides():
    cache, wires = _ranks(2)
    request = _request("x", np.ones(2, np.float32))
    bit = _cached(cache, request)
    wires[0].offer(bit, request)
    assert wires[0]._area({}) == bytes(256)  # no longer among the hits: an empty area
    assert wires[0].riders == {}


def test_a_burst_of_many_small_tensors_is_left_to_fusion():
    cache, wires = _ranks(2)
    hits = {}
    for i in range(40):
        request = _request(f"g{i}", np.ones(1, np.float32))
        hits[_cached(cache, request)] = request
    assert _areas(wires[:1], [hits])[0] == bytes(256)


@pytest.mark.parametrize("size", [1, 3, 8])
def test_only_sets_of_two_ranks_with_an_area_gather(size):
    """From three ranks a floating-point sum's bits depend on the order: riding (rank order)
    and the data plane (MPI's order) could give one tensor different results."""
    assert not RoundWire(_Comm(size), ResponseCache(4), 0, 256).gathers
    assert not RoundWire(_Comm(2), ResponseCache(4), 0, 0).gathers
    assert RoundWire(_Comm(2), ResponseCache(4), 0, 256).gathers
