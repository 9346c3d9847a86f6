"""Property tests of the operator: random shapes, gates near 0 and near 1, padding patterns; the forms
agree with each other and with the float64 reference."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lion_fairseq.ops import lion_attention
from reference import fast_reference_attention


@st.composite
def problems(draw):
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    L = draw(st.integers(1, 40))
    Dk, Dv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2 ** 16))
    # log-gates from ~0 (gate near 1) to -30 (gate near 0), per token
    lo = draw(st.sampled_from([-1e-4, -0.1, -3.0, -30.0]))
    g = torch.Generator().manual_seed(seed)
    q, k = torch.rand(B, H, L, Dk, generator=g) + 0.01, torch.rand(B, H, L, Dk, generator=g) + 0.01
    v = torch.randn(B, H, L, Dv, generator=g)
    f = lo * torch.rand(B, H, L, generator=g)
    b = lo * torch.rand(B, H, L, generator=g)
    # each row padded on the left, the right, or not at all, keeping at least one real token
    mask = torch.zeros(B, L, dtype=torch.bool)
    for row in range(B):
        n_pad = draw(st.integers(0, L - 1))
        if draw(st.booleans()):
            mask[row, L - n_pad:] = True
        else:
            mask[row, :n_pad] = True
    return dict(q=q, k=k, v=v, f=f, b=b, mask=mask, chunk=draw(st.integers(1, 16)),
                causal=draw(st.booleans()), normalize=draw(st.booleans()))


@settings(max_examples=60, deadline=None, derandomize=True)  # the same problems on every run: CI reproducible
@given(problems())
def test_forms_agree_on_random_problems(p):
    ref = fast_reference_attention(p["q"], p["k"], p["v"], p["f"], p["b"], causal=p["causal"],
                                   normalize=p["normalize"], key_padding_mask=p["mask"])
    real = ~p["mask"][:, None, :, None]
    scale = ref.abs().max().clamp_min(1e-6)
    for form in ("parallel", "chunk", "recurrent"):
        y = lion_attention(p["q"], p["k"], p["v"], p["f"], p["b"], form=form, causal=p["causal"],
                           normalize=p["normalize"], key_padding_mask=p["mask"], chunk_size=p["chunk"])
        assert torch.isfinite(y).all(), form
        err = ((y.double() - ref).abs() * real).max() / scale
        assert err < 1e-4, (form, err.item())
