"""The LION operator, with no fairseq import: the parallel, chunkwise and recurrent forms and the one-token
step in PyTorch (the reference and the CPU path), and the GPU kernels the chunk form runs on (LION's own in
``kernel.py``, fla's in ``fla.py``; ``backend.py`` picks one)."""
from .attention import FORMS, is_chunk_size, lion_attention
from .blockwise import block_attention, state_after, state_before
from .memory import memory_state, read_memory
from .recurrent import causal_state, lion_step
from .workspace import release_workspace

__all__ = ["FORMS", "block_attention", "causal_state", "is_chunk_size", "lion_attention", "lion_step", "memory_state",
           "read_memory", "release_workspace", "state_after", "state_before"]
