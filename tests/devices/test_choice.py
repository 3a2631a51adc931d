"""devices.choose() on FAKED capability sets: every machine here is a dict written by hand, not detected."""
import json

import pytest

from devices import Choice, DeviceError, choose, load_profiles

GiB, MiB = 2 ** 30, 2 ** 20
CPU_EP, QNN_EP, OV_EP, DML_EP, CUDA_EP = ("CPUExecutionProvider", "QNNExecutionProvider",
                                          "OpenVINOExecutionProvider", "DmlExecutionProvider", "CUDAExecutionProvider")
RTX = {"name": "NVIDIA GeForce RTX 4060 Laptop GPU", "memory_bytes": 8 * GiB, "capability": "8.9"}


def fake_machine(physical=8, logical=16, usable=None, isa=("avx", "avx2", "f16c", "fma", "sse4_2"),
                 machine="x86_64", os_name="Linux", available=16 * GiB, battery=None, cuda=(), mps=False,
                 providers=(CPU_EP,)):
    """A `devices.detect()`-shaped dict for an imaginary machine (x86 laptop, mains power, no GPU by default)."""
    return {
        "os": os_name, "machine": machine,
        "cpu": {"model": "Fake CPU", "physical_cores": physical, "logical_cores": logical,
                "usable_cores": usable or logical, "isa": sorted(isa), "isa_source": "fake"},
        "memory": {"total_bytes": 2 * available, "available_bytes": available},
        "battery": battery, "cuda": [dict(g) for g in cuda], "mps": mps,
        "onnxruntime": None if providers is None else {"version": "1.99.0", "providers": list(providers)},
        "errors": {},
    }


def test_choose_fake_cpu_only_machine_falls_back_to_laptop_cpu():
    c = choose(fake_machine())
    assert (c.profile, c.backend, c.device, c.quant, c.kv_dtype) == ("laptop_cpu", "native", "cpu", "gguf", "fp16")
    assert c.threads == 8 and c.block_size == 16 and c.providers == [CPU_EP]
    assert c.kv_budget_bytes == 4 * GiB  # 25 % of 16 GiB
    assert "profile laptop_cpu, the fallback" in c.reasons[0] and "laptop_cuda: no CUDA GPU" in c.reasons[0]
    assert any("25% of 16.0 GiB available RAM" in r for r in c.reasons)


def test_choose_fake_cpu_without_avx2_uses_int4_weights():
    c = choose(fake_machine(isa=("sse4_2",)))
    assert c.quant == "int4"
    assert any("lacks AVX2/FMA/F16C" in r for r in c.reasons)


def test_choose_fake_cuda_present():
    c = choose(fake_machine(cuda=[RTX]))
    assert (c.profile, c.backend, c.device, c.quant) == ("laptop_cuda", "native", "cuda", "int4")
    assert c.reasons[0] == "CUDA GPU 'NVIDIA GeForce RTX 4060 Laptop GPU' with 8.0 GiB: profile laptop_cuda"
    assert c.kv_budget_bytes == int(0.4 * 8 * GiB)  # the GPU's memory, not the 16 GiB of RAM
    assert c.threads == 4  # half the physical cores: the GPU does the work
    assert c.providers == [CPU_EP]  # this fake onnxruntime has no CUDA provider
    assert choose(fake_machine(cuda=[RTX], providers=(CUDA_EP, CPU_EP))).providers == [CUDA_EP, CPU_EP]


def test_choose_fake_cuda_beats_an_npu_provider():
    assert choose(fake_machine(cuda=[RTX], providers=(QNN_EP, CPU_EP))).profile == "laptop_cuda"


def test_choose_fake_qnn_provider_present():
    found = fake_machine(machine="ARM64", os_name="Windows", isa=("neon", "dotprod"), providers=(QNN_EP, CPU_EP))
    c = choose(found)
    assert (c.profile, c.backend, c.device) == ("qualcomm_npu_qnn", "onnxruntime", "npu")
    assert c.providers == [QNN_EP, CPU_EP]
    assert c.provider_options == {QNN_EP: {"backend_type": "htp"}}
    assert c.reasons[0] == "onnxruntime 1.99.0 offers QNNExecutionProvider: profile qualcomm_npu_qnn"


