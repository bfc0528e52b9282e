"""Channels on CUDA streams: slicing, and event ordering on a fake adversarial device."""

import threading

import numpy as np
import pytest
from fake_cuda import FakeDevice

from mpitrain.ops.cuda.streams import Channels, Slicing, split


class FakeComm:
    """Records the slices a channel's communicator carried; 'allreduce' over 2 equal ranks."""

    def __init__(self, index):
        self.index = index
        self.calls = []
        self.freed = False

    def Allreduce_in_place(self, host):
        self.calls.append(host.size)
        host *= 2

    def Free(self):
        self.freed = True


@pytest.mark.parametrize(("count", "channels", "align", "min_chunk"),
                         [(100, 4, 1, 1), (101, 3, 4, 1), (7, 4, 4, 1), (1000, 4, 16, 300),
                          (5, 8, 1, 1), (1, 4, 1, 1000)])
def test_split_tiles_the_bucket_in_order_with_aligned_starts(count, channels, align, min_chunk):
    slices = split(count, channels, align, min_chunk)
    assert 1 <= len(slices) <= channels
    assert slices[0][0] == 0 and slices[-1][1] == count
    for (a, b), (c, _) in zip(slices, slices[1:]):
        assert b == c and a < b
    assert all(start % align == 0 for start, _ in slices)
    lengths = [b - a for a, b in slices[:-1]]
    assert not lengths or max(lengths) - min(lengths) <= align
    if count >= min_chunk:
        assert all(b - a >= min_chunk or len(slices) == 1 for a, b in slices)


def test_split_is_deterministic_and_rejects_bad_arguments():
    assert split(1000, 4, 16, 100) == split(1000, 4, 16, 100)
    assert split(0, 4) == []
    assert split(10, 4, 1, 100) == [(0, 10)]  # shorter than min_chunk: one channel
    for kwargs in ({"channels": 0}, {"align": 0}, {"min_chunk": 0}):
        args = {"count": 10, "channels": 2, "align": 1, "min_chunk": 1, **kwargs}
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            split(**args)
    with pytest.raises(ValueError, match="-1"):
        split(-1, 2)


def _train_step(device, channels_count):
    """backward writes grad (lazily, on the framework stream) -> channels allreduce -> step
    reads grad on the framework stream.  Returns what step() saw and the comms."""
    grad = np.zeros(1000, dtype=np.float32)
    fresh = np.arange(1000, dtype=np.float32)
    comms = [FakeComm(i) for i in range(channels_count)]
    channels = Channels(device, comms)
    device.launch(device.framework, "backward", lambda: grad.__setitem__(slice(None), fresh))
    ready = device.record(device.framework)  # what the adapter records at submit time
    seen = {}

    def work(ch, start, stop):
        host = np.empty(stop - start, dtype=np.float32)
        device.launch(ch.stream, f"d2h {start}", lambda: host.__setitem__(
            slice(None), grad[start:stop]))
        device.synchronize(ch.stream)  # MPI needs the bytes now
        ch.comm.Allreduce_in_place(host)
        device.launch(ch.stream, f"h2d {start}", lambda: grad.__setitem__(
            slice(start, stop), host))

    channels.run(device.framework, ready, grad.size, work, Slicing(align=8, min_chunk=100))
    device.launch(device.framework, "step", lambda: seen.setdefault("grad", grad.copy()))
    device.drain()
    channels.close()
    return seen["grad"], fresh * 2, comms


@pytest.mark.parametrize("framework_first", [False, True])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_no_gradient_is_read_before_backward_wrote_it_nor_used_before_reduced(n, framework_first):
    got, want, comms = _train_step(FakeDevice(framework_first=framework_first), n)
    np.testing.assert_array_equal(got, want)
    assert [len(c.calls) for c in comms] == [1] * n  # one slice per channel
    assert sum(sum(c.calls) for c in comms) == 1000
    assert all(c.freed for c in comms)


@pytest.mark.parametrize("framework_first", [False, True])
def test_negative_control_without_event_waits_the_result_is_wrong(framework_first):
    # On a device that ignores waits, the channels read stale gradients (framework last) or
    # step() uses unreduced ones (framework first): the test above would catch either.
    got, want, _ = _train_step(FakeDevice(ignore_waits=True, framework_first=framework_first), 2)
    assert not np.array_equal(got, want)


def test_a_failing_slice_raises_after_every_slice_finished():
    device = FakeDevice()
    channels = Channels(device, [FakeComm(i) for i in range(3)])
    finished = []
    lock = threading.Lock()

    def work(ch, start, stop):
        if ch.index == 1:
            raise RuntimeError("peer died on channel 1")
        with lock:
            finished.append(ch.index)

    with pytest.raises(RuntimeError, match="channel 1"):
        channels.run(device.framework, None, 3000, work)
    assert sorted(finished) == [0, 2]
    channels.close()


def test_channels_need_a_communicator():
    with pytest.raises(ValueError, match="at least one"):
        Channels(FakeDevice(), [])
