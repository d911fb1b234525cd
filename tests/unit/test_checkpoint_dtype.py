"""checkpoint.stream refuses an integer tensor for a floating-point parameter (it used to cast it silently)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.stream import file_entries, parameters_on_meta, stream_into


def _load(tmp_path, weight: torch.Tensor) -> nn.Linear:
    path = tmp_path / "model.safetensors"
    save_file({"weight": weight, "bias": torch.zeros(2)}, str(path))
    with parameters_on_meta():
        module = nn.Linear(3, 2)
    return stream_into(module, file_entries(path, torch.device("cpu")), "cpu", what="test", where=str(path))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_integer_tensor_for_a_float_parameter_is_refused(tmp_path, dtype):
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path, torch.ones(2, 3, dtype=dtype))
    assert str(info.value).startswith(f"{tmp_path / 'model.safetensors'}: tensor 'weight' is stored as {dtype}")


def test_float_tensors_of_another_precision_are_still_cast(tmp_path):
    module = _load(tmp_path, torch.full((2, 3), 0.5, dtype=torch.bfloat16))
    assert module.weight.dtype == torch.float32 and module.weight[0, 0].item() == 0.5
