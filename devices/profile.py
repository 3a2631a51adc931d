"""Device profiles: JSON data files in `devices/profiles/`, each a recipe for one kind of machine.

A profile names what must be present (`match`), its `priority` among the
profiles that match, and the settings it chooses: backend, device, weights
(`quant`), KV dtype, threads policy, KV budget and block size, and the
onnxruntime execution providers to try. The file format is in docs/devices.md.
Adding a kind of machine is adding a file; nothing here names a profile.

This module only loads, validates and matches; the rules that adjust a profile
to the machine (battery, low memory, overrides) live in `devices.choice`.
"""
from __future__ import annotations

import json
import os

from devices.errors import DeviceError

PROFILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
BACKENDS = ("native", "llama.cpp", "onnxruntime")
KV_DTYPES = ("fp16", "bf16", "int8", "fp32")
QUANTS = ("gguf", "int4", "int8", "bf16", "fp32")
THREAD_POLICIES = ("physical", "half", "logical")
MATCH_KEYS = ("cuda", "mps", "ort_provider", "os", "machine")
REQUIRED = {"name": str, "kind": str, "description": str, "match": dict, "priority": int, "backend": str,
            "device": str, "quant": str, "kv_dtype": str, "threads": (str, int), "kv_budget_fraction": (int, float),
            "kv_budget_max_bytes": int, "block_size": int, "providers": list}
CPU_PROVIDER = "CPUExecutionProvider"


class ProfileError(DeviceError):
    """A profile file that is missing a key, holds a bad value or is not JSON."""


def load_profiles(directory: str | None = None) -> list[dict]:
    """Read and validate every `*.json` profile, highest priority first.

    Args:
        directory: where the files are (tests); default: the packaged `devices/profiles/`.
    Returns:
        the profiles as dicts (fresh copies: callers may change them).
    Raises:
        ProfileError naming the file and what is wrong with it.
    """
    directory = directory or PROFILES_DIR
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except OSError as e:
        raise ProfileError(f"cannot list profiles in {directory}: {e.strerror}") from None
    profiles, seen = [], {}
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                profile = json.load(f)
        except OSError as e:
            raise ProfileError(f"cannot read profile {path}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProfileError(f"profile {path} is not JSON: {e}") from None
        validate_profile(profile, path)
        for key in ("name", "kind"):
            other = seen.get((key, profile[key]))
            if other:
                raise ProfileError(f"profile {path}: {key} {profile[key]!r} is also used by {other}")
            seen[(key, profile[key])] = path
        profiles.append(profile)
    if not any(not p["match"] for p in profiles):
        raise ProfileError(f"no fallback profile in {directory}: one profile needs an empty match ({{}})")
    profiles.sort(key=lambda p: (-p["priority"], p["name"]))
    return profiles


def validate_profile(profile, path: str) -> None:
    """Raise ProfileError naming `path` and the first missing key or bad value."""
    if not isinstance(profile, dict):
        raise ProfileError(f"profile {path} must hold a JSON object, not {type(profile).__name__}")
    for key, kind in REQUIRED.items():
        if key not in profile:
            raise ProfileError(f"profile {path} is missing the key {key!r}")
        if not isinstance(profile[key], kind) or isinstance(profile[key], bool):
            raise ProfileError(f"profile {path}: {key!r} has the wrong type ({type(profile[key]).__name__})")
    stem = os.path.splitext(os.path.basename(path))[0]
    if profile["name"] != stem:
        raise ProfileError(f"profile {path}: name {profile['name']!r} must match the file name {stem!r}")
    _check_choice(profile, path, "backend", BACKENDS)
    _check_choice(profile, path, "kv_dtype", KV_DTYPES)
    _check_choice(profile, path, "quant", QUANTS)
    threads = profile["threads"]
    if isinstance(threads, str) and threads not in THREAD_POLICIES or isinstance(threads, int) and threads < 1:
        raise ProfileError(f"profile {path}: threads {threads!r} must be a positive count or one of "
                           f"{', '.join(THREAD_POLICIES)}")
    if not 0 < profile["kv_budget_fraction"] <= 1:
        raise ProfileError(f"profile {path}: kv_budget_fraction {profile['kv_budget_fraction']} must be in (0, 1]")
    if profile["kv_budget_max_bytes"] <= 0:
        raise ProfileError(f"profile {path}: kv_budget_max_bytes must be positive")
    if not 1 <= profile["block_size"] <= 1024:
        raise ProfileError(f"profile {path}: block_size {profile['block_size']} must be in [1, 1024]")
    providers = profile["providers"]
    if not providers or not all(isinstance(p, str) for p in providers) or providers[-1] != CPU_PROVIDER:
        raise ProfileError(f"profile {path}: providers must be a list of names ending in {CPU_PROVIDER!r}")
    unknown = sorted(set(profile["match"]) - set(MATCH_KEYS))
    if unknown:
        raise ProfileError(f"profile {path}: unknown match key(s) {', '.join(unknown)}; "
                           f"known: {', '.join(MATCH_KEYS)}")
    options = profile.get("provider_options", {})
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ProfileError(f"profile {path}: provider_options must map a provider name to an object of options")


def _check_choice(profile: dict, path: str, key: str, allowed: tuple) -> None:
    if profile[key] not in allowed:
        raise ProfileError(f"profile {path}: {key} {profile[key]!r} must be one of {', '.join(allowed)}")


def mismatch(profile: dict, found: dict) -> str | None:
    """None when everything the profile's `match` asks for is in `found`; else why not, in words."""
    m = profile["match"]
    if m.get("cuda") and not found.get("cuda"):
        return "no CUDA GPU"
    if m.get("mps") and not found.get("mps"):
        return "no Apple MPS GPU"
    if "ort_provider" in m:
        if not found.get("onnxruntime"):
            return "onnxruntime not installed"
        if m["ort_provider"] not in found["onnxruntime"].get("providers", []):
            return f"no {m['ort_provider']} in onnxruntime"
    for key in ("os", "machine"):
        if key in m and m[key] != found.get(key):
            return f"needs {key} {m[key]}, this is {found.get(key)}"
    return None
