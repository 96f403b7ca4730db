"""Safety checks: the loss-scaling guard, non-finite outputs, the user's functions tried before anything is written."""
