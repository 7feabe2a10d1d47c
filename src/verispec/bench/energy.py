"""Energy meters: joules spent during a measured run, where the machine exposes a meter.

Owns reading Intel RAPL counters (`/sys/class/powercap/<zone>/energy_uj`, top-level zones only, so
a package and its core/uncore sub-zones are not counted twice; a counter that wrapped around is
corrected with the zone's `max_energy_range_uj`) and NVIDIA GPUs through NVML (`pynvml`, used
only when importable). When no meter can be read the result is None, and reports say
"not measured": a value is never estimated or made up.

RAPL measures the whole package, not this process: other load on the machine is included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

POWERCAP_ROOT = Path("/sys/class/powercap")
_TOP_LEVEL_ZONE = re.compile(r"^[a-z_-]+:\d+$")  # intel-rapl:0, not intel-rapl:0:1 (a sub-zone)


def counter_delta(start: int, end: int, max_range: int) -> int:
    """Increase of a wrapping counter from `start` to `end` (it counts up to `max_range`, then
    restarts at 0). Assumes at most one wrap between the two reads."""
    assert start >= 0 and end >= 0 and max_range > 0, "counters are non-negative"
    return end - start if end >= start else end + max_range - start


class Meter(Protocol):
    name: str

    def read(self) -> list[int]:
        """Raw counter values, one per channel (units are the meter's own)."""

    def joules(self, start: Sequence[int], end: Sequence[int]) -> float:
        """Energy between two reads."""


@dataclass
class RaplMeter:
    """Top-level RAPL zones; counters in microjoules."""

    zones: list[Path]
    ranges: list[int]
    name: str = "rapl"

    @staticmethod
    def open(root: Path = POWERCAP_ROOT) -> "RaplMeter | None":
        zones, ranges = [], []
        for counter in sorted(root.glob("*/energy_uj")):
            zone = counter.parent
            if not _TOP_LEVEL_ZONE.match(zone.name) or "mmio" in zone.name:
                continue  # sub-zones are part of their package; mmio duplicates the package
            try:
                int(counter.read_text())
                ranges.append(int((zone / "max_energy_range_uj").read_text()))
            except (OSError, ValueError):
                continue  # unreadable (permissions) or malformed: not a usable meter
            zones.append(counter)
        return RaplMeter(zones, ranges) if zones else None

    def read(self) -> list[int]:
        return [int(path.read_text()) for path in self.zones]

    def joules(self, start: Sequence[int], end: Sequence[int]) -> float:
        return sum(counter_delta(a, b, r) for a, b, r in zip(start, end, self.ranges)) / 1e6


@dataclass
class NvmlMeter:
    """Every NVIDIA GPU's total-energy counter (millijoules since driver load)."""

    handles: list
    nvml: object
    name: str = "nvml"

    @staticmethod
    def open() -> "NvmlMeter | None":
        try:
            import pynvml  # optional: only where installed
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            for handle in handles:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except Exception:  # no driver, no GPU, or a GPU without an energy counter
            return None
        return NvmlMeter(handles, pynvml) if handles else None

    def read(self) -> list[int]:
        return [int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self.handles]

    def joules(self, start: Sequence[int], end: Sequence[int]) -> float:
        return sum(b - a for a, b in zip(start, end)) / 1e3


class EnergyProbe:
    """Reads every available meter around a measured call.

    `start()` returns a token; `stop(token)` returns the joules spent since (all meters summed),
    or None when no meter is available or a read failed.
    """

    def __init__(self, openers: Sequence[Callable[[], Meter | None]] = (RaplMeter.open, NvmlMeter.open)):
        self.meters: list[Meter] = [m for m in (opener() for opener in openers) if m is not None]

    @property
    def available(self) -> bool:
        return bool(self.meters)

    @property
    def description(self) -> str:
        return ", ".join(m.name for m in self.meters) if self.meters else "not measured"

    def start(self) -> list[list[int]] | None:
        try:
            return [meter.read() for meter in self.meters] if self.meters else None
        except Exception:  # a meter that stops answering means "not measured", not a crash
            return None

    def stop(self, token: list[list[int]] | None) -> float | None:
        if token is None:
            return None
        try:
            return sum(m.joules(a, m.read()) for m, a in zip(self.meters, token))
        except Exception:  # as in start()
            return None
