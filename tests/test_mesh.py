"""The hand-built mesh has the same groups as torch.distributed.device_mesh, for many shapes.

One spawned group per world size checks every shape (dp, pp, tp) in it.
"""
import pytest

from harness import run_group

DIMS = ("dp", "pp", "tp")
SHAPES = {4: [(2, 1, 2), (1, 2, 2), (4, 1, 1)],
          8: [(2, 2, 2), (1, 2, 4), (2, 1, 4), (8, 1, 1)]}


def compare_with_device_mesh(shapes) -> list[dict]:
    """A job: for each shape, our groups and coordinates next to DeviceMesh's, and a sum over each group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from common.mesh import Mesh
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for shape in shapes:
        mesh = Mesh(rank, world, **dict(zip(DIMS, shape)))
        dm = init_device_mesh("cpu", shape, mesh_dim_names=DIMS)
        row = {"shape": shape, "coords": [mesh.coord(d) for d in DIMS], "dm_coords": list(dm.get_coordinate())}
        for d in DIMS:
            row[d] = mesh.group_ranks[d]
            row[f"dm_{d}"] = dist.get_process_group_ranks(dm.get_group(d))
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=mesh.group(d))             # the group is a working process group
            row[f"sum_{d}"] = t.item()
        out.append(row)
    return out


@pytest.fixture(scope="module", params=[4, 8])
def world_rows(request):
    world = request.param
    (res,) = run_group(world, [("test_mesh:compare_with_device_mesh", SHAPES[world])])
    for kind, value in res:
        assert kind == "ok", value
    return world, [value for _, value in res]             # rows[rank][shape index]


def test_groups_equal_device_mesh_groups(world_rows):
    world, rows = world_rows
    for rank in range(world):
        for row in rows[rank]:
            for d in DIMS:
                assert row[d] == row[f"dm_{d}"], (rank, row["shape"], d)
                assert rank in row[d] and row[f"sum_{d}"] == sum(row[d])
            assert row["coords"] == row["dm_coords"], (rank, row["shape"])


def test_tp_groups_are_consecutive_ranks(world_rows):
    world, rows = world_rows
    for rank in range(world):
        for row in rows[rank]:
            tp = row["tp"]
            assert tp == list(range(tp[0], tp[0] + len(tp))) and tp[0] % len(tp) == 0


def test_coordinates_read_off_the_grid(world_rows):
    """rank = (dp·PP + pp)·TP + tp: the grid is torch.arange(world).view(dp, pp, tp)."""
    world, rows = world_rows
    for rank in range(world):
        for row in rows[rank]:
            _, P, T = row["shape"]
            d, p, t = row["coords"]
            assert (d * P + p) * T + t == rank


def test_mesh_rejects_degrees_that_do_not_multiply_to_the_world():
    from common.errors import ConfigError
    from common.mesh import Mesh
    with pytest.raises(ConfigError, match=r"--nproc_per_node=6"):
        Mesh(0, 4, dp=3, pp=1, tp=2)
    with pytest.raises(ConfigError, match="≥ 1"):
        Mesh(0, 4, dp=4, pp=0, tp=1)


def test_describe_prints_every_rank():
    from common.mesh import Mesh
    text = Mesh(0, 1, dp=1, pp=1, tp=1).describe()
    assert "rank  0" in text
