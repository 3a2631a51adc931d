"""`edge-runtime devices` through cli.main on this machine: keys, the choice here, overrides and errors."""
import json

import pytest

from edge_cli.main import main


def run(capsys, *argv):
    code = main(["devices", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_devices_json_has_found_chosen_reasons_and_picks_laptop_cpu_here(capsys):
    code, out, err = run(capsys, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"found", "chosen", "reasons", "kernels"}
    from kernels import cpu_gemv, cpu_qgemm

    if cpu_gemv.available():
        k = data["kernels"]
        assert k["available"] and k["isa_variant"] == cpu_qgemm.variant() and k["best"] == cpu_qgemm.best()
        assert "portable" in k["runnable"] and k["arith"] in ("int8", "exact")
    found, chosen = data["found"], data["chosen"]
    if found["cuda"] or found["mps"]:
        pytest.skip("this machine has a GPU: the laptop_cpu expectation is for CPU-only machines")
    assert chosen["profile"] == "laptop_cpu" and chosen["backend"] == "native" and chosen["device"] == "cpu"
    assert 1 <= chosen["threads"] <= found["cpu"]["physical_cores"]
    assert 0 < chosen["kv_budget_bytes"] <= found["memory"]["available_bytes"]
    assert chosen["providers"][-1] == "CPUExecutionProvider" and "reasons" not in chosen
    assert data["reasons"] and "laptop_cpu" in data["reasons"][0]


def test_devices_text_lists_found_chosen_and_reasons(capsys):
    code, out, err = run(capsys)
    assert code == 0, err
    assert "kernels: ISA variant" in out or "kernels: unavailable" in out
    for word in ("found", "cpu", "isa", "memory", "battery", "onnxruntime", "chosen: profile", "reasons"):
        assert word in out
    assert "CPUExecutionProvider" in out and "\n  - " in out


def test_devices_overrides(capsys):
    code, out, err = run(capsys, "--json", "--device", "cpu", "--backend", "llama.cpp")
    assert code == 0, err
    data = json.loads(out)
    assert data["chosen"]["profile"] == "laptop_cpu" and data["chosen"]["backend"] == "llama.cpp"
    assert data["reasons"][0] == "device 'cpu' requested: profile laptop_cpu"
    assert "backend llama.cpp requested instead of the profile's native" in data["reasons"]
    assert data["chosen"]["serve_concurrency"] == "one request at a time (llama.cpp)"


def test_devices_says_how_serve_handles_concurrent_requests(capsys):
    from kernels import cpu_gemv

    code, out, err = run(capsys)
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("  serve: "))
    if cpu_gemv.available():  # the native backend with its C kernels batches
        assert line == "  serve: concurrent requests share decode steps"


def test_devices_unknown_device_exits_2_naming_it(capsys):
    code, out, err = run(capsys, "--device", "tpu")
    assert code == 2 and out == ""
    assert err.startswith("edge-runtime: error: unknown device 'tpu'") and "cuda" in err and err.count("\n") == 1


def test_devices_absent_device_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run(capsys, "--device", "cuda")
    assert code == 2 and "edge-runtime: error: device 'cuda'" in err and "no CUDA GPU" in err


def test_devices_bad_backend_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["devices", "--backend", "tensorrt"])
    assert e.value.code == 2 and "tensorrt" in capsys.readouterr().err


def test_an_isa_this_cpu_cannot_run_is_a_one_line_error():
    """EDGE_RUNTIME_ISA naming a variant this CPU lacks: exit 2 and one line naming what it can run."""
    import os
    import subprocess
    import sys

    from kernels import cpu_gemv, cpu_qgemm

    if not cpu_gemv.available():
        pytest.skip("C kernels unavailable here")
    missing = [v for v in cpu_qgemm.VARIANTS if v not in cpu_qgemm.supported()][-1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-m", "edge_cli", "devices"], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, EDGE_RUNTIME_ISA=missing), timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"edge-runtime: error: this CPU cannot run the {missing} kernels; it runs: {', '.join(cpu_qgemm.supported())}"]
