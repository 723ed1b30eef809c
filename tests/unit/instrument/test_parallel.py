"""Coordinates from a named mesh and parameter ownership from placements (the rules; the
real process groups are in tests/integration/test_parallel_layouts.py)."""

from __future__ import annotations

import pytest
import torch

from probewire.instrument.parallel import (
    LayoutError,
    coords_from_mesh,
    expert_shards,
    param_layout,
)
from probewire.instrument.wire import RankIdentity


class Mesh:
    def __init__(self, names, sizes, ranks) -> None:
        self.mesh_dim_names, self._sizes, self._ranks = names, sizes, ranks

    def get_local_rank(self, i):
        return self._ranks[i]

    def size(self, i=None):
        return self._sizes[i]


class Place:
    def __init__(self, kind) -> None:
        self.kind = kind

    def is_replicate(self):
        return self.kind == "R"

    def is_partial(self):
        return self.kind == "P"


class Param(torch.Tensor):
    """A tensor that looks like a DTensor to ``param_layout`` (mesh and placements)."""

    @staticmethod
    def make(mesh, placements):
        p = torch.zeros(2).as_subclass(Param)
        p.device_mesh, p.placements = mesh, [Place(k) for k in placements]
        return p


def test_data_dims_flatten_into_one_data_coordinate():
    mesh = Mesh(("dp_replicate", "dp_shard", "tp"), (2, 4, 2), (1, 3, 1))
    assert coords_from_mesh(mesh) == {"dp": 1 * 4 + 3, "tp": 1}


@pytest.mark.parametrize("names,match", [((), "no dim names"), (("data", "tp"), "'data'")])
def test_a_mesh_without_known_dim_names_is_refused_in_one_line(names, match):
    with pytest.raises(LayoutError, match=match):
        coords_from_mesh(Mesh(names, (2, 2), (0, 0)))


@pytest.mark.parametrize(
    "placements,ranks,owned,sharded",
    [
        ("RS", (0, 1), True, True),  # HSDP: replicate over dp_replicate, shard over dp_shard
        ("RS", (1, 0), False, True),  # the replica at coordinate 1 owns nothing
        ("SS", (1, 1), True, True),  # FSDP x TP shards: every rank its shard
        ("RR", (0, 0), True, False),
    ],
)
def test_a_dtensor_is_owned_by_its_shards_and_by_coordinate_0_of_its_replicas(
    placements, ranks, owned, sharded
):
    mesh = Mesh(("dp_replicate", "dp_shard"), (2, 2), ranks)
    identity = RankIdentity(run_id="r", rank=0, world_size=4)
    got = param_layout("w", Param.make(mesh, placements), identity, {"dp", "cp"}, dp_explicit=False)
    assert got == (owned, sharded)


def test_a_partial_placement_and_a_contradicting_declaration_are_refused():
    identity = RankIdentity(run_id="r", rank=0, world_size=2)
    mesh = Mesh(("dp",), (2,), (0,))
    with pytest.raises(LayoutError, match="'w' is Partial"):
        param_layout("w", Param.make(mesh, "P"), identity, set(), dp_explicit=False)
    with pytest.raises(LayoutError, match="'w' is sharded over mesh dim 'dp'"):
        param_layout("w", Param.make(mesh, "S"), identity, {"dp"}, dp_explicit=True)


def test_a_plain_tensor_follows_the_hand_declaration():
    identity = RankIdentity(run_id="r", rank=3, world_size=4, coords={"dp": 1, "tp": 1})
    plain = torch.zeros(2)
    assert param_layout("w", plain, identity, {"cp"}, dp_explicit=False) == (True, False)
    assert param_layout("w", plain, identity, {"dp"}, dp_explicit=False) == (False, False)
    assert param_layout("w", plain, identity, {"tp"}, dp_explicit=False) == (False, False)


@pytest.mark.parametrize(
    "owned,n,want",
    [
        ([2, 3], 4, (0, 0, 1, 1)),  # contiguous, the second of two shards
        ([4, 5, 6, 7], 8, (0, 0, 0, 0, 1, 1, 1, 1)),
        ([1, 3], 4, (0, 1, 0, 1)),  # strided: rank 1 of 2 holds 1, 3
        ([2, 6], 8, (0, 1, 2, 3, 0, 1, 2, 3)),  # strided over 4 shards
        ([5], 8, tuple(range(8))),  # one expert per shard: both placements agree
        ([0, 1, 2, 3], 4, None),  # every expert: no expert parallelism
        ([0, 3], 4, None),  # neither placement
        ([1, 2], 4, None),  # a block that does not start at a shard boundary
        ([0, 1, 2], 4, None),  # uneven shards
    ],
)
def test_expert_shards_from_the_experts_a_rank_holds(owned, n, want):
    """Each expert's shard from the global ids the rank holds: contiguous or strided."""
    assert expert_shards(owned, n) == want
