"""What a run writes to model_dir: checkpoints, metrics.jsonl and event files, the run record."""
