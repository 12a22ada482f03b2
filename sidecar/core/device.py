"""Where the KV lives: choosing the device an engine (and so every check) runs on.

The checks run on the tensor's own device and bring back only verdict scalars; nothing in the
sidecar picks a device by itself. Only the reference engine and the device check script ask
for one by name, and asking for CUDA on a machine without it is a clear error, not a silent
fall back to CPU (a GPU measurement taken on the CPU would be a lie).
"""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


class DeviceUnavailable(ValueError):
    """The device asked for does not exist on this machine."""


def resolve_device(name: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a :class:`torch.device`, checked to exist."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceUnavailable(f"unknown device {name!r}; use one of: "
                                f"{', '.join(DEVICES)}") from None
    if device.type not in DEVICES:
        raise DeviceUnavailable(f"unsupported device {name!r}; use one of: {', '.join(DEVICES)}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"--device {name}: no CUDA device on this machine (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda or 'none'}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"--device {name}: only {torch.cuda.device_count()} CUDA "
                                    "device(s) on this machine")
    return device
