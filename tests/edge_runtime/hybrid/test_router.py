"""The router's rules, in order, each with its reason. Device readings are faked (psutil cannot be made to
report a battery or a saturated CPU here): the tests that use them say so in their names."""
from types import SimpleNamespace

import pytest

from cloud_fallback.health import CircuitBreaker
from edge_runtime.hybrid.device_state import DeviceState, read_device_state
from edge_runtime.hybrid.difficulty import Calibration
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.hybrid.router import Router, RouterLimits, kv_bytes_per_token

GiB = 1 << 30
CALM = DeviceState(8 * GiB, 16 * GiB, False, 90.0, 10.0)
POLICY = Calibration(k=4, threshold=2.5, target_cloud_share=0.3)


def req(max_tokens=64, **kw):
    return GenerationRequest(messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=max_tokens),
                             **kw)


def router(state=CALM, cloud="healthy", **kw):
    cloud = SimpleNamespace(health=CircuitBreaker()) if cloud == "healthy" else cloud
    return Router(cloud, n_ctx=2048, kv_bytes_per_token=30_000, policy=POLICY, device_probe=lambda: state, **kw)


def test_auto_on_a_calm_device_starts_locally_and_watches_difficulty():
    d = router().decide(req(), prompt_tokens=20)
    assert (d.route, d.rule, d.monitor) == ("local", "auto", True)
    assert "2.500" in d.reason and "30%" in d.reason


@pytest.mark.parametrize("kw, rule", [({"local_only": True, "route": "cloud"}, "privacy"),
                                      ({"route": "local"}, "hint")])
def test_privacy_and_local_hint_never_escalate(kw, rule):
    d = router().decide(req(**kw), 20)
    assert (d.route, d.rule, d.monitor) == ("local", rule, False)


def test_offline_and_no_cloud_stay_local_even_when_the_device_struggles_with_fake_low_memory():
    low = DeviceState(100 << 20, 16 * GiB, None, None, None)
    assert router(low, offline=True).decide(req(route="cloud"), 20).rule == "offline"
    assert router(low, cloud=None).decide(req(route="cloud"), 20).rule == "no_cloud"


def test_circuit_breaker_open_routes_local_with_its_reason_then_half_open_lets_one_try():
    now = [0.0]
    health = CircuitBreaker(failures_to_open=2, cooldown_s=10, clock=lambda: now[0])
    r = router(cloud=SimpleNamespace(health=health))
    health.record_failure("unreachable: refused")
    assert r.decide(req(route="cloud"), 20).route == "cloud"  # one failure: still closed
    health.record_failure("unreachable: refused")
    d = r.decide(req(route="cloud"), 20)
    assert (d.route, d.rule) == ("local", "health") and "2 consecutive failures" in d.reason and "refused" in d.reason
    now[0] = 11.0
    assert health.state == "half_open" and r.decide(req(route="cloud"), 20).route == "cloud"
    health.record_failure("stalled")  # the trial failed: open again at once
    assert health.state == "open"
    now[0] = 22.0
    health.record_success(3.0)
    assert health.state == "closed" and health.failures == 0 and "3.0 ms" in health.describe()


def test_request_beyond_the_local_context_goes_to_the_cloud():
    d = router().decide(req(max_tokens=100), prompt_tokens=2000)
    assert (d.route, d.rule) == ("cloud", "size") and "2000 prompt tokens" in d.reason and "2048" in d.reason
    assert router().decide(req(max_tokens=40), prompt_tokens=2000).route == "local"


@pytest.mark.parametrize("state, words", [
    (DeviceState(200 << 20, 16 * GiB, None, None, 5.0), "200 MiB free"),
    (DeviceState(8 * GiB, 16 * GiB, True, 12.0, 5.0), "on battery at 12 %"),
    (DeviceState(8 * GiB, 16 * GiB, None, None, 97.0), "CPU saturated"),
])
def test_fake_device_states_send_the_answer_to_the_cloud(state, words):
    d = router(state).decide(req(), 20)
    assert (d.route, d.rule) == ("cloud", "device") and words in d.reason


def test_fake_battery_above_the_floor_and_mains_power_stay_local():
    for state in (DeviceState(8 * GiB, 16 * GiB, True, 60.0, 5.0), DeviceState(8 * GiB, 16 * GiB, False, 5.0, 5.0)):
        assert router(state).decide(req(), 20).route == "local"
    lim = RouterLimits(battery_floor_percent=70)
    assert router(DeviceState(8 * GiB, 16 * GiB, True, 60.0, 5.0), limits=lim).decide(req(), 20).route == "cloud"


def test_memory_rule_counts_this_requests_kv_cache_with_a_fake_reading():
    state = DeviceState(400 << 20, 16 * GiB, None, None, None)  # 400 MiB free; the floor is 256 MiB
    r = Router(SimpleNamespace(health=CircuitBreaker()), n_ctx=4096, kv_bytes_per_token=100_000, policy=POLICY,
               device_probe=lambda: state)
    assert r.decide(req(max_tokens=80), 20).route == "local"  # 100 tokens: 9.5 MiB + 256 MiB fits
    d = r.decide(req(max_tokens=1900), 100)  # 2000 tokens: 191 MiB + 256 MiB does not
    assert (d.route, d.rule) == ("cloud", "device") and "447 MiB" in d.reason


def test_real_device_reading_on_this_machine():
    import time

    from edge_runtime.hybrid import device_state
    read_device_state()
    time.sleep(device_state.CPU_WINDOW_S)
    s = read_device_state()
    assert 0 < s.available_bytes <= s.total_bytes
    assert s.cpu_others_percent is not None and 0 <= s.cpu_others_percent <= 100
    assert "MiB free" in s.describe()


def test_kv_bytes_per_token_of_the_default_model(native_backend):
    cfg = native_backend.config
    assert kv_bytes_per_token(native_backend) == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    assert kv_bytes_per_token(object()) == 0
