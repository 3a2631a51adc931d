"""The profile data files: the six shipped ones load and validate; broken copies fail naming file and key."""
import json
import os
import shutil
import tomllib

import pytest

from devices import ProfileError, load_profiles
from devices.profile import PROFILES_DIR

NAMES = {"laptop_cpu", "laptop_cuda", "apple_mps", "qualcomm_npu_qnn", "intel_npu_openvino", "directml"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_shipped_profiles_load_highest_priority_first():
    profiles = load_profiles()
    assert {p["name"] for p in profiles} == NAMES
    priorities = [p["priority"] for p in profiles]
    assert priorities == sorted(priorities, reverse=True) and len(set(priorities)) == len(priorities)
    assert profiles[-1]["name"] == "laptop_cpu" and profiles[-1]["match"] == {}
    assert sum(1 for p in profiles if not p["match"]) == 1  # one fallback


def test_shipped_profiles_providers_end_with_cpu_and_name_their_own_first():
    by_name = {p["name"]: p for p in load_profiles()}
    for p in by_name.values():
        assert p["providers"][-1] == "CPUExecutionProvider", p["name"]
        if "ort_provider" in p["match"]:
            assert p["providers"][0] == p["match"]["ort_provider"] and p["backend"] == "onnxruntime"
    assert by_name["qualcomm_npu_qnn"]["providers"] == ["QNNExecutionProvider", "CPUExecutionProvider"]


def test_profiles_are_package_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "profiles/*.json" in data["devices"]


@pytest.fixture
def copy_dir(tmp_path):
    d = tmp_path / "profiles"
    shutil.copytree(PROFILES_DIR, d)
    return d


def _edit(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_missing_key_error_names_file_and_key(copy_dir):
    _edit(copy_dir / "laptop_cuda.json", lambda d: d.pop("block_size"))
    with pytest.raises(ProfileError, match=r"laptop_cuda\.json is missing the key 'block_size'"):
        load_profiles(str(copy_dir))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(backend="tensorrt"), r"backend 'tensorrt' must be one of native, llama.cpp, onnxruntime"),
    (lambda d: d.update(providers=["CUDAExecutionProvider"]), r"providers must be .* ending in 'CPUExecutionProvider'"),
    (lambda d: d.update(match={"tpu": True}), r"unknown match key\(s\) tpu"),
    (lambda d: d.update(kv_budget_fraction=1.5), r"kv_budget_fraction 1.5 must be in \(0, 1\]"),
    (lambda d: d.update(threads="all"), r"threads 'all' must be"),
    (lambda d: d.update(name="other"), r"name 'other' must match the file name 'laptop_cuda'"),
    (lambda d: d.update(block_size="16"), r"'block_size' has the wrong type"),
])
def test_bad_value_error_names_file_and_value(copy_dir, edit, message):
    _edit(copy_dir / "laptop_cuda.json", edit)
    with pytest.raises(ProfileError, match=message) as e:
        load_profiles(str(copy_dir))
    assert "laptop_cuda.json" in str(e.value)


def test_not_json_error_names_file(copy_dir):
    (copy_dir / "apple_mps.json").write_text("{not json")
    with pytest.raises(ProfileError, match=r"apple_mps\.json is not JSON"):
        load_profiles(str(copy_dir))


def test_no_fallback_profile_is_an_error(copy_dir):
    os.remove(copy_dir / "laptop_cpu.json")
    with pytest.raises(ProfileError, match="no fallback profile"):
        load_profiles(str(copy_dir))


def test_duplicate_kind_is_an_error(copy_dir):
    _edit(copy_dir / "directml.json", lambda d: d.update(kind="cuda"))
    with pytest.raises(ProfileError, match="kind 'cuda' is also used by"):
        load_profiles(str(copy_dir))
