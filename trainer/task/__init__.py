"""What is trained: models, optimizers, the step functions, built under the strategy's scope."""
