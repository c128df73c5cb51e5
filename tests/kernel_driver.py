"""Drive a real IPython kernel the way JupyterLab does: execute cells, collect outputs, interrupt, kill."""
from __future__ import annotations

import os
import queue
import re
import time
from dataclasses import dataclass, field

from jupyter_client.manager import start_new_kernel

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class CellResult:
    stdout: str = ""
    stderr: str = ""
    error: dict | None = None  # {"ename", "evalue", "traceback"}
    displays: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def error_text(self) -> str:
        if not self.error:
            return ""
        return ANSI.sub("", "\n".join(self.error["traceback"]) + f"\n{self.error['ename']}: {self.error['evalue']}")

    @property
    def shown(self) -> str:
        """What a notebook shows under the cell: its streams, then the error exactly as the front end renders it
        (the traceback lines, which for a one-line error are just 'Name: message')."""
        traceback = ANSI.sub("", "\n".join(self.error["traceback"])) if self.error else ""
        return self.stdout + self.stderr + traceback


class KernelDriver:
    def __init__(self, kernel_name: str = "python3", env: dict[str, str] | None = None):
        """env: variables to set in the kernel's environment, on top of this process's."""
        kernel_env = {**os.environ, **env} if env else None
        extra = {"env": kernel_env} if kernel_env else {}
        self.manager, self.client = start_new_kernel(kernel_name=kernel_name, startup_timeout=60, **extra)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def execute(self, code: str, timeout: float = 120, interrupt_after: float | None = None) -> CellResult:
        started = time.monotonic()
        msg_id = self.client.execute(code)
        result = CellResult()
        interrupted = False
        while True:
            if interrupt_after is not None and not interrupted and time.monotonic() - started > interrupt_after:
                self.manager.interrupt_kernel()
                interrupted = True
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"cell did not finish in {timeout} s: {code[:60]!r}") from None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                setattr(result, content["name"], getattr(result, content["name"]) + content["text"])
            elif kind == "error":
                result.error = content
            elif kind in ("display_data", "execute_result"):
                result.displays.append(content["data"])
            elif kind == "status" and content["execution_state"] == "idle":
                break
        result.seconds = time.monotonic() - started
        result.stdout, result.stderr = ANSI.sub("", result.stdout), ANSI.sub("", result.stderr)
        return result

    def run_all(self, cells: list[str], interrupt_after: float, timeout: float = 60) -> list[str]:
        """Queue every cell at once, as "Run All" does, interrupt after a while; each cell's reply status
        ('ok', 'error' or 'aborted': a cell the kernel skipped because an earlier one failed)."""
        while True:  # replies to earlier cells (execute() reads only the output channel)
            try:
                self.client.get_shell_msg(timeout=0.2)
            except queue.Empty:
                break
        ids = [self.client.execute(cell) for cell in cells]
        time.sleep(interrupt_after)
        self.manager.interrupt_kernel()
        status: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while len(status) < len(ids) and time.monotonic() < deadline:
            try:
                reply = self.client.get_shell_msg(timeout=0.5)
            except queue.Empty:
                continue
            status[reply["parent_header"].get("msg_id")] = reply["content"]["status"]
        return [status.get(msg_id, "no reply") for msg_id in ids]

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)
