"""A stand-in for trainer.server in tests of the embedded cluster (trainer/distribution/local_cluster.py):
starts in milliseconds, says it listens, then serves until stopped. A task named in $FAKE_SERVER_FAILS
exits 4 before listening; one named in $FAKE_SERVER_DIES exits 3 a second after listening (once the
cluster has seen it start), on its first start only (it leaves a mark in $FAKE_SERVER_DIR)."""

import json
import os
import sys
import time

task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
if name in os.environ.get("FAKE_SERVER_FAILS", "").split(","):
    print("no such flag --bogus", flush=True)
    time.sleep(0.5)  # the cluster reads the line before it sees the exit
    sys.exit(4)
print(f"server {name} (pid {os.getpid()}) listening at nowhere", flush=True)
mark = os.path.join(os.environ.get("FAKE_SERVER_DIR", "."), f"died-{task['type']}-{task['index']}")
if name in os.environ.get("FAKE_SERVER_DIES", "").split(",") and not os.path.exists(mark):
    open(mark, "w").close()
    time.sleep(1)
    sys.exit(3)
time.sleep(120)
