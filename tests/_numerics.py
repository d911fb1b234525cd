"""The one error measure of the numerical tests: the relative error of the whole tensor, ||ours - ref|| / ||ref||.

Every parity, kernel and render test compares by this ratio (the style of fla `fla/utils/_testing.py`
`assert_close`), not element by element: a bf16 kernel is off by a few ulps everywhere, a wrong one by a lot in some
places, and the norm ratio tells those apart at any size. Element-wise checks (`torch.testing.assert_close`) stay
where a test means exactly that.
"""

from __future__ import annotations

import torch


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref||_2 / ||ref||_2 over all elements, computed in float64 (so fp32 inputs lose nothing).

    Args:
        ours, ref: tensors of one shape, any float dtype and device.

    Returns:
        The ratio; nan when either holds a nan (so `assert err <= tol` fails), inf when `ref` is all zeros and
        `ours` is not.
    """
    ours, ref = ours.detach().double(), ref.detach().double()  # a parameter or an autograd output may come in
    return float((ours - ref).norm() / ref.norm())


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol_err: float, what: str = "") -> float:
    """Assert `rel_err(ours, ref) <= rtol_err` (shapes equal first), print the error, and return it.

    Args:
        ours, ref: tensors of one shape.
        rtol_err: largest accepted norm ratio (the test's tolerance, e.g. 1e-5 in fp32, 1e-2 in bf16).
        what: label for the printed line and the failure message.

    Raises:
        AssertionError: other shapes, or an error above `rtol_err` (nan included), naming `what`.
    """
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(ours, ref)
    print(f"{what}: rel. err {err:.2e} (tolerance {rtol_err:.0e})")
    assert err <= rtol_err, f"{what}: rel. err {err:.3e} > {rtol_err:.0e}"
    return err


@torch.no_grad()
def randomize_vae_(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter of a (tiny) video VAE drawn at O(1) scale, in place: matrices ~ N(0, 1/fan_in), norm weights
    1 + N(0, 0.01), everything else (biases, the residual gains the release initializes to zero, which would make
    each block the identity) N(0, 0.09). Draws from torch's global generator, in `named_parameters` order."""
    for name, p in module.named_parameters():
        if p.ndim > 1:
            p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
        elif "norm" in name:
            p.copy_(1 + 0.1 * torch.randn_like(p))
        else:
            p.copy_(0.3 * torch.randn_like(p))
    return module
