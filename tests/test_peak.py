"""The datasheet peaks MFU is measured against, by jax's exact device_kind strings."""
from types import SimpleNamespace

import pytest

from run.metrics import peak_flops

# dense bf16 TFLOP/s from each vendor's datasheet (sparsity's doubled figures halved)
DATASHEET = {
    "NVIDIA H100 80GB HBM3": 989,  # SXM5
    "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835,
    "NVIDIA H200": 989,
    "NVIDIA A100-SXM4-40GB": 312, "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-PCIE-40GB": 312, "NVIDIA A100 80GB PCIe": 312,
    "NVIDIA L4": 121,
    "TPU v4": 275,
    "TPU v5 lite": 197, "TPU v5e": 197,
    "TPU v5": 459, "TPU v5p": 459,
    "TPU v6 lite": 918, "TPU v6e": 918,
}
# kinds whose name contains a listed one but whose peak differs or is not known: no MFU
UNKNOWN = ["cpu", "NVIDIA H100", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "TPU v4 lite",
           "NVIDIA A100 40GB PCIe MIG 1g.5gb", "TPU v5 litepod", "NVIDIA L40S", "TPU v6"]


@pytest.mark.parametrize("kind", DATASHEET)
def test_each_device_kind_has_its_datasheet_peak(kind):
    assert peak_flops(SimpleNamespace(device_kind=kind)) == DATASHEET[kind] * 1e12


@pytest.mark.parametrize("kind", UNKNOWN)
def test_an_unknown_kind_has_no_peak_rather_than_a_near_one(kind):
    assert peak_flops(SimpleNamespace(device_kind=kind)) is None
