"""trainer: one gin-bound step function, from one CPU to a cluster, checked against Keras fit."""

from trainer.task.combine import combine  # noqa: E402,F401  (`@trainer.combine(max_logit="max")` on a step)
