"""Where an answer starts, and why: the hybrid runtime's router.

`Router.decide(request, prompt_tokens)` returns a `RouteDecision` (route,
reason, and whether the difficulty monitor watches a local start). The rules,
first match wins:

1. privacy: `local_only` never leaves the device;
2. offline mode never touches the network;
3. no cloud configured;
4. cloud health: the circuit breaker is open after repeated failures;
5. the route hint (request's, else the runtime's): `local` or `cloud`;
6. request size: prompt plus max_tokens beyond the device's context;
7. device state (psutil): free memory below what this request's KV cache
   needs plus a floor, on battery below `battery_floor_percent`, or other
   processes holding the CPU above `cpu_busy_percent`;
8. otherwise (auto) the device answers first and the difficulty monitor
   watches its first tokens: the local model's own uncertainty, calibrated on
   the shipped labelled set to a target cloud share (edge_runtime/hybrid/difficulty.py),
   hands a hard prompt to the cloud after `k` tokens, and a collapse of
   confidence later hands it over mid-stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from edge_runtime.hybrid.device_state import DeviceState, read_device_state


@dataclass
class RouteDecision:
    route: str  # local | cloud
    reason: str
    monitor: bool = False  # watch the local answer's confidence and escalate when it trips
    rule: str = ""  # which rule decided: privacy, offline, no_cloud, health, hint, size, device, auto


@dataclass
class RouterLimits:
    memory_floor_bytes: int = 256 << 20  # keep this much free beyond the request's KV cache
    battery_floor_percent: float = 20.0
    cpu_busy_percent: float = 90.0


class Router:
    def __init__(self, cloud=None, offline: bool = False, route: str = "auto", n_ctx: int | None = None,
                 kv_bytes_per_token: int = 0, policy=None, limits: RouterLimits | None = None,
                 device_probe: Callable[[], DeviceState] | None = read_device_state, watch: bool = False):
        self.cloud, self.offline, self.route = cloud, offline, route
        self.n_ctx, self.kv_bytes_per_token = n_ctx, kv_bytes_per_token
        self.policy = policy  # a difficulty Calibration, or None (then auto stays local without a monitor)
        self.watch = watch  # a monitor runs even without a policy (the runtime was given one)
        self.limits = limits or RouterLimits()
        self.device_probe = device_probe
        if device_probe is read_device_state:
            read_device_state()  # CPU load is measured between readings: take the first one now

    def decide(self, request, prompt_tokens: int | None = None) -> RouteDecision:
        hint = request.route if request.route != "auto" else self.route
        if request.local_only:
            return RouteDecision("local", "local_only: the request must not leave the device", rule="privacy")
        if self.offline:
            return RouteDecision("local", "offline mode: no network", rule="offline")
        if self.cloud is None:
            return RouteDecision("local", "no cloud worker configured", rule="no_cloud")
        health = getattr(self.cloud, "health", None)
        if health is not None and not health.allow():
            return RouteDecision("local", health.describe(), rule="health")
        if hint == "cloud":
            return RouteDecision("cloud", "route hint: cloud", rule="hint")
        if hint == "local":
            return RouteDecision("local", "route hint: local", rule="hint")
        max_tokens = request.params.max_tokens
        if prompt_tokens is not None and self.n_ctx is not None and prompt_tokens + max_tokens > self.n_ctx:
            return RouteDecision("cloud", f"request size: {prompt_tokens} prompt tokens + max_tokens {max_tokens} "
                                          f"exceed the device's context of {self.n_ctx}", rule="size")
        state = self.device_probe() if self.device_probe is not None else None
        if state is not None:
            why = self._device_reason(state, (prompt_tokens or 0) + max_tokens)
            if why:
                return RouteDecision("cloud", f"device: {why}", rule="device")
        p = self.policy
        if p is None:
            if self.watch:
                return RouteDecision("local", "auto: the device answers first; a confidence monitor may hand the "
                                              "answer to the cloud", monitor=True, rule="auto")
            return RouteDecision("local", "auto: the device answers (no difficulty calibration loaded)", rule="auto")
        if getattr(p, "kind", "margin") == "probe":
            how = (f"the probe on the local model's prompt representation scores over {p.probe_threshold:.3f} at "
                   f"the first token")
        else:
            how = f"the difficulty after {p.k} tokens exceeds {p.threshold:.3f}"
        return RouteDecision("local", f"auto: the device answers first; the cloud takes over if {how} (calibrated "
                                      f"for a {p.target_cloud_share:.0%} cloud share) or confidence collapses",
                             monitor=True, rule="auto")

    def _device_reason(self, s: DeviceState, tokens: int) -> str:
        lim = self.limits
        need = tokens * self.kv_bytes_per_token + lim.memory_floor_bytes
        if s.available_bytes < need:
            return (f"{s.available_bytes / 2**20:.0f} MiB free, below the {need / 2**20:.0f} MiB this request's KV "
                    f"cache and a {lim.memory_floor_bytes >> 20} MiB floor need")
        if s.on_battery and s.battery_percent is not None and s.battery_percent < lim.battery_floor_percent:
            return f"on battery at {s.battery_percent:.0f} % (below {lim.battery_floor_percent:.0f} %)"
        if s.cpu_others_percent is not None and s.cpu_others_percent > lim.cpu_busy_percent:
            return f"CPU saturated: other processes use {s.cpu_others_percent:.0f} % (above {lim.cpu_busy_percent:.0f} %)"
        return ""


def kv_bytes_per_token(local) -> int:
    """K and V bytes per token across all layers for a local backend (0 when it does not say)."""
    cfg = getattr(local, "config", None)
    if cfg is None:
        return 0
    kv = getattr(local, "kv_config", None)
    width = {"fp32": 4, "int8": 1}.get(getattr(kv, "kv_dtype", "fp16"), 2)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * width
