"""Host lists: -H strings and hostfiles parse, validate with line numbers, and convert."""

import pytest

from mpitrain.runner.hosts import (
    FORMATS,
    HostfileError,
    HostSlots,
    format_hosts,
    parse_hostfile_text,
    parse_hosts_string,
    parse_slot_lines,
    place,
    read_hostfile,
)


def hs(*pairs):
    return [HostSlots(h, n) for h, n in pairs]


@pytest.mark.parametrize(("text", "expected"), [
    ("node1:4,node2:4", hs(("node1", 4), ("node2", 4))),
    ("node1,node2", hs(("node1", 1), ("node2", 1))),  # horovodrun: a bare host is 1 slot
    (" a:2 , b.example.com:1 ", hs(("a", 2), ("b.example.com", 1))),
    ("10.0.0.1:8", hs(("10.0.0.1", 8))),
    ("gpu_node-3:2", hs(("gpu_node-3", 2))),
])
def test_hosts_string(text, expected):
    assert parse_hosts_string(text) == expected


@pytest.mark.parametrize(("text", "names"), [
    ("a:2,,b:2", "token 2 is empty"),
    ("a:2,b:", "'b:'"),
    ("a:x", "'x' is not an integer"),
    ("a:0", "0 slots"),
    ("a:-1", "-1 slots"),
    (":4", "'' is not a valid host name"),
    ("a:2:3", "'a:2:3'"),
    ("a b:2", "'a b' is not a valid host name"),
    ("a:2,a:2", "already token 1"),
    ("", "empty host list"),
    ("a:2,", "token 2 is empty"),
])
def test_malformed_hosts_string_names_the_token(text, names):
    with pytest.raises(HostfileError, match=None) as info:
        parse_hosts_string(text)
    assert names in str(info.value)
    assert isinstance(info.value, ValueError)


REAL_WORLD_OPENMPI = """\
# Open MPI hostfile, as in the Open MPI FAQ
node01.cluster slots=8   # first node
node02.cluster slots=8 max_slots=16

node03.cluster max_slots=4
"""


def test_openmpi_hostfile():
    assert parse_hostfile_text(REAL_WORLD_OPENMPI) == hs(
        ("node01.cluster", 8), ("node02.cluster", 8), ("node03.cluster", 4))


def test_mpich_machinefile_and_plain_forms():
    assert parse_hostfile_text("host1:2\nhost2:4\n") == hs(("host1", 2), ("host2", 4))
    # PBS-style: one line per slot, repeats count.
    assert parse_hostfile_text("n1\nn1\nn2\nn1\n") == hs(("n1", 3), ("n2", 1))


@pytest.mark.parametrize(("text", "message"), [
    ("a slots=2\nb slots=1\na slots=2\n", "hosts:3: host 'a' is already listed on line 1"),
    ("a\nb:2\nb\n", "hosts:3: host 'b' is already listed on line 2"),
    ("a\na:2\n", "hosts:2: host 'a' is already listed on line 1"),
    ("a slots=0\n", "hosts:1: host 'a' has 0 slots"),
    ("a slots=\n", "hosts:1: host 'a' has an empty slot count"),
    ("a:\n", "hosts:1: host 'a' has an empty slot count"),
    ("\n\na slots=two\n", "hosts:3: host 'a': slot count 'two' is not an integer"),
    ("a cpus=4\n", "hosts:1: unknown key 'cpus'"),
    ("a 4\n", "hosts:1: unexpected '4'"),
    ("a slots=4 max_slots=2\n", "max_slots=2 < slots=4"),
    ("a:2 extra\n", "unexpected 'extra'"),
    ("bad/name slots=1\n", "hosts:1: 'bad/name' is not a valid host name"),
    ("# nothing\n\n", "no hosts"),
])
def test_hostfile_errors_have_line_numbers(text, message):
    with pytest.raises(HostfileError) as info:
        parse_hostfile_text(text, source="hosts")
    assert message in str(info.value)


def test_read_hostfile_missing(tmp_path):
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "nope"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_round_trips(fmt):
    hosts = hs(("node1", 4), ("node2", 1), ("10.1.2.3", 2))
    text = format_hosts(hosts, fmt)
    back = parse_hosts_string(text.strip()) if fmt == "horovod" else parse_hostfile_text(text)
    assert back == hosts


def test_formats_look_like_their_tools_expect():
    hosts = hs(("a", 2), ("b", 1))
    assert format_hosts(hosts, "openmpi") == "a slots=2\nb slots=1\n"
    assert format_hosts(hosts, "mpich") == "a:2\nb:1\n"
    assert format_hosts(hosts, "horovod") == "a:2,b:1\n"
    assert format_hosts(hosts, "plain") == "a\na\nb\n"
    with pytest.raises(ValueError, match="'slurm'"):
        format_hosts(hosts, "slurm")


def test_slot_lines_count_repeats():
    assert parse_slot_lines(["n2", "n1", "n2", ""], "PBS_NODEFILE") == hs(("n2", 2), ("n1", 1))
    with pytest.raises(HostfileError, match="PBS_NODEFILE:1: expected one host name"):
        parse_slot_lines(["n1 n2"], "PBS_NODEFILE")


def test_place_fills_hosts_in_order():
    hosts = hs(("a", 4), ("b", 4), ("c", 2))
    assert place(4, hosts) == hs(("a", 4))
    assert place(6, hosts) == hs(("a", 4), ("b", 2))
    assert place(10, hosts) == hs(("a", 4), ("b", 4), ("c", 2))
    with pytest.raises(ValueError, match=r"-np 11 asks for more processes than the 10 slots "
                                         r"of the hosts \(a:4, b:4, c:2\)"):
        place(11, hosts)
    with pytest.raises(ValueError, match="-np must be >= 1"):
        place(0, hosts)


def test_hostslots_rejects_bad_values():
    with pytest.raises(HostfileError, match="slots must be an integer >= 1"):
        HostSlots("a", 0)
    with pytest.raises(HostfileError, match="not a valid host name"):
        HostSlots("", 1)
