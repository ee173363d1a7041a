"""hybridgen.eval.fidelity: top-1 agreement and KL(ref || method)."""
import math

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.eval.fidelity import fidelity, kl_per_position


def test_identical_logits_agree_fully_with_zero_kl():
    x = torch.randn(2, 5, 11)
    f = fidelity(x, x.clone())
    assert f["top1_agreement"] == 1.0 and f["mean_kl"] < 1e-12 and f["positions"] == 10


def test_kl_matches_hand_computation_and_top1_counts():
    ref = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    out = torch.tensor([[[0.0, 2.0, 0.0], [0.0, 1.0, 0.5]]])
    p = torch.softmax(ref.double(), -1)
    q = torch.softmax(out.double(), -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(kl_per_position(ref, out), kl)
    f = fidelity(ref, out)
    assert f["top1_agreement"] == 0.5
    assert math.isclose(f["mean_kl"], float(kl.mean()), rel_tol=1e-12)
    assert f["max_kl"] == pytest.approx(float(kl.max()))
    g = fidelity(ref, out, mask=torch.tensor([[False, True]]))
    assert g["top1_agreement"] == 1.0 and g["positions"] == 1


def test_shape_mismatch_is_a_config_error():
    with pytest.raises(ConfigError):
        fidelity(torch.zeros(1, 2, 3), torch.zeros(1, 3, 3))
