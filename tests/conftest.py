import pytest
import torch

from sidecar.core.monitor import Monitor, SidecarConfig
from tests.limits import DETECTION_TIMEOUT_S
from tests.toy import ToyAdapter, ToyEngine


def make_toy(dtype: torch.dtype = torch.float32, **config) -> tuple[ToyEngine, ToyAdapter,
                                                                      Monitor]:
    engine = ToyEngine(sink=None, dtype=dtype)
    adapter = ToyAdapter(engine)
    cfg = SidecarConfig(**{"sample_every": 1, "adapter_timeout_s": DETECTION_TIMEOUT_S, **config})
    monitor = Monitor(adapter, cfg)
    engine.sink = monitor
    return engine, adapter, monitor


@pytest.fixture
def toy():
    engine, adapter, monitor = make_toy()
    yield engine, adapter, monitor
    monitor.stop()
