"""How DistributedOptimizer cuts gradients into buckets for a stateful compressor, and in
which order the buckets begin (no MPI: a recording stand-in for the compressor)."""

import torch

from mpitrain.torch.compressed_buckets import CompressedBuckets, cut_buckets

MIB = 1 << 20


def _floats(nbytes):
    return torch.zeros(nbytes // 4)


def test_the_first_bucket_closes_at_1_mib_the_others_at_25():
    small, mib, big = _floats(4096), _floats(MIB), _floats(20 * MIB)
    params = [small, mib, small, big, big, small]
    buckets = cut_buckets(params)
    assert [[id(p) for p in b] for b in buckets] == [
        [id(small), id(mib)], [id(small), id(big), id(big)], [id(small)]]
    assert cut_buckets([]) == []


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


def test_buckets_begin_in_order_whatever_order_the_gradients_come_in():
    # Registration order a..d; backward's order (the buckets') is d, c, b, a.
    a, b, c, d = (_floats(MIB) for _ in range(4))
    recorder = _Recorder()
    buckets = CompressedBuckets(recorder, [a, b, c, d], key="opt")
    assert [len(x) for x in buckets.buckets] == [1, 3]  # [d], then c, b, a under 25 MiB
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
    buckets = CompressedBuckets(recorder, [a, b])
    buckets.gradient_ready(b, lambda params: params)  # bucket 0 = [b]; a never gets one
    buckets.synchronize(lambda params: params)
    assert [c[0] for c in recorder.calls] == ["begin", "begin", "advance", "advance",
                                              "finish", "finish"]
    recorder.calls.clear()
    buckets.gradient_ready(b, lambda params: params)
    assert recorder.calls == [("begin", "optimizer.0")]
