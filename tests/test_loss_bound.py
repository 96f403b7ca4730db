"""train.loss_upper_bound: a loop call whose loss is above the bound is rolled back to the newest
checkpoint and its batches are skipped, in one line; a run stopped after the roll-back and resumed
ends bit for bit as one that was not; a bound every call exceeds stops the run after
train.max_rollbacks roll-backs in a row; a step without a `loss` output is refused before anything
is written, as is the bound under parameter_server."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from tests.support import read_jsonl, run_python
from tests.test_multiworker import model_weights
from trainer.errors import UserError
from trainer.extensions import built_in
from trainer.extensions.registry import Registry
from trainer.run.settings import Settings

SPIKE_STEP = 10  # in the call of steps 9-12, rolled back to ckpt-8
SCRIPT = """
import json, os
import keras
from tests.nan_steps import input_energy_step
from tests.spiking_digits import SpikingDigits, unnamed_loss_step
from trainer.errors import RunFailure, UserError
from trainer.run.train import train
from trainer.task import models

out = {out!r}
common = dict(model_fn=models.mlp, input_fn=SpikingDigits(step={spike}), step_fn=input_energy_step,
              global_batch_size=32, steps_per_loop=4, checkpoint_every_steps=8, eval_every_steps=1000,
              log_every_steps=4, loss_upper_bound=20.0)
lines = {{}}

def run(name, model_dir, **changes):
    keras.backend.clear_session()  # layer names as in a fresh process: the run record lets it resume
    lines[name] = []
    try:
        train(model_dir=os.path.join(out, model_dir), print_fn=lines[name].append, **(common | changes))
    except (RunFailure, UserError) as e:
        lines[name].append(f"{{type(e).__name__}}: {{e}}")

run("whole", "whole", total_steps=24)
run("stopped", "resumed", total_steps=16)
run("resumed", "resumed", total_steps=24)
run("unbounded", "unbounded", total_steps=12, loss_upper_bound=None)
run("always", "always", total_steps=24, loss_upper_bound=1e-3, max_rollbacks=2)
run("unnamed", "unnamed", total_steps=4, step_fn=unnamed_loss_step)
print(json.dumps(lines))
"""


def test_the_bound_is_a_number_and_not_for_parameter_server():
    with pytest.raises(UserError, match=r"^train.loss_upper_bound must be a number or None, got '100'$"):
        built_in.participants(Settings(loss_upper_bound="100"))
    settings = Settings(strategy="parameter_server", loss_upper_bound=100.0)
    with pytest.raises(UserError, match=r"^train.loss_upper_bound is not supported with parameter_server"):
        Registry(built_in.participants(settings), settings)


@pytest.mark.timeout(240)
def test_a_spike_is_rolled_back_and_skipped_and_a_resumed_run_ends_identical(tmp_path):
    lines = run_python(SCRIPT.format(out=str(tmp_path), spike=SPIKE_STEP), timeout=220)
    whole = str(tmp_path / "whole")
    said = [line for line in lines["whole"] if "train.loss_upper_bound" in line]
    assert len(said) == 1 and re.fullmatch(
        rf"loss \S+ > train.loss_upper_bound 20 over steps 9-12; rolled back to {whole}/ckpt-8 \(step 8\) and "
        r"skipping the 4 batches of those steps \(roll-back 1 of at most 3 in a row\)",
        said[0],
    ), lines["whole"]
    assert float(said[0].split()[1]) > 20
    logged = read_jsonl(os.path.join(whole, "metrics.jsonl"))
    assert [r["step"] for r in logged if r["split"] == "train"] == [4, 8, 12, 16, 20, 24]  # 9-12 trained again
    assert max(r["loss"] for r in logged if r["split"] == "train") < 20
    # Without the bound the same data spikes (and the weights are thrown off; the loss stays finite).
    unbounded = read_jsonl(os.path.join(tmp_path, "unbounded", "metrics.jsonl"))
    assert [r["loss"] > 20 for r in unbounded if r["split"] == "train"] == [False, False, True]
    # The skipped batches are in the checkpoint: stopped at 16 and resumed, the run skips them again.
    assert any("restored" in line and "ckpt-16" in line for line in lines["resumed"])
    expected, got = model_weights(whole), model_weights(str(tmp_path / "resumed"))
    assert expected.keys() == got.keys() and expected
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # A bound no call meets: two roll-backs to ckpt-0, then the run stops.
    always = lines["always"]
    assert [line.rsplit("(", 1)[1] for line in always if "rolled back" in line] == [
        "roll-back 1 of at most 2 in a row)",
        "roll-back 2 of at most 2 in a row)",
    ]
    assert always[-1].startswith("RunFailure: loss") and (
        "stopped: that would be roll-back 3 in a row (loss" in always[-1]
    ), always[-1]
    assert always[-1].endswith(f"more than train.max_rollbacks 2; the last good checkpoint is {tmp_path}/always/ckpt-0")
    assert lines["unnamed"] == [
        "UserError: train.loss_upper_bound bounds the train step's output 'loss', and train.step_fn returns "
        "['accuracy', 'xent']; return the loss as 'loss' or unset train.loss_upper_bound"
    ]
    assert not os.path.exists(tmp_path / "unnamed")
