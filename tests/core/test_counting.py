"""`mmspec.counting`: every kind of host read is counted, ops split by phase, accelerator branches forced."""

import pytest
import torch

from mmspec.counting import HostReads, OpCount, host_checks_enabled


x = torch.arange(6.0)
READS = {
    "item": lambda: x[0].item(),
    "int": lambda: int(x[1]),
    "bool": lambda: bool(x[1] > 0),
    "if": lambda: 1 if x[2] else 0,
    "any": lambda: bool((x > 2).any()),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "cpu": lambda: x.cpu(),
    "mask index": lambda: x[x > 2],
    "nonzero": lambda: (x > 2).nonzero(),
    "where one argument": lambda: torch.where(x > 2),
    "unique": lambda: torch.unique(x),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "masked_select": lambda: x.masked_select(x > 2),
}
FREE = {
    "arithmetic": lambda: (x * 2 + 1).sum(),
    "masked_fill": lambda: x.masked_fill(x > 2, 0),
    "integer index": lambda: x[torch.tensor([0, 2])],
    "where three arguments": lambda: torch.where(x > 2, x, 0),
    "nonzero_static": lambda: (x > 2).nonzero_static(size=3),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3),
}


@pytest.mark.parametrize("name", list(READS))
def test_each_kind_of_read_counts_once(name):
    with HostReads() as reads:
        READS[name]()
    assert reads.count == 1, reads.where


@pytest.mark.parametrize("name", list(FREE))
def test_device_side_work_is_not_a_read(name):
    with HostReads() as reads:
        FREE[name]()
    assert reads.count == 0, reads.where


def test_accelerator_branches_are_forced_inside_and_restored_after():
    assert host_checks_enabled("cpu") and host_checks_enabled(torch.device("cpu"))
    assert not host_checks_enabled("meta")
    with HostReads():
        assert not host_checks_enabled("cpu")
    assert host_checks_enabled("cpu")
    assert getattr(torch.Tensor.tolist, "__module__", None) != "mmspec.counting"
    x.tolist()  # the patch is gone: counting nothing, raising nothing


def test_ops_split_by_phase():
    with OpCount() as ops:
        x + 1
        with ops.phase("target"):
            x * 2
            with ops.phase("drafter"):
                x.sum()
    assert dict(ops.by_phase) == {"engine": 1, "target": 1, "drafter": 1} and ops.total == 3
