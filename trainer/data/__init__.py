"""Input: the built-in input functions and the pipelines that batch, shard and distribute any of them."""
from trainer.data.pipeline import *  # noqa: F401,F403
