"""The fake NVML must look like pynvml: same function names, same parameters, same errors."""

from __future__ import annotations

import inspect

import pynvml
import pytest

from tests.nvml.fake_nvml import FakeNvml

MODELLED = sorted(n for n in vars(FakeNvml) if n.startswith("nvml"))


def test_fake_models_the_calls_the_exporter_makes() -> None:
    assert len(MODELLED) >= 25


@pytest.mark.parametrize("name", MODELLED)
def test_every_fake_call_matches_pynvml_signature(name: str) -> None:
    real = getattr(pynvml, name)
    fake_params = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]  # drop self
    assert fake_params == list(inspect.signature(real).parameters), name


def test_fake_raises_pynvml_error_classes() -> None:
    nv = FakeNvml()
    nv.nvmlInit()
    nv.gpus[0].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetPowerUsage(nv.gpus[0].handle)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait(nv.nvmlEventSetCreate(), 1)


def test_unmodelled_calls_are_absent_not_silently_faked() -> None:
    nv = FakeNvml()
    assert nv.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(AttributeError):
        nv.nvmlDeviceGetFanSpeed  # noqa: B018 (the attribute access is the test)
