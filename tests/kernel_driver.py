"""Drive a real IPython kernel the way JupyterLab does: execute cells, collect outputs, interrupt, kill."""
from __future__ import annotations

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


class KernelDriver:
    def __init__(self, kernel_name: str = "python3"):
        self.manager, self.client = start_new_kernel(kernel_name=kernel_name, startup_timeout=60)

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

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)
