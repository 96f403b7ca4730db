"""Mixed precision and custom steps: the README's step (which scales its loss with
`optimizer.scale_loss`) trains as well in mixed_float16 and mixed_bfloat16 as in float32, and a step
that never scales its loss is refused under mixed_float16 before step 1, in one line."""

from __future__ import annotations

import json
import re
import textwrap
import time

import pytest

from tests.support import REPO, refused_in_one_process, run_python

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long


def readme_step_module() -> str:
    """The README's `my_steps.py` code block, as written there."""
    with open(f"{REPO}/README.md") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (block,) = [b for b in blocks if b.startswith("# my_steps.py")]
    return block


@pytest.fixture(scope="module")
def unscaled_refusals(tmp_path_factory) -> dict[str, str]:
    """Both modes in one interpreter, mirrored first: it splits the CPU, which single leaves alone."""
    args = [
        "--gin_bindings=import tests.precision_steps",
        "--gin_bindings=train.step_fn=@unscaled_step",
        "--gin_bindings=train.mixed_precision='mixed_float16'",
    ]
    cases = {mode: [f"--gin_file=gin/{mode}.gin", *args] for mode in ("mirrored", "single")}
    return refused_in_one_process(tmp_path_factory.mktemp("unscaled"), cases, timeout=180)


@pytest.mark.timeout(200)
@pytest.mark.xdist_group("unscaled_refusals")
@pytest.mark.parametrize("mode", ["single", "mirrored"])
def test_a_step_that_never_scales_its_loss_is_refused_under_mixed_float16(unscaled_refusals, mode):
    line = unscaled_refusals[mode]
    assert line.startswith(
        "error: train.mixed_precision = 'mixed_float16': the step applies gradients of a loss "
        "it never passed through optimizer.scale_loss"
    ), line
    assert "scaled = optimizer.scale_loss(loss)" in line and "tape.gradient(scaled, variables)" in line


@pytest.mark.timeout(300)
def test_the_readme_step_trains_as_well_in_float16_and_bfloat16_as_in_float32(tmp_path):
    (tmp_path / "my_steps.py").write_text(readme_step_module())
    started = time.monotonic()
    result = run_python(
        textwrap.dedent(f"""
        import json, sys, tempfile, time
        sys.path.insert(0, {str(tmp_path)!r})
        import my_steps
        from trainer.run import train as train_lib
        from trainer.task import models

        def model_fn(input_shape, num_classes):
            return models.mlp(input_shape, num_classes, hidden=(64,))

        found = {{}}
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            started = time.monotonic()
            with tempfile.TemporaryDirectory() as model_dir:
                final = train_lib.train(model_dir=model_dir, model_fn=model_fn, step_fn=my_steps.my_step,
                                        mixed_precision=policy, total_steps=300, steps_per_loop=50,
                                        log_every_steps=300, checkpoint_every_steps=300, eval_every_steps=300,
                                        print_fn=lambda line: None)
            found[policy] = {{"accuracy": final["accuracy"], "seconds": time.monotonic() - started}}
        print(json.dumps(found))
    """),
        timeout=280,
    )
    print(json.dumps(result), f"{time.monotonic() - started:.1f} s in all")
    float32 = result["float32"]["accuracy"]
    assert float32 > 0.9, result
    for policy in ("mixed_float16", "mixed_bfloat16"):
        assert abs(result[policy]["accuracy"] - float32) <= 0.02, result
