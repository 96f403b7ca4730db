"""`python -m trainer.parity` in parts: `sides` (ours and fit, built as a run builds), `outcome`, `config`."""
