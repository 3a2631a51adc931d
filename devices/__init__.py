"""What this machine has and what to run on it: detection, profiles (data files) and the choice between them.

`detect()` probes the CPU, memory, battery, CUDA / MPS GPUs and onnxruntime's
execution providers; `choose(found)` picks a profile from `devices/profiles/*.json`
and adjusts it to the machine (backend, device, weights, KV dtype and budget,
threads, providers), with one reason per decision. This package knows nothing
of models or of `edge_runtime`: it imports torch, psutil and onnxruntime only
inside guarded probes.
"""
from devices.choice import Choice, choose
from devices.detection import detect
from devices.errors import DeviceError
from devices.profile import ProfileError, load_profiles

__all__ = ["Choice", "DeviceError", "ProfileError", "choose", "detect", "load_profiles"]
