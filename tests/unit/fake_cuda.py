"""A fake CUDA device for testing stream/event ordering logic on the CPU.

Work enqueued on a stream runs only when the device is stepped, stream heads are taken in an
adversarial order (the framework's stream last, so a read before the producer's write shows,
or with ``framework_first`` first, so a use before the channels' results shows),
and a wait blocks its stream until the event's record has run.  ``ignore_waits=True`` makes
the device disregard waits, for the negative controls that prove a test can fail.
"""

from __future__ import annotations

import threading
from collections import deque


class FakeEvent:
    def __init__(self):
        self.done = False


class FakeStream:
    def __init__(self, name, priority):
        self.name = name
        self.priority = priority
        self.queue = deque()


class FakeDevice:
    def __init__(self, ignore_waits=False, framework_first=False):
        self.lock = threading.RLock()
        self.streams = []
        self.ignore_waits = ignore_waits
        self.log = []  # (stream name, label) in execution order
        self.framework = self._stream("framework", priority=1000 if framework_first else -1)

    def _stream(self, name, priority):
        with self.lock:
            s = FakeStream(name, priority)
            self.streams.append(s)
            return s

    # ------------------------------------------------------- StreamBackend
    def new_stream(self):
        return self._stream(f"channel{len(self.streams) - 1}", priority=len(self.streams))

    def record(self, stream):
        event = FakeEvent()
        with self.lock:
            stream.queue.append(("record", event, None))
        return event

    def wait(self, stream, event):
        with self.lock:
            stream.queue.append(("wait", event, None))

    def synchronize(self, stream):
        while True:
            with self.lock:
                if not stream.queue:
                    return
                if not self._step():
                    raise AssertionError(f"deadlock: {stream.name} waits on an event never "
                                         "recorded")

    def host_wait(self, event):
        while True:
            with self.lock:
                if event.done:
                    return
                if not self._step():
                    raise AssertionError("deadlock: waiting for an event never recorded")

    # ------------------------------------------------------------- device work
    def launch(self, stream, label, fn):
        with self.lock:
            stream.queue.append(("run", fn, label))

    def drain(self):
        with self.lock:
            while any(s.queue for s in self.streams):
                if not self._step():
                    raise AssertionError("deadlock among the fake streams")

    def _runnable(self, stream):
        if not stream.queue:
            return False
        kind, obj, _ = stream.queue[0]
        return kind != "wait" or obj.done or self.ignore_waits

    def _step(self):
        ready = [s for s in self.streams if self._runnable(s)]
        if not ready:
            return False
        stream = max(ready, key=lambda s: s.priority)
        kind, obj, label = stream.queue.popleft()
        if kind == "record":
            obj.done = True
        elif kind == "run":
            obj()
            self.log.append((stream.name, label))
        return True
