#!/bin/bash
# One task of ps.sbatch's srun step: task 0 coordinates (trainer.main with gin/ps.gin), every
# other task is a ps or worker server (trainer.server); both resolve the cluster from SLURM
# with the same RESOLVER_OPTIONS. The servers run until they are told to stop, so the chief's
# task ends the step once training is done: SIGTERM to every task (the servers exit 0).
set -uo pipefail
if [ "$SLURM_PROCID" -ne 0 ]; then
  exec "$PYTHON" -m trainer.server --cluster_resolver=slurm --cluster_resolver_options="$RESOLVER_OPTIONS"
fi
"$PYTHON" -m trainer.main --gin_file=gin/ps.gin \
  --gin_bindings="train.cluster_resolver='slurm'" \
  --gin_bindings="train.cluster_resolver_options=$RESOLVER_OPTIONS" \
  --model_dir="$MODEL_DIR" "$@"
code=$?
trap '' TERM   # the step's SIGTERM is for the servers
scancel --signal=TERM "$SLURM_JOB_ID.$SLURM_STEP_ID"
exit "$code"
