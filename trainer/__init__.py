"""trainer: one gin-bound step function, from one CPU to a cluster, checked against Keras fit.

From Python: `trainer.train(**settings)`, `trainer.evaluate(run)`, `trainer.predict(run)`,
`trainer.configure_devices(...)` (docs/python.md). They load on first use (trainer/api.py), so that
`import trainer` starts no TensorFlow: `python -m trainer.main` must isolate its network before it does.
"""

from trainer.errors import UserError
from trainer.task.combine import combine  # `@trainer.combine(max_logit="max")` on a step

# Names of trainer/api.py, imported (with TensorFlow, quietly) when first used.
_API = ("train", "evaluate", "predict", "configure_devices", "TrainResult", "Predictions", "DeviceConfig")
__all__ = ["UserError", "combine", *_API]


def __getattr__(name: str):
    if name in _API:
        from trainer import api

        return getattr(api, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
