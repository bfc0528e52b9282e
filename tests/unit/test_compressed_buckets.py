"""In which order DistributedOptimizer's buckets begin, advance and finish with a stateful
compressor (no MPI: a recording stand-in for the compressor; the cutting into buckets is
mpitrain.engine.buckets.plan's, tested with it)."""

import torch

from mpitrain.compression.stateful import GradientReducer
from mpitrain.torch.compressed_buckets import CompressedBuckets

MIB = 1 << 20


def _floats(nbytes):
    return torch.zeros(nbytes // 4)


class _Recorder:
    def __init__(self):
        self.calls = []

    def begin(self, tensors, key, average=True):
        self.calls.append(("begin", key))
        return key

    def advance(self, started):
        self.calls.append(("advance", started))

    def finish(self, started, last=True):
        self.calls.append(("finish", started, last))

    complete = GradientReducer.complete  # the contract's: advance all, then finish all


def test_buckets_begin_in_order_whatever_order_the_gradients_come_in():
    a, b, c, d = (_floats(MIB) for _ in range(4))
    recorder = _Recorder()
    buckets = CompressedBuckets(recorder, [[d], [c, b, a]], key="opt")
    grads = lambda params: params  # noqa: E731
    buckets.gradient_ready(b, grads)
    buckets.gradient_ready(c, grads)
    buckets.gradient_ready(a, grads)
    assert recorder.calls == []  # bucket 1 is complete, but bucket 0 (d) comes first
    buckets.gradient_ready(d, grads)
    assert recorder.calls == [("begin", "opt.0"), ("begin", "opt.1")]
    buckets.synchronize(grads)
    assert recorder.calls[2:] == [("advance", "opt.0"), ("advance", "opt.1"),
                                  ("finish", "opt.0", False), ("finish", "opt.1", True)]


def test_synchronize_begins_what_backward_left_and_the_next_step_starts_afresh():
    a, b = _floats(2 * MIB), _floats(2 * MIB)
    recorder = _Recorder()
    buckets = CompressedBuckets(recorder, [[b], [a]])
    buckets.gradient_ready(b, lambda params: params)  # a never gets a gradient
    buckets.synchronize(lambda params: params)
    assert [c[0] for c in recorder.calls] == ["begin", "begin", "advance", "advance",
                                              "finish", "finish"]
    recorder.calls.clear()
    buckets.gradient_ready(b, lambda params: params)
    assert recorder.calls == [("begin", "optimizer.0")]
