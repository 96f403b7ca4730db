"""A stand-in task for the launcher tests: starts in milliseconds, does what its flags say.

It prints its TF_CONFIG, records its pid (so a test can check nothing outlives
the launcher), then sleeps and/or fails. In ps mode the launcher gives server
tasks no flags, so the pid dir also comes from $FAKE_WORKER_PID_DIR, and
server tasks (ps, and workers of a cluster with ps) sleep until stopped (exit 0 on
SIGTERM) or killed, like trainer.server.
"""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid_dir", default=os.environ.get("FAKE_WORKER_PID_DIR"))
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds before exiting")
    parser.add_argument("--fail_task", default="", help="task that fails, like worker:1")
    parser.add_argument("--exit_code", type=int, default=1, help="exit code of the failing task")
    parser.add_argument("--fail_once", action="store_true", help="fail on the first attempt only")
    parser.add_argument("--ignore_sigterm", action="store_true", help="only SIGKILL ends it")
    parser.add_argument("--grandchild", action="store_true", help="start a sleeping child process of its own")
    parser.add_argument("--wait_for_cluster", action="store_true", help="wait until every task wrote its pid")
    args, _ = parser.parse_known_args(argv)
    return args


def should_fail(args: argparse.Namespace, task: str) -> bool:
    if args.fail_task != task:
        return False
    if not args.fail_once:
        return True
    marker = os.path.join(args.pid_dir, f"failed-{task.replace(':', '-')}")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def wait_for_cluster(pid_dir: str, cluster: dict, timeout_secs: float = 30) -> None:
    """Like a coordinator connecting to its servers: returns once every task has started."""
    deadline = time.monotonic() + timeout_secs
    tasks = sum(map(len, cluster.values()))
    while len(glob.glob(os.path.join(pid_dir, "pid-*"))) < tasks and time.monotonic() < deadline:
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config = json.loads(os.environ["TF_CONFIG"])
    task_type, index = config["task"]["type"], config["task"]["index"]
    task = f"{task_type}:{index}"
    port = config["cluster"][task_type][index].rsplit(":", 1)[1]
    print(f"task={task} port={port} tf_config={json.dumps(config)}", flush=True)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(os.path.join(args.pid_dir, f"grandchild-{child.pid}"), "w").close()
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"pid-{os.getpid()}"), "w") as pid_file:
            pid_file.write(task)
    if "ps" in config["cluster"] and task_type in ("ps", "worker"):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a stopped server exits 0, as trainer.server does
        time.sleep(3600)
    if args.wait_for_cluster:
        wait_for_cluster(args.pid_dir, config["cluster"])
    if should_fail(args, task):
        print(f"{task} failing with exit code {args.exit_code}", flush=True)
        return args.exit_code
    time.sleep(args.sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
