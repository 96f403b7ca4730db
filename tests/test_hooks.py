"""Extensions act exactly on their boundaries, whatever steps_per_loop is; users add their own by gin."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.support import REPO, read_jsonl, run_main, subprocess_env

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long


def test_boundaries_need_not_divide_steps_per_loop_and_user_extensions_plug_in(tmp_path):
    (tmp_path / "my_hooks.py").write_text(
        textwrap.dedent("""
        import json
        import gin
        from trainer.extensions.protocol import Extension

        @gin.configurable
        class StepRecorder(Extension):
            def __init__(self, path, every_steps=6):
                self.path, self.every_steps, self.seen = path, every_steps, []

            def after_loop(self, context, step, metrics):
                self.seen.append((step, sorted(metrics)))

            def end(self, context, step):
                with open(self.path, "w") as f:
                    json.dump({"seen": self.seen, "end": step, "chief": context.runtime.is_chief}, f)
    """)
    )
    record = tmp_path / "seen.json"
    (tmp_path / "hooks.gin").write_text(
        textwrap.dedent(f"""
        import my_hooks
        include '{REPO}/gin/single.gin'
        train.extensions = [@StepRecorder()]
        StepRecorder.path = '{record}'
        train.total_steps = 30
        train.steps_per_loop = 7
        train.log_every_steps = 4
        train.eval_every_steps = 15
        train.checkpoint_every_steps = 10
    """)
    )
    model_dir = str(tmp_path / "run")
    env = subprocess_env(PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    proc = run_main(f"--gin_file={tmp_path / 'hooks.gin'}", f"--model_dir={model_dir}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    seen = json.loads(record.read_text())
    loop_ends = [step for step, _ in seen["seen"]]
    assert seen["end"] == 30 and seen["chief"] is True
    assert all(keys == ["accuracy", "loss"] for _, keys in seen["seen"])
    # Every boundary of every extension (4s, 6s, 10s, 15s) and no call longer than steps_per_loop.
    for boundary in [*range(4, 31, 4), *range(6, 31, 6), 10, 20, 15, 30]:
        assert boundary in loop_ends, boundary
    assert all(b - a <= 7 for a, b in zip([0, *loop_ends], loop_ends))

    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    assert [r["step"] for r in records if r["split"] == "train"] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert [r["step"] for r in records if r["split"] == "eval"] == [15, 30]
    checkpoints = sorted(n for n in os.listdir(model_dir) if n.endswith(".index"))
    assert checkpoints == ["ckpt-10.index", "ckpt-20.index", "ckpt-30.index"]
