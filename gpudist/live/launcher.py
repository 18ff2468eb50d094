"""The launcher: ``python -m gpudist.live`` hosts the membership service and starts the workers."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from .membership import STORE_ENV, MembershipService


def launch(command: list[str], nproc: int, *, replacements: int = 0, host: str = "127.0.0.1", port: int = 0) -> int:
    """Host the membership service, start ``nproc`` workers running ``command``, and start a replacement for each
    worker that dies (up to ``replacements`` times); return when every worker has exited.

    Returns:
        0 when the last workers all exited with 0, else the first non-zero exit code seen among them.
    """
    service = MembershipService(host, port)
    env = {**os.environ, STORE_ENV: service.address, "PYTHONUNBUFFERED": "1"}
    workers = [subprocess.Popen(command, env=env) for _ in range(nproc)]
    code = 0
    try:
        while workers:
            time.sleep(0.1)
            for w in list(workers):
                rc = w.poll()
                if rc is None:
                    continue
                workers.remove(w)
                if rc != 0 and replacements > 0:
                    replacements -= 1
                    print(f"gpudist.live: worker {w.pid} exited with {rc}; starting a replacement", file=sys.stderr)
                    workers.append(subprocess.Popen(command, env=env))
                elif rc != 0 and code == 0:
                    code = rc
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpudist.live",
        description="Run a live elastic job: host the membership service and start the workers.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="workers to start")
    parser.add_argument("--replacements", type=int, default=0, help="workers to start in place of ones that die")
    parser.add_argument("--host", default="127.0.0.1", help="address the membership service listens on")
    parser.add_argument("--port", type=int, default=0, help="its port (0: any free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker's command line (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker's command after --")
    return launch(command, args.nproc, replacements=args.replacements, host=args.host, port=args.port)
