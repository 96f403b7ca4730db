"""The facade: `train()` as a short composition over one validated `Settings` object."""
