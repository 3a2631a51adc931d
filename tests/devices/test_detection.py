"""devices.detect() on this machine, checked against the sources it reads; then faked probe failures and parsers."""
import json
import os
import platform

import psutil
import pytest

from devices import detect, detection


@pytest.fixture(scope="module")
def found():
    return detect()


def test_detect_on_this_machine_is_json_serialisable(found):
    assert json.loads(json.dumps(found)) == found
    for key in ("os", "machine", "cpu", "memory", "battery", "cuda", "mps", "onnxruntime", "errors"):
        assert key in found
    assert found["os"] == platform.system() and found["machine"] == platform.machine()
    assert found["errors"] == {}, found["errors"]


def test_detect_on_this_machine_cores_match_os_and_psutil(found):
    cpu = found["cpu"]
    assert cpu["logical_cores"] == os.cpu_count()
    assert cpu["physical_cores"] == (psutil.cpu_count(logical=False) or os.cpu_count())
    assert 1 <= cpu["physical_cores"] <= cpu["logical_cores"]
    assert 1 <= cpu["usable_cores"] <= cpu["logical_cores"]
    assert cpu["model"]


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="Linux x86-64 only")
def test_detect_on_this_machine_isa_matches_proc_cpuinfo(found):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        raw = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    isa = found["cpu"]["isa"]
    assert isa == sorted(set(raw) & detection.X86_FLAGS)
    assert isa == sorted(isa) and all(f == f.lower() for f in isa)
    assert found["cpu"]["isa_source"] == "/proc/cpuinfo"
    for flag in ("avx2", "fma", "f16c"):  # what the GGUF kernels need; this machine has them
        assert (flag in isa) == (flag in raw)


def test_detect_on_this_machine_memory_matches_psutil(found):
    vm = psutil.virtual_memory()
    assert found["memory"]["total_bytes"] == vm.total
    assert 0 < found["memory"]["available_bytes"] <= vm.total


def test_detect_on_this_machine_battery_matches_psutil(found):
    battery = psutil.sensors_battery()
    if battery is None:
        assert found["battery"] is None
    else:
        assert found["battery"]["plugged"] == battery.power_plugged
        assert found["battery"]["percent"] == pytest.approx(battery.percent, abs=5)


def test_detect_on_this_machine_gpus_match_torch(found):
    import torch

    if not torch.cuda.is_available():
        assert found["cuda"] == []
    else:
        assert len(found["cuda"]) == torch.cuda.device_count()
        assert all(g["memory_bytes"] > 0 and "." in g["capability"] for g in found["cuda"])
    assert found["mps"] == torch.backends.mps.is_available()


def test_detect_on_this_machine_onnxruntime_providers(found):
    import onnxruntime

    ort = found["onnxruntime"]
    assert ort["version"] == onnxruntime.__version__
    assert ort["providers"] == onnxruntime.get_available_providers()
    assert "CPUExecutionProvider" in ort["providers"]


def test_detect_fake_failing_probe_is_recorded_not_raised(monkeypatch):
    def broken():
        raise RuntimeError("fake driver failure")

    monkeypatch.setattr(detection, "_battery", broken)
    monkeypatch.setattr(detection, "_cuda", broken)
    found = detect()
    assert found["battery"] is None and found["cuda"] == []
    assert set(found["errors"]) == {"battery", "cuda"}
    assert "fake driver failure" in found["errors"]["cuda"] and "RuntimeError" in found["errors"]["cuda"]
    assert found["memory"]["total_bytes"] > 0 and found["cpu"]["logical_cores"] == os.cpu_count()
    json.dumps(found)


def test_detect_fake_onnxruntime_missing_reads_as_none(monkeypatch):
    real = detection.importlib.util.find_spec
    monkeypatch.setattr(detection.importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    found = detect()
    assert found["onnxruntime"] is None and "onnxruntime" not in found["errors"]


def test_cpu_isa_fake_arm64_without_flag_source_has_neon(monkeypatch):
    monkeypatch.setattr(detection.platform, "system", lambda: "FakeOS")
    monkeypatch.setattr(detection.platform, "machine", lambda: "arm64")
    assert detection.cpu_isa() == (["neon"], "arm64")


def test_parse_cpuinfo_flags_fake_linux_arm64():
    text = ("processor\t: 0\nBogoMIPS\t: 48.00\n"
            "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
            "lrcpc dcpop asimddp sve i8mm bf16\nCPU implementer\t: 0x41\n")
    assert detection.parse_cpuinfo_flags(text) == {"neon", "fp16", "dotprod", "sve", "i8mm", "bf16"}


def test_parse_cpuinfo_flags_fake_x86_keeps_only_flags_of_interest():
    text = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512_vnni amx_tile ht\n"
    assert detection.parse_cpuinfo_flags(text) == {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f",
                                                   "avx512_vnni", "amx_tile"}


def test_parse_sysctl_flags_fake_apple_silicon():
    text = ("hw.optional.arm.FEAT_DotProd: 1\nhw.optional.arm.FEAT_I8MM: 0\nhw.optional.arm.FEAT_BF16: 1\n"
            "hw.optional.arm.FEAT_FP16: 1\nhw.optional.neon: 1\nhw.optional.AdvSIMD: 1\n"
            "hw.optional.floatingpoint: 1\n")
    assert detection.parse_sysctl_flags(text) == {"neon", "dotprod", "bf16", "fp16"}


def test_parse_sysctl_flags_fake_intel_mac():
    text = ("hw.optional.avx1_0: 1\nhw.optional.avx2_0: 1\nhw.optional.avx512f: 0\nhw.optional.sse4_2: 1\n"
            "machdep.cpu.features: FPU VME SSE4.1 SSE4.2 AVX1.0 FMA F16C\n"
            "machdep.cpu.leaf7_features: SMEP BMI1 AVX2 AVX512F AVX512VNNI\n")
    assert detection.parse_sysctl_flags(text) == {"avx", "avx2", "sse4_1", "sse4_2", "fma", "f16c", "avx512f",
                                                  "avx512_vnni"}


def test_devices_package_never_imports_edge_runtime():
    """The package direction kernels <- devices <- edge_runtime, checked in a fresh interpreter."""
    import subprocess
    import sys

    code = "import sys, devices; devices.choose(devices.detect()); print('edge_runtime' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
