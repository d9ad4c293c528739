"""The GPU's clocks while a benchmark section runs: every bandwidth or speed figure carries them.

    with ClockLog("hmad 32 streams") as clk:
        ...                       # the timed work
    record["clocks"] = clk.summary  # {"sm_mhz": {min, median, max}, "mem_mhz": {...}, "samples": n, ...}

Two sources, the first one found is used:
- NVIDIA: ``nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_event_reasons.active -lms 100`` in the
  background for the section's duration (nothing of the driver is changed: clocks are read, never set);
- AMD (amdgpu, e.g. the Radeon 780M): ``/sys/class/drm/card*/device/pp_dpm_sclk`` and ``pp_dpm_mclk``, the
  level marked ``*``, polled every 100 ms.
Where neither exists the summary says so (``{"source": None}``); a figure without clocks is then reported
as such, never with guessed ones.
"""

from __future__ import annotations

import functools
import glob
import re
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

PERIOD_S = 0.1
#: the event-reasons field's name changed across drivers; the first one nvidia-smi accepts is used
QUERIES = (
    "clocks.sm,clocks.mem,clocks_event_reasons.active",
    "clocks.sm,clocks.mem,clocks_throttle_reasons.active",
    "clocks.sm,clocks.mem",
)


@functools.cache
def nvidia_query() -> str:
    for q in QUERIES:
        r = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
            capture_output=True,
            timeout=30,
        )
        if r.returncode == 0:
            return q
    return QUERIES[-1]


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def max_clocks() -> dict:
    """The GPU's maximum SM and memory clocks (NVIDIA), to state how far below them a section ran."""
    if not shutil.which("nvidia-smi"):
        return {}
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,clocks.max.sm,clocks.max.mem", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.splitlines()
    if not out:
        return {}
    name, sm, mem = (x.strip() for x in out[0].split(","))
    return {"gpu": name, "max_sm_mhz": float(sm), "max_mem_mhz": float(mem)}


def _amd_level(path: str) -> float | None:
    """The active level of an amdgpu pp_dpm_* file (``1: 2700Mhz *``), in MHz."""
    for line in Path(path).read_text().splitlines():
        if line.rstrip().endswith("*"):
            m = re.search(r"(\d+)\s*[Mm]hz", line)
            return float(m.group(1)) if m else None
    return None


class ClockLog:
    """Samples the GPU's clocks from ``__enter__`` to ``__exit__``; ``summary`` afterwards."""

    def __init__(self, section: str = ""):
        self.section = section
        self.sm: list[float] = []
        self.mem: list[float] = []
        self.reasons: set[str] = set()
        self.summary: dict = {"section": section, "source": None}
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._t0 = 0.0

    def __enter__(self) -> ClockLog:
        self._t0 = time.perf_counter()
        if shutil.which("nvidia-smi"):
            self._start_nvidia()
        elif glob.glob("/sys/class/drm/card*/device/pp_dpm_sclk"):
            self._thread = threading.Thread(target=self._poll_amd, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        source = None
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._reader.join(5)
            source = "nvidia-smi"
        if self._thread is not None:
            self._thread.join(5)
            source = "amdgpu sysfs"
        self.summary = {
            "section": self.section,
            "source": source,
            "seconds": round(time.perf_counter() - self._t0, 3),
            "samples": len(self.sm),
            "sm_mhz": _stats(self.sm),
            "mem_mhz": _stats(self.mem),
            "event_reasons": sorted(self.reasons),
        }

    def _start_nvidia(self) -> None:
        q = nvidia_query()
        cmd = [
            "nvidia-smi",
            f"--query-gpu={q}",
            "--format=csv,noheader,nounits",
            "-lms",
            str(int(PERIOD_S * 1e3)),
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read_nvidia, daemon=True)
        self._reader.start()

    def _read_nvidia(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 2:
                continue
            try:
                self.sm.append(float(parts[0]))
                self.mem.append(float(parts[1]))
            except ValueError:
                continue
            if len(parts) > 2 and parts[2] not in ("0x0000000000000000", "Not Active", "[N/A]"):
                self.reasons.add(parts[2])

    def _poll_amd(self) -> None:
        card = sorted(glob.glob("/sys/class/drm/card*/device/pp_dpm_sclk"))[0].rsplit("/", 1)[0]
        while not self._stop.is_set():
            sm, mem = _amd_level(f"{card}/pp_dpm_sclk"), _amd_level(f"{card}/pp_dpm_mclk")
            if sm is not None:
                self.sm.append(sm)
            if mem is not None:
                self.mem.append(mem)
            self._stop.wait(PERIOD_S)


def describe(summary: dict) -> str:
    """``SM 1,980 MHz (1,755-1,980), memory 2,619 MHz`` for a ClockLog summary."""
    if not summary or not summary.get("sm_mhz"):
        return "clocks not recorded"
    sm, mem = summary["sm_mhz"], summary.get("mem_mhz") or {}
    text = f"SM {sm['median']:,.0f} MHz ({sm['min']:,.0f}-{sm['max']:,.0f})"
    if mem:
        text += f", memory {mem['median']:,.0f} MHz"
    return text
