"""For tests/test_time_budget.py: a time budget that runs out on the chief only, as clocks of workers
started at different moments do, so the workers stop together only if they agree."""

from __future__ import annotations

import json
import os

import gin


@gin.configurable
def chief_budget(seconds: float = 0.001) -> float:
    """`seconds` on the chief (worker 0 of TF_CONFIG), a budget no test reaches on every other worker."""
    return seconds if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0 else 1e9
