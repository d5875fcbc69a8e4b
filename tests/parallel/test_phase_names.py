"""A collective error names the innermost phase and the path of phases around it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from klppo.parallel.dist import CollectiveTimeoutError, current_phase, phase


def test_error_names_the_phase_path():
    with pytest.raises(CollectiveTimeoutError, match=r"phase 'gather_samples' \(step > gather_samples\)"):
        with phase("step"):
            with phase("gen"):
                pass
            with phase("gather_samples"):
                raise dist.DistError("connection closed by peer")
    assert current_phase() == "startup"


def test_other_errors_pass_through_and_the_path_unwinds():
    with pytest.raises(ValueError, match="not a collective"):
        with phase("step"), phase("update_actor"):
            raise ValueError("not a collective")
    with pytest.raises(CollectiveTimeoutError, match=r"\(reduce_metrics\)"):
        with phase("reduce_metrics"):
            raise dist.DistError("timed out")
