"""`python -m trainer.bench`, in parts (how it measures: trainer/bench.py's docstring).

- protocol: the JSON-lines conversation between the parent and each worker process;
- probes: what a worker reports about its machine and its memory;
- config: the `train` parameters the gin config binds, built by `train`'s own setup;
- limit, ours, orbit, fit: the worker variants (orbit only where Orbit is installed); worker: a worker
  process's main;
- plan: the variants and the chunk schedule; measure: starting and pacing the workers;
- report: the JSON result, the text table and the markdown; compare: the parent's main.
"""
