"""Waiting for a probewire command in a test: on a timeout, the failure shows where it hung."""

from __future__ import annotations

import signal
import subprocess
import time

__all__ = ["finish"]


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """``proc.communicate``; on a timeout the command prints every thread's stack (the CLI
    registers ``faulthandler`` on SIGUSR1), is killed, and that stderr is the failure."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(
            f"still running after {timeout_s:.0f}s; stderr:\n{(err or '')[-6000:]}"
        ) from None
