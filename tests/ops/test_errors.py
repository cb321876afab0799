"""Bad arguments raise TypeError/ValueError naming the argument; never a crash."""

import os
import subprocess
import sys

import pytest
import torch

from pagoda import ops


def test_wrong_dtype():
    with pytest.raises(TypeError, match="input must be float32, bfloat16 or float16"):
        ops.rms_norm(torch.ones(2, 4, dtype=torch.int32), torch.ones(4, dtype=torch.int32), 1e-6)


def test_mixed_dtypes():
    with pytest.raises(TypeError, match="weight has dtype"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.bfloat16), 1e-6)


def test_weight_shape():
    with pytest.raises(ValueError, match="weight must be a contiguous 1-D tensor of the hidden size 4"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6)


def test_out_shape():
    with pytest.raises(ValueError, match="out has shape"):
        torch.ops.pagoda.rms_norm(torch.empty(3, 4), torch.ones(2, 4), torch.ones(4), 1e-6)


def test_residual_shape():
    with pytest.raises(ValueError, match="residual has shape"):
        ops.fused_add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-6)


def test_last_dim_not_contiguous():
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        ops.rms_norm(torch.ones(4, 2).t(), torch.ones(4), 1e-6)


def test_leading_dims_do_not_collapse():
    x = torch.ones(3, 4, 8)[:, :2, :]
    with pytest.raises(ValueError, match="cannot be viewed as one row dimension"):
        ops.rms_norm(x, torch.ones(8), 1e-6, out=torch.empty(3, 2, 8))


def test_silu_odd_width():
    with pytest.raises(ValueError, match="must be even"):
        torch.ops.pagoda.silu_and_mul(torch.empty(2, 2), torch.ones(2, 5))


def test_silu_out_shape():
    with pytest.raises(ValueError, match="last dimension halved"):
        torch.ops.pagoda.silu_and_mul(torch.empty(2, 4), torch.ones(2, 4))


def test_rotary_position_out_of_range():
    cache = ops.rotary_cos_sin_cache(8, 16)
    with pytest.raises(ValueError, match=r"positions\[1\] = 16 is outside"):
        ops.rotary_embedding(torch.tensor([0, 16]), torch.ones(2, 8), None, 8, cache, True)


def test_rotary_negative_position():
    cache = ops.rotary_cos_sin_cache(8, 16)
    with pytest.raises(ValueError, match="outside"):
        ops.rotary_embedding(torch.tensor([-1]), torch.ones(1, 8), None, 8, cache, True)


def test_rotary_positions_dtype():
    cache = ops.rotary_cos_sin_cache(8, 16)
    with pytest.raises(TypeError, match="positions must be int64"):
        ops.rotary_embedding(torch.tensor([0], dtype=torch.int32), torch.ones(1, 8), None, 8, cache, True)


def test_rotary_rot_dim_too_large():
    cache = ops.rotary_cos_sin_cache(16, 16)
    with pytest.raises(ValueError, match="rot_dim"):
        ops.rotary_embedding(torch.tensor([0]), torch.ones(1, 8), None, 8, cache, True)


def test_rotary_head_size_mismatch():
    cache = ops.rotary_cos_sin_cache(8, 16)
    with pytest.raises(ValueError, match="not a multiple of head_size"):
        ops.rotary_embedding(torch.tensor([0]), torch.ones(1, 12), None, 8, cache, True)


def test_rotary_token_count_mismatch():
    cache = ops.rotary_cos_sin_cache(8, 16)
    with pytest.raises(ValueError, match="tokens but positions has"):
        ops.rotary_embedding(torch.tensor([0, 1]), torch.ones(3, 8), torch.ones(2, 8), 8, cache, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_device_mismatch():
    with pytest.raises(ValueError, match="one device"):
        ops.rms_norm(torch.ones(2, 4, device="cuda"), torch.ones(4), 1e-6)


def test_meta_tensors_trace_without_computing():
    x = torch.empty(2, 8, device="meta")
    ops.rms_norm(x, torch.empty(8, device="meta"), 1e-6)
    assert ops.silu_and_mul(x).shape == (2, 4)


@pytest.mark.parametrize(
    "op,args",
    [
        ("rms_norm", lambda: (torch.empty(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6)),
        ("fused_add_rms_norm", lambda: (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6)),
        ("silu_and_mul", lambda: (torch.empty(3, 8), torch.randn(3, 16))),
        (
            "rotary_embedding",
            lambda: (torch.tensor([0, 3, 5]), torch.randn(3, 32), torch.randn(3, 16), 16, ops.rotary_cos_sin_cache(16, 8), True),
        ),
    ],
)
def test_opcheck(op, args):
    """Schemas, mutation annotations and Meta kernels agree (torch.compile-safe)."""
    torch.library.opcheck(getattr(torch.ops.pagoda, op).default, args())


def test_unknown_isa_is_a_value_error():
    with pytest.raises(ValueError, match="not compiled into this build"):
        ops._C.select_cpu_isa("avx9000")


def test_environment_forces_unusable_isa_clearly():
    env = dict(os.environ, PAGODA_CPU_ISA="sse2")
    result = subprocess.run([sys.executable, "-c", "import pagoda.ops"], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "PAGODA_CPU_ISA=sse2 is not compiled into this build" in result.stderr

