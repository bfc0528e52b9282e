"""The job's torch.distributed store (mpitrain.torch.c10d.store): it binds only where it is
told (never a wildcard), refuses every connection that cannot prove the job's key (a wrong key,
torch's own TCPStore client, a plain socket), and behaves like torch's TCPStore for the job's
own clients, Gloo and DDP included."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from mpitrain.torch.c10d import store as job_store  # noqa: E402

SHORT = datetime.timedelta(seconds=5)


@pytest.fixture
def served():
    key = job_store.new_key()
    server = job_store.StoreServer(key, ["127.0.0.1"])
    yield server, key
    job_store.close_clients()  # the tests' clients first, as a job's teardown closes them
    server.close()


def _wait_for_refusals(server, count, seconds=10.0):
    deadline = time.monotonic() + seconds
    while server.refused < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.refused


@pytest.mark.parametrize("address", ["0.0.0.0", "::", ""])
def test_a_wildcard_address_is_refused(address):
    with pytest.raises(ValueError, match="given addresses only"):
        job_store.StoreServer(job_store.new_key(), [address])


def test_it_listens_on_the_given_address_only(served):
    server, _ = served
    assert [sock.getsockname()[0] for sock in server.listeners] == ["127.0.0.1"]
    assert server.port > 0


def test_a_client_with_another_key_is_refused(served):
    server, _ = served
    with pytest.raises(job_store.AuthenticationError, match="refused this process"):
        job_store.JobStore("127.0.0.1", server.port, job_store.new_key(), SHORT)
    assert _wait_for_refusals(server, 1) == 1


def test_torchs_own_client_is_refused(served):
    server, _ = served
    with pytest.raises(Exception):  # noqa: B017 - torch raises DistNetworkError or a timeout
        dist.TCPStore("127.0.0.1", server.port, 2, False,
                      timeout=datetime.timedelta(seconds=3))
    assert _wait_for_refusals(server, 1) >= 1


def test_a_plain_socket_learns_nothing_and_is_closed(served):
    server, key = served
    job = job_store.JobStore("127.0.0.1", server.port, key, SHORT)
    job.set("secret", b"gloo address")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        challenge = sock.recv(64)
        assert len(challenge) == 32 and b"gloo address" not in challenge
        sock.sendall(b"\x00" * 32)  # a wrong answer
        sock.settimeout(5)
        assert sock.recv(64) == b""  # closed on us
    assert _wait_for_refusals(server, 1) == 1
    assert job.get("secret") == b"gloo address"  # the job's own connection goes on


def test_a_server_with_another_key_is_not_trusted(served):
    _, key = served
    impostor = job_store.StoreServer(job_store.new_key(), ["127.0.0.1"])
    try:
        with pytest.raises(job_store.AuthenticationError):
            job_store.connect("127.0.0.1", impostor.port, key, 5.0)
    finally:
        impostor.close()


def test_operations_mean_what_they_mean_in_torchs_tcpstore(served):
    server, key = served
    store = job_store.JobStore("127.0.0.1", server.port, key, SHORT)
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert (store.add("n", 2), store.add("n", 3)) == (2, 5)
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.compare_set("c", b"", b"x") == b"x"  # absent and expected empty: set
    assert store.compare_set("c", b"y", b"z") == b"x"  # mismatch: the current value
    assert store.compare_set("c", b"x", b"z") == b"z"
    assert store.compare_set("absent", b"y", b"z") == b"y"  # absent, expected given
    store.append("log", b"ab")
    store.append("log", b"cd")
    store.multi_set(["m1", "m2"], [b"1", b"2"])
    assert store.multi_get(["log", "m1", "m2"]) == [b"abcd", b"1", b"2"]
    assert store.num_keys() == 6 and sorted(store.list_keys()) == ["a", "c", "log", "m1",
                                                                   "m2", "n"]
    assert store.delete_key("a") and not store.delete_key("a")


def test_get_and_wait_block_until_the_key_is_set_or_time_out(served):
    server, key = served
    store = job_store.JobStore("127.0.0.1", server.port, key, SHORT)
    other = store.clone()
    threading.Thread(target=lambda: (time.sleep(0.3), other.set("late", b"ok"))).start()
    assert store.get("late") == b"ok"  # a second connection served the set meanwhile
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"timed out after 0.2 s .* never"):
        store.wait(["never"], datetime.timedelta(seconds=0.2))
    assert time.monotonic() - started < 3


def test_gloo_and_ddp_rendezvous_through_it(served):
    server, key = served
    store = job_store.JobStore("127.0.0.1", server.port, key, SHORT)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.barrier(dist.new_group(backend="gloo"))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        model(torch.ones(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert torch.equal(t, torch.ones(3))