def test_choose_fake_qnn_absent_is_not_chosen():
    c = choose(fake_machine(machine="ARM64", isa=("neon",), providers=(CPU_EP,)))
    assert c.profile == "laptop_cpu" and c.quant == "int4"  # no AVX2 kernels on ARM


def test_choose_fake_intel_npu_openvino():
    c = choose(fake_machine(providers=(OV_EP, CPU_EP)))
    assert (c.profile, c.backend, c.device) == ("intel_npu_openvino", "onnxruntime", "npu")
    assert c.providers == [OV_EP, CPU_EP] and c.provider_options == {OV_EP: {"device_type": "NPU"}}


def test_choose_fake_directml():
    c = choose(fake_machine(os_name="Windows", providers=(DML_EP, CPU_EP)))
    assert (c.profile, c.backend, c.providers) == ("directml", "onnxruntime", [DML_EP, CPU_EP])


def test_choose_fake_openvino_beats_directml():
    assert choose(fake_machine(providers=(DML_EP, OV_EP, CPU_EP))).profile == "intel_npu_openvino"


def test_choose_fake_apple_mps():
    c = choose(fake_machine(os_name="Darwin", machine="arm64", isa=("neon",), mps=True))
    assert (c.profile, c.backend, c.device, c.quant) == ("apple_mps", "native", "mps", "bf16")
    assert c.reasons[0] == "Apple MPS GPU present: profile apple_mps"
    assert any("available unified memory" in r for r in c.reasons)


def test_choose_fake_low_memory():
    c = choose(fake_machine(available=int(1.5 * GiB)))
    assert c.kv_dtype == "int8" and c.kv_budget_bytes == 256 * MiB
    assert "low memory (1.5 GiB available RAM): KV int8, budget 256 MiB" in c.reasons
    tiny = choose(fake_machine(available=512 * MiB))
    assert tiny.kv_dtype == "int8" and tiny.kv_budget_bytes == 128 * MiB  # still the profile's 25 %


def test_choose_fake_low_gpu_memory_counts_the_gpu_not_the_ram():
    small = dict(RTX, memory_bytes=int(1.5 * GiB))
    c = choose(fake_machine(cuda=[small], available=64 * GiB))
    assert c.kv_dtype == "int8" and c.kv_budget_bytes == 256 * MiB
    assert "low memory (1.5 GiB memory on 'NVIDIA GeForce RTX 4060 Laptop GPU')" in c.reasons[-1]
    assert choose(fake_machine(cuda=[RTX], available=int(1.5 * GiB))).kv_dtype == "fp16"


def test_choose_fake_plenty_of_memory_is_capped_by_the_profile():
    c = choose(fake_machine(available=64 * GiB))
    assert c.kv_budget_bytes == 4 * GiB and c.kv_dtype == "fp16"
    assert any("capped at the profile's 4.0 GiB" in r for r in c.reasons)


def test_choose_fake_on_battery():
    c = choose(fake_machine(battery={"percent": 23.0, "plugged": False}))
    assert c.threads == 4
    assert "on battery (23 %): threads 8 -> 4" in c.reasons
    plugged = choose(fake_machine(battery={"percent": 23.0, "plugged": True}))
    assert plugged.threads == 8 and not any("battery" in r for r in plugged.reasons)
    assert choose(fake_machine(physical=1, logical=2, battery={"percent": 50, "plugged": False})).threads == 1


def test_choose_fake_threads_never_exceed_physical_or_usable_cores():
    assert choose(fake_machine(physical=8, logical=16, usable=2)).threads == 2
    profiles = load_profiles()
    for p in profiles:
        p["threads"] = 64
    c = choose(fake_machine(physical=6, logical=12), profiles=profiles)
    assert c.threads == 6 and any("capped at 6" in r for r in c.reasons)


