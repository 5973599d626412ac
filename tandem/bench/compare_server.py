"""One ``tandem serve`` subprocess of ``bench compare``: started in its own session, awaited on ``/health``."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tandem.bench.compare_config import CompareError


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """One ``tandem serve`` subprocess in its own session; output goes to ``log_path``."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, name: str) -> None:
        self.cmd, self.port, self.log_path, self.name = cmd, port, log_path, name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, startup_timeout_s: float) -> None:
        if not port_free(self.port):
            raise CompareError(f"port {self.port} is in use; pick another with --port-base")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise CompareError(
                    f"server for config {self.name!r} exited with code {rc} before becoming healthy.\n"
                    f"command: {shlex.join(self.cmd)}\nlast lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise CompareError(
                    f"server for config {self.name!r} not healthy after {startup_timeout_s:.0f} s "
                    f"(raise --server-timeout?).\nlast lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)  # its own session: the server and its children
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
