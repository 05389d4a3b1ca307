"""The method registry: knob types and ranges, drafter resolution."""

import numpy as np
import pytest
import torch

from mmspec.methods import ACCEPTANCES, KNOBS, check_knob, resolve_drafter
from mmspec.verify import RULE_CLASSES


def test_knob_types():
    assert check_knob("jacobi_window", np.int64(4)) == 4 and type(check_knob("jacobi_window", np.int64(4))) is int
    assert check_knob("relaxation_delta", np.float32(0.5)) == 0.5
    for bad in (torch.tensor(4.5), torch.tensor(True), torch.tensor([4]), 4.5, "4", True):
        with pytest.raises(TypeError, match="jacobi_window"):
            check_knob("jacobi_window", bad)
    with pytest.raises(ValueError, match="relaxation_delta"):
        check_knob("relaxation_delta", float("nan"))
    with pytest.raises(ValueError, match="resample"):
        check_knob("resample", "foo")


def test_rule_defaults_come_from_the_rule_classes():
    assert KNOBS["relaxation_delta"].default == RULE_CLASSES["relaxed"]().delta
    grouped = RULE_CLASSES["grouped"]()
    assert (KNOBS["group_size"].default, KNOBS["group_prob_threshold"].default, KNOBS["group_dist_threshold"].default) == (
        grouped.group_size, grouped.prob_threshold, grouped.dist_threshold)  # fmt: skip


def test_resolve_drafter():
    assert resolve_drafter("none", None, set()) is None
    assert resolve_drafter("exact", None, {"draft_model"}) == "model"
    assert resolve_drafter("exact", None, set()) == "jacobi"
    assert resolve_drafter("grouped", None, {"eagle_head"}) == "jacobi"
    with pytest.raises(ValueError, match="eagle_head"):
        resolve_drafter("exact", "eagle", set())
    with pytest.raises(ValueError, match="drafter"):
        resolve_drafter("jacobi", "model", {"draft_model"})
    assert set(ACCEPTANCES) == {"none", "exact", "relaxed", "grouped", "jacobi"}
