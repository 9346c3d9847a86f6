"""The LION operator in pure PyTorch (no fairseq import): parallel, chunkwise and recurrent forms."""
from .attention import FORMS, lion_attention
from .recurrent import causal_state, lion_step

__all__ = ["FORMS", "causal_state", "lion_attention", "lion_step"]
