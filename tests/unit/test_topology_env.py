import pytest

from mpitrain.core import topology


def test_first_launcher_variable_wins():
    env = {"SLURM_LOCALID": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    assert topology.env_local_rank(env) == ("OMPI_COMM_WORLD_LOCAL_RANK", 2)


@pytest.mark.parametrize("name", topology.LOCAL_RANK_VARIABLES)
def test_each_launcher_is_known(name):
    assert topology.env_local_rank({name: "3"}) == (name, 3)


def test_no_launcher():
    assert topology.env_local_rank({}) is None


def test_garbage_value_warns_and_falls_through():
    with pytest.warns(RuntimeWarning, match="MPI_LOCALRANKID='x'"):
        found = topology.env_local_rank({"MPI_LOCALRANKID": "x", "SLURM_LOCALID": "1"})
    assert found == ("SLURM_LOCALID", 1)


def test_topology_helpers():
    topo = topology.Topology(rank=0, size=3, local_rank=0, local_size=2, cross_rank=0,
                             cross_size=2, node_index=0, node_sizes=(2, 1),
                             layout=((0, 0), (0, 1), (1, 0)), machine_local_size=3,
                             emulated=True, hostname="h")
    assert topo.num_nodes == 2 and not topo.is_homogeneous
    assert topo.node_ranks(0) == [0, 1] and topo.node_ranks(1) == [2]
