"""The hand-built mesh has the same groups as torch.distributed.device_mesh, for many shapes.

One spawned group per world size checks every shape (dp, pp, tp) in it, and every 4D shape
(edp, ep, pp, tp) with dp = (edp, ep) joined (chapter 05's 4D run).
"""
import pytest

from harness import run_group

DIMS = ("dp", "pp", "tp")
SHAPES = {4: [(2, 1, 2), (1, 2, 2), (4, 1, 1)],
          8: [(2, 2, 2), (1, 2, 4), (2, 1, 4), (8, 1, 1)]}
DIMS_4D = ("edp", "ep", "pp", "tp")
SHAPES_4D = {4: [(1, 2, 1, 2), (2, 2, 1, 1)], 8: [(1, 2, 2, 2), (1, 4, 2, 1), (2, 2, 2, 1)]}


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


def compare_joined_with_device_mesh(shapes) -> list[dict]:
    """A job: the 4D mesh's groups (dp joined from edp and ep) next to DeviceMesh's. DeviceMesh expresses
    the four dimensions directly; the joined dp group is the dp group of the 3D DeviceMesh (dp, pp, tp)
    with dp = edp·ep (its public API; `_flatten` would be the private way)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from common.mesh import Mesh
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for edp, ep, pp, tp in shapes:
        mesh = Mesh(rank, world, edp=edp, ep=ep, pp=pp, tp=tp, joined={"dp": ("edp", "ep")})
        dm = init_device_mesh("cpu", (edp, ep, pp, tp), mesh_dim_names=DIMS_4D)
        dm3 = init_device_mesh("cpu", (edp * ep, pp, tp), mesh_dim_names=DIMS)
        row = {"shape": (edp, ep, pp, tp), "coords": [mesh.coord(d) for d in DIMS_4D + ("dp",)],
               "dm_coords": list(dm.get_coordinate()) + [dm3.get_coordinate()[0]]}
        for d in DIMS_4D:
            row[d], row[f"dm_{d}"] = mesh.group_ranks[d], dist.get_process_group_ranks(dm.get_group(d))
        row["dp"], row["dm_dp"] = mesh.group_ranks["dp"], dist.get_process_group_ranks(dm3.get_group("dp"))
        out.append(row)
    return out


@pytest.fixture(scope="module", params=[4, 8])
def world_results(request):
    world = request.param
    results = run_group(world, [("test_mesh:compare_with_device_mesh", SHAPES[world]),
                                ("test_mesh:compare_joined_with_device_mesh", SHAPES_4D[world])])
    for res in results:
        for kind, value in res:
            assert kind == "ok", value
    return world, [[value for _, value in res] for res in results]     # [job][rank][shape index]


@pytest.fixture(scope="module")
def world_rows(world_results):
    world, (rows, _) = world_results
    return world, rows


def test_joined_dp_and_ep_groups_equal_device_mesh_groups(world_results):
    world, (_, rows) = world_results
    for rank in range(world):
        for row in rows[rank]:
            for d in DIMS_4D + ("dp",):
                assert row[d] == row[f"dm_{d}"], (rank, row["shape"], d)
            assert row["coords"] == row["dm_coords"], (rank, row["shape"])
            edp, ep, pp, tp = row["shape"]
            # the 4D grid numbers the ranks as the 3D one: dp = edp·ep + ep, same dp groups
            assert row["coords"][4] == row["coords"][0] * ep + row["coords"][1]


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
