"""The update path of a step: gradient accumulation, global-norm clipping, XLA, and the recorder they share."""
