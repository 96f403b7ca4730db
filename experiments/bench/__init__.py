"""`python -m experiments.bench`, in parts (how it measures: experiments/bench/__main__.py's docstring). It runs
from the repository root of a clone (`pip install -e .`), not from the installed package.

- __main__: the flags, and which mode runs;
- protocol: the JSON-lines conversation between the parent and each worker process, and stopping a
  worker while it waits for its turn;
- probes: what a worker reports about its machine, its memory and the rest of the machine's CPU;
- config: the `train` parameters the gin config binds, built by `train`'s own setup;
- limit, ours, orbit, fit: the worker variants (limit also as limit_input, ours also as ours_async,
  ours_tf_data and, on request, ours_epoch_order: epoch_order.py,
  orbit only where Orbit is installed); worker: a worker process's main;
- plan: the variants, what each does besides its steps, and the rounds; measure: starting and
  pacing the workers;
- intervals: per-round ratios, their bootstrap interval and the verdict against a peer;
- report: the JSON result, the text table and the markdown; compare: the parent's main;
- readme: experiments/bench/README.md from the JSON results.
"""
