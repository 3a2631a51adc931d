"""What the device can afford right now, read through psutil: free memory, battery, CPU load.

`read_device_state()` takes one reading. CPU load is the system's busy share
minus this process's own share (our own decoding must not make the device
look saturated), measured over at least `CPU_WINDOW_S` seconds: a reading
sooner than that after the last measurement reuses it, and the first reading
has nothing behind it and reports `cpu_others_percent=None`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class DeviceState:
    available_bytes: int
    total_bytes: int
    on_battery: bool | None  # None: no battery (a desktop, a server)
    battery_percent: float | None
    cpu_others_percent: float | None  # busy share of all cores used by other processes, 0..100

    def describe(self) -> str:
        parts = [f"{self.available_bytes / 2**20:.0f} MiB free of {self.total_bytes / 2**20:.0f} MiB"]
        if self.on_battery is not None:
            parts.append(f"on battery at {self.battery_percent:.0f} %" if self.on_battery else "on mains power")
        if self.cpu_others_percent is not None:
            parts.append(f"other processes use {self.cpu_others_percent:.0f} % of the CPU")
        return ", ".join(parts)


CPU_WINDOW_S = 1.0
_proc = psutil.Process()
_cpu = {"t": None, "others": None}  # the last CPU measurement: when, and its value


def _cpu_others() -> float | None:
    now = time.monotonic()
    if _cpu["t"] is not None and now - _cpu["t"] < CPU_WINDOW_S:
        return _cpu["others"]  # too short an interval to mean anything: keep the last measurement
    system = psutil.cpu_percent(interval=None)
    own = _proc.cpu_percent(interval=None) / max(1, psutil.cpu_count() or 1)
    _cpu["others"] = None if _cpu["t"] is None else max(0.0, system - own)
    _cpu["t"] = now
    return _cpu["others"]


def read_device_state() -> DeviceState:
    vm = psutil.virtual_memory()
    battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
    others = _cpu_others()
    return DeviceState(
        available_bytes=int(vm.available), total_bytes=int(vm.total),
        on_battery=None if battery is None else not battery.power_plugged,
        battery_percent=None if battery is None else float(battery.percent),
        cpu_others_percent=others,
    )
