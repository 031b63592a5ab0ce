"""loraplex.v1.Tensor round trips and refusals."""
import numpy as np
import pytest
import torch

from loraplex.errors import InvalidArgumentError
from loraplex.formats.tensors import NPY_BFLOAT16, torch_to_numpy
from loraplex.tensor_proto import tensor_from_proto, tensor_to_proto
from loraplex.v1 import common_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_round_trip_keeps_dtype_shape_and_values(dtype):
    shape = tuple(int(d) for d in np.random.randint(1, 7, size=3))
    x = (torch.randn(shape) * 100).to(dtype)
    msg = tensor_to_proto(x)
    assert list(msg.shape) == list(shape) and len(msg.data) == x.numel() * x.element_size()
    y = tensor_from_proto(msg)
    assert y.dtype == dtype and torch.equal(y, x)


def test_numpy_inputs_including_bf16_as_raw_v2():
    x = torch.randn(3, 5).to(torch.bfloat16)
    raw = torch_to_numpy(x)
    assert raw.dtype == NPY_BFLOAT16
    assert torch.equal(tensor_from_proto(tensor_to_proto(raw)), x)
    f64 = np.random.rand(2, 3)
    back = tensor_from_proto(tensor_to_proto(f64))
    assert back.dtype == torch.float32 and np.allclose(back.numpy(), f64, atol=1e-6)


def test_malformed_tensors_name_the_problem():
    with pytest.raises(InvalidArgumentError, match="needs 24 bytes"):
        tensor_from_proto(common_pb2.Tensor(dtype=common_pb2.FLOAT32, shape=[2, 3], data=b"\0" * 20), "weights")
    with pytest.raises(InvalidArgumentError, match="dtype is unset"):
        tensor_from_proto(common_pb2.Tensor(shape=[1], data=b"\0" * 4), "config")
    with pytest.raises(InvalidArgumentError, match="negative"):
        tensor_from_proto(common_pb2.Tensor(dtype=common_pb2.INT32, shape=[-1], data=b""), "config")
    with pytest.raises(TypeError):
        tensor_to_proto(torch.zeros(2, dtype=torch.uint8))
