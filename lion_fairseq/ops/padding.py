"""Key padding as every op takes it: a bool ``(B, L)`` mask, True at padding, whose keys and values add
nothing to any score or state."""
from typing import Optional, Tuple

import torch
from torch import Tensor


def bool_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """A key padding mask as bool, True at padding: an integer one (older fairseq's byte masks) is nonzero
    there. A float mask may be additive (-inf at padding) and is refused."""
    if key_padding_mask.dtype == torch.bool:
        return key_padding_mask
    if key_padding_mask.is_floating_point() or key_padding_mask.is_complex():
        raise ValueError(f"key_padding_mask must be a bool tensor, True at padding; got {key_padding_mask.dtype}")
    return key_padding_mask != 0


def checked_padding_mask(key_padding_mask: Tensor, B: int, L: int) -> Tensor:
    """``key_padding_mask`` as bool, refused unless it is ``(B, L)``."""
    if key_padding_mask.shape != (B, L):
        raise ValueError(f"key_padding_mask must be a bool tensor of shape (B, L) = {(B, L)}; "
                         f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
    return bool_padding_mask(key_padding_mask)


def mask_padded_keys(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Zero the keys and values at padding (``key_padding_mask`` ``(B, L)``, True there): they then add
    nothing to any state or score. k: ``(B, H, L, Dk)``, v: ``(B, H, L, Dv)``."""
    if key_padding_mask is None:
        return k, v
    pad = key_padding_mask[:, None, :, None]
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
