"""What `%dist_status` shows: one row per rank, then what each rank holds; tables in the notebook (HTML) and in a
terminal (text)."""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Sequence

from nbdist.units import format_bytes


@dataclass
class Status:
    """One row per rank, then what each rank holds (the engine registry); shows as tables in the notebook (HTML)
    and in a terminal (text).

    The backend column is torch's own string, what `dist.get_backend()` returns in a cell: "mpi4py" on CPU engines
    (nbdist's torch.distributed over MPI; "gloo" when asked for), "cpu:gloo,cuda:nccl" on GPU engines (CUDA tensors
    through NCCL, CPU tensors through gloo). A friendlier name would be one more thing to translate. GPU memory is what
    NVML says the process holds (context, NCCL buffers, torch's cache); where NVML cannot see the process, torch's cache
    only, and the cell says so.
    """

    rows: list[dict]
    startup_seconds: float | None = None
    holdings: list[dict] = field(default_factory=list)  # rank, kind, name, bytes, what
    left_open: list[str] = field(default_factory=list)  # the kernel's side: what it leaves open, in words

    HEADER = ("rank", "host", "pid", "device", "backend", "memory")
    HOLDINGS_HEADER = ("rank", "holds", "name", "tensors", "what")

    @staticmethod
    def _cells(row: dict) -> list[str]:
        memory = f"{row['rss_mib']:.0f} MiB"
        if "gpu_mib" in row:
            whose = "" if row.get("gpu_memory") == "nvml" else ", torch's cache only"
            memory += f" (+{row['gpu_mib']:.0f} MiB GPU{whose})"
        return [str(row["rank"]), row["host"], str(row["pid"]), row["device"], row["backend"], memory]

    @staticmethod
    def _holding_cells(row: dict) -> list[str]:
        return [str(row["rank"]), row["kind"], row["name"], format_bytes(row["bytes"]), row["what"]]

    def _footer(self) -> list[str]:
        if self.startup_seconds is None:
            return []
        return [f"{len(self.rows)} engines ready (torch.distributed initialised) in {self.startup_seconds:.2f} s"]

    def _open_note(self) -> list[str]:
        """What a protection the OS refused leaves open (one line each, once for all ranks: they share Hydra's
        port), and what the kernel's side leaves open (a lifeline token that crosses the network in clear): nbdist
        starts without it rather than not at all, and says so here."""
        ranks = {line for row in self.rows for line in row.get("left_open", ())}
        return [f"open: {line}" for line in sorted(ranks | set(self.left_open))]

    def _holdings_note(self) -> list[str]:
        return [] if self.holdings else ["the ranks hold no nbdist objects (pipelines, meshes, groups)"]

    def __str__(self) -> str:
        lines = _text_table(self.HEADER, [self._cells(r) for r in self.rows]) + self._footer() + self._open_note()
        if self.holdings:
            lines += [""] + _text_table(self.HOLDINGS_HEADER, [self._holding_cells(r) for r in self.holdings])
        return "\n".join(lines + self._holdings_note())

    def _repr_html_(self) -> str:
        out = _html_table(self.HEADER, [self._cells(r) for r in self.rows])
        out += "".join(f"<p>{html.escape(line)}</p>" for line in self._footer() + self._open_note())
        if self.holdings:
            out += _html_table(self.HOLDINGS_HEADER, [self._holding_cells(r) for r in self.holdings])
        return out + "".join(f"<p>{html.escape(line)}</p>" for line in self._holdings_note())

    def __repr__(self) -> str:
        return str(self)


def _text_table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    table = [list(header)] + rows
    widths = [max(len(cell) for cell in column) for column in zip(*table)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]


def _html_table(header: Sequence[str], rows: list[list[str]]) -> str:
    def tr(cells: Sequence[str], tag: str) -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

    return "<table>" + tr(header, "th") + "".join(tr(r, "td") for r in rows) + "</table>"
