"""trainer: one gin-bound step function, from one CPU to a cluster, checked against Keras fit."""