def test_choose_fake_device_override_by_kind_and_by_name():
    found = fake_machine(cuda=[RTX])
    c = choose(found, device="cpu")
    assert (c.profile, c.device) == ("laptop_cpu", "cpu")
    assert c.reasons[0] == "device 'cpu' requested: profile laptop_cpu"
    assert choose(found, device="laptop_cuda").device == "cuda"
    two = fake_machine(cuda=[RTX, dict(RTX, name="Second", memory_bytes=4 * GiB)])
    c = choose(two, device="cuda:1")
    assert c.device == "cuda:1" and c.kv_budget_bytes == int(0.4 * 4 * GiB) and "'Second'" in c.reasons[0]


def test_choose_fake_backend_override():
    c = choose(fake_machine(cuda=[RTX]), backend="llama.cpp")
    assert (c.backend, c.device, c.quant) == ("llama.cpp", "cuda", "gguf")
    assert "backend llama.cpp requested instead of the profile's native" in c.reasons
    c = choose(fake_machine(), backend="onnxruntime")
    assert (c.backend, c.quant, c.providers) == ("onnxruntime", "int4", [CPU_EP])


def test_choose_fake_native_backend_on_an_npu_profile_runs_on_cpu():
    c = choose(fake_machine(providers=(QNN_EP, CPU_EP)), backend="native")
    assert (c.profile, c.backend, c.device, c.quant) == ("qualcomm_npu_qnn", "native", "cpu", "gguf")
    with pytest.raises(DeviceError, match="device 'qnn' runs only through onnxruntime"):
        choose(fake_machine(providers=(QNN_EP, CPU_EP)), device="qnn", backend="native")


def test_choose_unknown_device_names_it_and_lists_the_choices():
    with pytest.raises(DeviceError) as e:
        choose(fake_machine(), device="tpu")
    msg = str(e.value)
    assert "'tpu'" in msg and all(k in msg for k in ("cpu", "cuda", "mps", "qnn", "openvino", "dml", "laptop_cpu"))
    with pytest.raises(DeviceError, match="unknown device 'cpu:3'"):
        choose(fake_machine(), device="cpu:3")


@pytest.mark.parametrize("device, why", [
    ("cuda", "no CUDA GPU"), ("mps", "no Apple MPS GPU"), ("qnn", "no QNNExecutionProvider in onnxruntime"),
    ("dml", "has CPUExecutionProvider"), ("openvino", "OpenVINOExecutionProvider"),
])
def test_choose_fake_device_requested_but_absent(device, why):
    with pytest.raises(DeviceError, match="is not available here") as e:
        choose(fake_machine(), device=device)
    assert repr(device) in str(e.value) and why in str(e.value)


def test_choose_fake_gpu_index_absent():
    with pytest.raises(DeviceError, match=r"'cuda:1' is not available here: 1 CUDA GPU\(s\) found"):
        choose(fake_machine(cuda=[RTX]), device="cuda:1")


def test_choose_fake_backend_errors():
    with pytest.raises(DeviceError, match="unknown backend 'tensorrt'"):
        choose(fake_machine(), backend="tensorrt")
    with pytest.raises(DeviceError, match="onnxruntime is not installed"):
        choose(fake_machine(providers=None), backend="onnxruntime")
    assert choose(fake_machine(providers=None)).providers == [CPU_EP]  # nothing to filter against


@pytest.mark.parametrize("providers", [(CPU_EP,), (QNN_EP, CPU_EP), (DML_EP, OV_EP, CUDA_EP, CPU_EP), None])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_choose_fake_providers_order_ends_with_cpu(providers, device):
    c = choose(fake_machine(cuda=[RTX], providers=providers), device=device)
    assert c.providers[-1] == CPU_EP and CPU_EP not in c.providers[:-1]
    if providers is not None:
        assert set(c.providers) <= set(providers)


def test_choice_to_dict_is_json_with_every_field():
    d = choose(fake_machine()).to_dict()
    assert set(d) == {f for f in Choice.__dataclass_fields__}
    assert json.loads(json.dumps(d)) == d and isinstance(d["threads"], int) and isinstance(d["reasons"], list)
