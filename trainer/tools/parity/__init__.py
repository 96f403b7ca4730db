"""`python -m trainer.parity` in pieces: the two sides (`runs`: ours and the files workers leave;
`fit`: Keras fit on the same batches), the comparisons (`compare`), what each worker process
does (`workers`) and how outcomes are reported (`outcome`). Everything is built through
trainer's own setup (trainer/run/setup.py), so parity checks what a run trains, not a copy of it."""
