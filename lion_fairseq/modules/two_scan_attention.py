"""LionTwoScanAttention: LION attention over a 2-D grid read in two snake orders, masks averaged.

LION's "natural" image models (LION-D/S with two scans) read the pixels (or patches) of an image in a
row-wise snake and in a column-wise snake; each scan has its own decay gates, so each gives its own
decay mask in grid coordinates, ``M_row`` and ``M_col``. Attention uses their average:

    A = (q k^T) * (M_row + M_col) / 2,      y_i = sum_j A_ij v_j / (sum_j A_ij + eps)

Because ``A`` is linear in the mask, each scan runs the ordinary operator (any form: parallel, chunk
or recurrent) without normalisation on ``[v, 1]`` in its own order, giving the numerator and the row
sum of its half; both are put back in grid order, added, and divided. Queries, keys and values are
shared; only the gates differ per scan. Nothing here changes ``lion_fairseq.ops``.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..lra.ordering import inverse, ordering
from ..ops import lion_attention
from .lion_attention import LionAttention, checked_input, float32_linear

SCANS = ("row_snake", "col_snake")


class LionTwoScanAttention(LionAttention):
    """``forward(x)``: ``x`` ``(T, B, C)`` with ``T = height * width`` tokens in row-major grid order ->
    ``(T, B, C)`` in the same order. The row scan uses the parent's gates (``gate_logit`` for ``d``,
    ``gate_proj`` for ``s``); the column scan has its own (``col_gate_logit`` / ``col_gate_proj``)."""

    streams_blockwise = False  # blockwise inference knows one ordering of the tokens, not two

    def __init__(self, embed_dim: int, num_heads: int, variant: str = "s", *, height: int, width: int, **kwargs):
        if kwargs.get("causal"):
            raise ValueError("two-scan attention is bidirectional; causal=True makes no sense here")
        if kwargs.get("short_conv"):
            raise ValueError("--lion-short-conv convolves along one token order; two-scan attention (the image "
                             "tasks' row and column scans) has two: leave it off (0) for this model")
        super().__init__(embed_dim, num_heads, variant, **kwargs)
        self.height, self.width = height, width
        perms = torch.stack([ordering(s, height, width) for s in SCANS])
        self.register_buffer("perms", perms, persistent=False)  # (2, T): scan position -> grid index
        self.register_buffer("inverses", torch.stack([inverse(p) for p in perms]), persistent=False)
        if variant == "d":
            self.col_gate_logit = nn.Parameter(torch.randn(num_heads))
        elif variant == "s":
            self.col_gate_proj = nn.Linear(embed_dim, num_heads)

    def _scan_log_gates(self, x: Tensor, scan: int) -> Optional[Tensor]:
        """``log lambda`` of scan ``scan`` (0 rows, 1 columns) for ``x`` ``(T, B, C)`` already in that
        scan's order: ``(B, H, T)`` for ``s``, ``(H, 1)`` for ``d``, None for ``lit``."""
        if scan == 0 or self.variant == "lit":
            return self.log_gates(x)
        if self.variant == "d":
            return F.logsigmoid(self.col_gate_logit.float())[:, None] / self.gate_temperature
        return (F.logsigmoid(float32_linear(self.col_gate_proj, x)) / self.gate_temperature).permute(1, 2, 0)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[dict] = None) -> Tensor:
        """x: ``(T, B, C)`` row-major; key_padding_mask: ``(B, T)`` bool, True at padding. Returns
        ``(T, B, C)``."""
        if incremental_state is not None:
            raise ValueError("two-scan attention is bidirectional: it has no incremental decoding")
        key_padding_mask = checked_input(x, key_padding_mask, self.embed_dim)
        T = x.shape[0]
        if T != self.height * self.width:
            raise ValueError(f"two-scan attention was built for a {self.height}x{self.width} grid "
                             f"({self.height * self.width} tokens); got {T} tokens")
        q = self.phi(self._heads(self.q_proj(x)))
        k, v = self._keys_values(x)
        v = v.to(torch.promote_types(v.dtype, torch.float32))  # sums of both halves in float32 at least
        if self.normalize:  # the row sums ride along as a column of ones
            v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
        total = None
        for scan in range(len(SCANS)):
            perm, inv = self.perms[scan], self.inverses[scan]
            fwd, bwd = self._directional_gates(self._scan_log_gates(x[perm], scan))
            mask = key_padding_mask[:, perm] if key_padding_mask is not None else None
            out = lion_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], fwd, bwd, form=self.form,
                                 normalize=False, key_padding_mask=mask, chunk_size=self.chunk_size)
            out = out[:, :, inv]
            total = out if total is None else total + out
        total = total / len(SCANS)  # the average of the two masks
        y = total[..., :-1] / (total[..., -1:] + self.eps) if self.normalize else total
        return self._output(y, x)
