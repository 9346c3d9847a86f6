"""CPU buffers the chunk form reuses instead of allocating afresh, one set per thread.

On a CPU a new large tensor costs a page fault per 4 KiB page on first touch (glibc maps every allocation
above its mmap threshold anew and unmaps it on free), which costs more than the arithmetic done in it:
with the threshold lifted (``MALLOC_MMAP_THRESHOLD_``), a training step of the chunk form at L = 16384
took about 30% less time. PyTorch's CPU allocator caches
nothing, so the op keeps its own buffers:

- ``workspace(name, ...)``: a named buffer for what never leaves one call (a block's temporaries, the
  states' contributions, the backward pass's state gradients), reused by the next call;
- ``workspace.kept(..., owner)``: a buffer for what the forward pass keeps for the backward pass, reserved
  for as long as its owner lives (the autograd node that saved it: the graph that can still run its
  backward), handed out again once the owner is gone. Who else holds the buffer is not asked: a
  saved-tensor hook may keep it through its storage alone, which no use count sees.

On CUDA, whose caching allocator already reuses memory, every call allocates. ``release()`` frees the
calling thread's buffers."""
import math
import threading
import weakref
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

# The largest named buffer kept between calls, and the most the kept buffers hold together; beyond
# either, the call allocates for itself.
NAMED_MAX_BYTES = 256 << 20
KEPT_MAX_BYTES = 2 << 30


def _bytes(n: int, dtype: torch.dtype) -> int:
    return n * (torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits) // 8


class Workspace(threading.local):
    def __init__(self) -> None:
        self.named: Dict[Tuple[str, torch.dtype], Tensor] = {}
        self.kept_bufs: List[List[Any]] = []  # [buffer, weak reference to its owner]

    def __call__(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A ``shape`` view of the buffer ``name``: valid until the next request of that name in this
        thread, so only for what does not outlive the call."""
        n = math.prod(shape)
        if device.type != "cpu" or _bytes(n, dtype) > NAMED_MAX_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = self.named.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.named[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)

    def kept(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, owner: Any) -> Tensor:
        """A ``shape`` tensor that may outlive the call (saved for backward by ``owner``, which must take
        weak references: an autograd ``ctx``): the smallest buffer that fits and whose owner is gone, else
        a new one."""
        n = math.prod(shape)
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        best = None
        for entry in self.kept_bufs:
            buf, ref = entry
            if buf.dtype == dtype and buf.numel() >= n and ref() is None:
                if best is None or buf.numel() < best[0].numel():
                    best = entry
        if best is None:
            if sum(_bytes(b.numel(), b.dtype) for b, _ in self.kept_bufs) + _bytes(n, dtype) > KEPT_MAX_BYTES:
                return torch.empty(shape, dtype=dtype)
            best = [torch.empty(n, dtype=dtype), None]
            self.kept_bufs.append(best)
        best[1] = weakref.ref(owner)  # set before anyone reads it: the owner is alive now
        return best[0][:n].view(shape)

    def release(self) -> None:
        """Forget this thread's buffers (those still in use live on with their users)."""
        self.named.clear()
        self.kept_bufs.clear()


workspace = Workspace()


def release_workspace() -> None:
    """Free the chunk form's reused CPU buffers of the calling thread (made again when next needed)."""
    workspace.release()
