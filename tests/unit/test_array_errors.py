"""A collective given something that is not a tensor says which argument, what it got, and
what it accepts (the message a user sees from ``hvd.allreduce("x")``)."""

import numpy as np
import pytest
import torch

from mpitrain.collectives import arrays


def test_non_tensor_names_the_argument_and_the_value():
    with pytest.raises(TypeError, match=r"^tensors\[1\] must be a torch.Tensor, numpy.ndarray "
                                        r"or CUDA array \(cupy\), got str 'x'$"):
        arrays.check_tensor("x", "tensors[1]")
    with pytest.raises(TypeError, match=r"^tensor must be .* got NoneType None$"):
        arrays.check_tensor(None)


def test_unsupported_dtype_names_the_argument():
    with pytest.raises(TypeError, match=r"^tensor has unsupported dtype torch.complex64"):
        arrays.check_tensor(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"^tensors\[0\] has unsupported dtype <U1"):
        arrays.check_tensor(np.array(["a"]), "tensors[0]")
