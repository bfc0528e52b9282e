"""The rendezvous's pieces without MPI: the wire and its authentication, heartbeats, node
ranks, which daemon commands an agent accepts, and the options."""

from __future__ import annotations

import argparse
import socket
import struct
import threading
import time

import pytest

from mpitrain.runner import rdzv_command, rdzv_options
from mpitrain.runner.rdzv_link import Link
from mpitrain.runner.rdzv_nodes import Node, assign, describe, why_not_join
from mpitrain.runner.rdzv_wire import (
    Channel,
    Refused,
    WireError,
    client_handshake,
    secret_from,
    server_handshake,
)


def _handshake(client_secret: bytes, server_secret: bytes, client_id: str = "job",
               server_id: str = "job") -> tuple[object, object]:
    """Run both ends over a socket pair; return what each end got (a result or an error)."""
    a, b = socket.socketpair()
    results: dict[str, object] = {}

    def serve() -> None:
        try:
            results["server"] = server_handshake(b, server_id, server_secret)
        except (Refused, WireError) as exc:
            results["server"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        results["client"] = client_handshake(a, client_id, client_secret, {"host": "n1"},
                                             "n0:1")
    except (Refused, WireError) as exc:
        results["client"] = exc
        a.close()
    thread.join(10)
    return results["client"], results["server"]


@pytest.mark.parametrize("secret", [b"", b"s3cret"])
def test_handshake_then_messages_both_ways(secret):
    client, server = _handshake(secret, secret)
    assert isinstance(client, Channel)
    channel, hello = server
    assert hello["host"] == "n1" and hello["rdzv_id"] == "job"
    client.send({"t": "ping", "n": 1})
    assert channel.recv() == {"t": "ping", "n": 1}
    channel.send({"t": "pong"})
    assert client.recv() == {"t": "pong"}


def test_another_rendezvous_id_is_turned_away_naming_both():
    client, server = _handshake(b"", b"", client_id="second", server_id="first")
    assert isinstance(client, Refused) and isinstance(server, Refused)
    assert "serves rendezvous id 'first', not 'second'" in str(client)


@pytest.mark.parametrize(("client_secret", "server_secret"),
                         [(b"a", b"b"), (b"a", b""), (b"", b"b")])
def test_different_secrets_never_authenticate(client_secret, server_secret):
    client, server = _handshake(client_secret, server_secret)
    # The agent checks the server first: a server without the agent's secret cannot make
    # it do anything, and the agent says so.
    assert isinstance(client, Refused), client
    assert "could not prove that it knows this node's MPITRAIN_RDZV_SECRET" in str(client)
    assert f"set here: {'yes' if client_secret else 'no'}" in str(client)
    assert isinstance(server, (Refused, WireError))


def _raw_frame(message: dict, key: bytes = b"k") -> bytes:
    """What a client channel puts on the wire for ``message``."""
    a, b = socket.socketpair()
    Channel(a, key, is_client=True).send(message)
    b.settimeout(5)
    return b.recv(65536)


def _server_reading(raw: bytes, key: bytes = b"k") -> Channel:
    a, b = socket.socketpair()
    a.sendall(raw)
    a.shutdown(socket.SHUT_WR)
    return Channel(b, key, is_client=False)


def test_a_forged_replayed_or_foreign_frame_is_refused():
    raw = _raw_frame({"t": "run", "cmd": "prted"})
    assert _server_reading(raw).recv() == {"t": "run", "cmd": "prted"}
    forged = raw.replace(b"prted", b"rm -rf")
    forged = struct.pack(">I", len(forged) - 4) + forged[4:]
    with pytest.raises(WireError, match="authentication check"):
        _server_reading(forged).recv()
    replayed = _server_reading(raw + raw)
    replayed.recv()
    with pytest.raises(WireError, match="authentication check"):
        replayed.recv()  # the second copy carries the first one's sequence number
    with pytest.raises(WireError, match="authentication check"):
        _server_reading(raw, key=b"other").recv()


def test_garbage_and_huge_frames_are_not_the_protocol():
    with pytest.raises(WireError, match="frame of"):
        _server_reading(struct.pack(">I", 1 << 31)).recv()
    a, b = socket.socketpair()
    a.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(WireError):
        server_handshake(b, "job", b"")


def test_secret_comes_from_the_environment():
    assert secret_from({"MPITRAIN_RDZV_SECRET": "x"}) == b"x"
    assert secret_from({}) == b""


def test_a_silent_peer_is_given_up_after_the_timeout():
    a, b = socket.socketpair()  # b never says a word
    ended: list[str] = []
    done = threading.Event()
    start = time.monotonic()
    link = Link(Channel(a, b"k", is_client=True), lambda m: None,
                lambda why: (ended.append(why), done.set()), timeout_s=1.5).start()
    assert done.wait(10)
    took = time.monotonic() - start
    assert 1.5 <= took < 4, took
    assert ended == [link.reason] and "no heartbeat for" in ended[0]
    b.close()


def test_heartbeats_keep_a_quiet_link_alive():
    a, b = socket.socketpair()
    ends: list[str] = []
    left = Link(Channel(a, b"k", is_client=True), lambda m: None, ends.append, 1.5).start()
    right = Link(Channel(b, b"k", is_client=False), lambda m: None, ends.append, 1.5).start()
    time.sleep(3.5)  # longer than the timeout, with nothing but heartbeats
    assert ends == []
    left.close()
    assert right.wait_ended(5) and "closed by the other end" in (right.reason or "")


# -- nodes ---------------------------------------------------------------------------------
def test_node_ranks_serving_node_first_then_by_name_whatever_the_arrival():
    nodes = [Node("c", "10.0.0.3", 2), Node("a", "10.0.0.1", 2), Node("z", "10.0.0.9", 2,
                                                                         serving=True),
             Node("b", "10.0.0.2", 2)]
    assert [n.host for n in assign(nodes)] == ["z", "a", "b", "c"]
    assert [n.host for n in assign(list(reversed(nodes)))] == ["z", "a", "b", "c"]


def test_wanted_node_ranks_are_kept_and_the_rest_fill_in():
    nodes = [Node("a", "1", 1), Node("b", "2", 1, wanted_rank=0), Node("c", "3", 1,
                                                                        wanted_rank=3),
             Node("d", "4", 1)]
    assert [n.host for n in assign(nodes)] == ["b", "a", "d", "c"]


def test_who_may_not_join_is_named():
    there = [Node("a", "10.0.0.1", 2, wanted_rank=0)]
    assert "already has" in why_not_join(there, Node("b", "10.0.0.2", 2, wanted_rank=0), 3)
    assert "same address" in why_not_join(there, Node("a2", "10.0.0.1", 2), 3)
    assert "outside 0..2" in why_not_join(there, Node("b", "10.0.0.2", 2, wanted_rank=3), 3)
    assert "have joined already" in why_not_join(there, Node("b", "10.0.0.2", 2), 1)
    assert why_not_join(there, Node("b", "10.0.0.2", 2), 3) is None
    assert "IPv6" in why_not_join(there, Node("b", "fe80::2", 2), 3)
    assert describe(there[0]) == "node a (10.0.0.1)"
    assert describe(there[0], 0) == "node 0 (a, 10.0.0.1)"


def test_a_malformed_hello_is_a_value_error():
    with pytest.raises(ValueError, match="without 'nproc'"):
        Node.from_hello({"host": "a", "addr": "1"})
    with pytest.raises(ValueError, match="malformed"):
        Node.from_hello({"host": "a", "addr": "1", "nproc": "2"})


# -- daemon commands ------------------------------------------------------------------------
# As Open MPI 5.0.11 and MPICH 5.0.2 hand them to their ssh (seen on the namespace cluster).
PRRTE = ('PRTE_PREFIX=/v;export PRTE_PREFIX;PMIX_PREFIX=/v;export PMIX_PREFIX;'
         'LD_LIBRARY_PATH=/v/lib:/v/lib:$LD_LIBRARY_PATH;export LD_LIBRARY_PATH;'
         'DYLD_LIBRARY_PATH=/v/lib:/v/lib:$DYLD_LIBRARY_PATH;export DYLD_LIBRARY_PATH;'
         '/v/bin/prted --allow-run-as-root --prtemca ess "env" --prtemca ess_base_nspace '
         '"prterun-n1-6185@0" --prtemca ess_base_vpid 1 --prtemca prte_hnp_uri '
         '"prterun-n1-6185@0.0;tcp://10.0.0.1:51453:24" --prtemca plm_ssh_agent "/tmp/x/ssh" '
         '--tree-spawn --prtemca prte_parent_uri "prterun-n1-6185@0.0;tcp://10.0.0.1:51453:24"')
HYDRA = ('"/v/bin/hydra_pmi_proxy" --control-port 10.0.0.1:37369 --rmk user --launcher ssh '
         '--launcher-exec /tmp/x/ssh --demux poll --pgid 0 --retries 10 --usize -1 '
         '--pmi-port 0 --gpus-per-proc -2 --proxy-id 1')


@pytest.mark.parametrize("command", [PRRTE, HYDRA])
def test_the_launchers_daemon_commands_are_accepted(command):
    assert rdzv_command.problem(command) is None


@pytest.mark.parametrize(("command", "why"), [
    ("rm -rf /", "not an MPI launcher's daemon"),
    ("/v/bin/prted; rm -rf /", "neither a variable setting"),
    ("/v/bin/prted --x $(curl evil | sh)", "command substitution"),
    ("/v/bin/prted --x `id`", "command substitution"),
    ("/v/bin/prted --x \"$HOME\"", "expands a variable"),
    ("/v/bin/prted | sh", "shell operator '|'"),
    ("/v/bin/prted > /etc/passwd", "shell operator '>'"),
    ("/v/bin/prted && sh", "shell operator '&&'"),
    ("FOO=1;export FOO;/v/bin/prted", "sets 'FOO'"),
    ("PATH=/x:$HOME;export PATH;/v/bin/prted", "expands something other than $PATH"),
    ("curl x;/v/bin/prted", "neither a variable setting"),
    ("/v/bin/prted\nsh", "line break"),
    ("/v/bin/prted 'unclosed", "does not parse"),
    ("", "empty"),
])
def test_anything_else_is_refused_saying_why(command, why):
    assert why in (rdzv_command.problem(command) or "accepted")


# -- options ---------------------------------------------------------------------------------
def _args(**given) -> argparse.Namespace:
    base = dict(rdzv_endpoint=None, nnodes=None, nproc_per_node=None, rdzv_id=None,
                node_rank=None, rdzv_timeout=None, local_addr=None, rdzv_backend=None,
                rdzv_conf=None, np=None, hosts=None, hostfile=None, npernode=None,
                host_discovery_script=None, elastic_restart=False, launcher="auto")
    base.update(given)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(("text", "expected"), [
    ("node1:29500", ("node1", 29500)), ("node1", ("node1", 29400)),
    ("10.0.0.1:1", ("10.0.0.1", 1)), ("[fe80::1]:29401", ("fe80::1", 29401)),
])
def test_endpoints(text, expected):
    assert rdzv_options.parse_endpoint(text) == expected


@pytest.mark.parametrize(("text", "why"), [
    (":29400", "names no host"), ("n:0", "not 1..65535"), ("n:x", "not 1..65535"),
    ("n:70000", "not 1..65535"), ("fe80::1:29400", "[ADDR]:PORT"), ("[fe80::1]x", "[ADDR]"),
])
def test_bad_endpoints_are_named(text, why):
    with pytest.raises(ValueError, match=text.replace("[", r"\[").replace("]", r"\]")) as info:
        rdzv_options.parse_endpoint(text)
    assert why in str(info.value)


def test_full_options_and_torchruns_conf():
    opts = rdzv_options.rendezvous_options(_args(
        rdzv_endpoint="n0:29500", nnodes=4, nproc_per_node=8, rdzv_id="77", node_rank=2,
        rdzv_conf="join_timeout=30,heartbeat_timeout=7,is_host=false", local_addr="10.1.1.1"))
    assert opts == rdzv_options.RendezvousOptions(4, 8, "n0", 29500, "77", 2, 30.0, 7.0, False,
                                                  "10.1.1.1")
    assert rdzv_options.rendezvous_options(_args()) is None
    defaults = rdzv_options.rendezvous_options(_args(rdzv_endpoint="n0", nnodes=2,
                                                     nproc_per_node=1))
    assert (defaults.rdzv_id, defaults.timeout_s, defaults.port) == ("none", 600.0, 29400)


@pytest.mark.parametrize(("given", "message"), [
    (dict(nnodes=2), "--nnodes without --rdzv-endpoint"),
    (dict(rdzv_endpoint="n0", nproc_per_node=2), "needs --nnodes N and --nproc-per-node K"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, np=4), "-np does not go with"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, hosts="a,b"), "-H does not go"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, elastic_restart=True),
     "--elastic-restart does not go"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, launcher="srun"), "srun"),
    (dict(rdzv_endpoint="localhost:29400", nnodes=2, nproc_per_node=2), "loopback"),
    (dict(rdzv_endpoint="127.0.0.1", nnodes=2, nproc_per_node=2), "loopback"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, node_rank=2),
     "--node-rank 2 is not below --nnodes 2"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, rdzv_conf="read_timeout=5"),
     "'read_timeout=5'"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, rdzv_conf="is_host=maybe"),
     "is_host=maybe"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, rdzv_conf="join_timeout=-1"),
     "join_timeout=-1"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, rdzv_timeout=5.0,
          rdzv_conf="join_timeout=6"), "disagree"),
    (dict(rdzv_endpoint="n0", nnodes=2, nproc_per_node=2, rdzv_id=" "), "is empty"),
])
def test_contradictions_are_named(given, message):
    with pytest.raises(ValueError) as info:
        rdzv_options.rendezvous_options(_args(**given))
    assert message in str(info.value)


def test_a_loopback_endpoint_is_fine_for_one_node():
    assert rdzv_options.rendezvous_options(
        _args(rdzv_endpoint="localhost", nnodes=1, nproc_per_node=2)).nnodes == 1
