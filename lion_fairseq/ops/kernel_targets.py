"""LION's Triton kernels (the attention's and LION-D/S's feature map's) compiled ahead of time for GPU
targets, on a machine without a GPU:

    python -m lion_fairseq.ops.kernel_targets [--arch 90 80] [--head-dims 32 64 128] [--dtypes bfloat16 float32]

Triton's CPU interpreter runs the kernel's arithmetic but never compiles it, so a construct that only the
GPU compiler refuses (a dtype a ``tl.dot`` does not take, float64 cumulative sums, a layout conversion)
would first fail on a lent GPU. This runs the kernel's host code on small CPU tensors with every launch
recorded instead of run, then compiles each recorded launch with Triton's own compiler and ptxas for the
given compute capabilities (90: H100/H200, 80: A100), and reads each binary's registers, stack (spilled
registers) and shared memory with ``cuobjdump``, and from Triton's GPU IR whether a kernel transposes a
tensor-core result (which Triton miscompiled on Hopper: fla #640). What it cannot show: speed, and values
(the tests check those under the interpreter).

Needs Triton with its NVIDIA backend (CUDA builds of PyTorch ship it) and ``TRITON_INTERPRET`` unset."""
import argparse
import functools
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Iterator, List, Optional

import torch

LAUNCHED = ("_segment_sums", "_forward_walk", "_backward_walk", "_global_apply", "_row_grads")
FEATURE_MAP_LAUNCHED = ("_silu_norm_forward", "_silu_norm_backward")  # in ops/feature_kernel.py
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8"}
# the calls of every code path: (label, gates f and b as "token"/"head"/None, causal, padded)
CASES = [("lit", None, None, False, False), ("lit-causal", None, None, True, False),
         ("d", "head", "head", False, True), ("s", "token", "token", False, True),
         ("s-causal", "token", None, True, False)]


@dataclass
class Launch:
    kernel: str
    signature: Dict[str, str]
    constexprs: Dict[str, object]
    num_warps: int
    num_stages: int = 3
    grid: tuple = ()  # how many programs, along each axis (not part of the compiled kernel's key)

    def key(self) -> tuple:
        return (self.kernel, tuple(sorted(self.signature.items())), tuple(sorted(
            (k, str(v)) for k, v in self.constexprs.items())), self.num_warps, self.num_stages)


def _constexpr_names(fn) -> set:
    """The ``tl.constexpr`` parameters of a ``@triton.jit`` function, compiled or (``TRITON_INTERPRET=1``)
    interpreted."""
    import triton.language as tl

    if hasattr(fn, "params"):
        return {p.name for p in fn.params if p.is_constexpr}
    return {name for name, p in inspect.signature(fn.fn).parameters.items() if p.annotation is tl.constexpr}


class _Recorder:
    """Stands in for one ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn, launches: List[Launch]):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return functools.partial(self._record, grid)

    def _record(self, grid, *args, num_warps: int = 4, num_stages: int = 3, **kwargs) -> None:
        names = self.fn.arg_names
        values = dict(zip(names, args), **kwargs)
        constexpr = _constexpr_names(self.fn)
        signature, constexprs = {}, {}
        for name in names:
            value = values[name]
            if name in constexpr:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = POINTER[value.dtype]
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                signature[name] = "i32" if -2 ** 31 <= int(value) < 2 ** 31 else "i64"
        self.launches.append(Launch(self.fn.__name__, signature, constexprs, num_warps, num_stages, tuple(grid)))


@contextmanager
def recorded(kernel_module: ModuleType, names: tuple = LAUNCHED) -> Iterator[List[Launch]]:
    """Inside the block, the module's kernels ``names`` record their launches into the yielded list."""
    launches: List[Launch] = []
    saved = {name: getattr(kernel_module, name) for name in names}
    for name, fn in saved.items():
        setattr(kernel_module, name, _Recorder(fn, launches))
    try:
        yield launches
    finally:
        for name, fn in saved.items():
            setattr(kernel_module, name, fn)


def launches_of(head_dim: int, dtype: torch.dtype, cases: Optional[List[str]] = None,
                tf32: bool = False) -> List[Launch]:
    """Every distinct launch of the forward and backward of each case in ``CASES`` (those labelled in
    ``cases``, default all) at head size ``head_dim`` (inputs in ``dtype``), with more than one segment so
    that the segment passes run too, and the two of LION-D/S's feature map (``feature_kernel``). ``tf32``:
    float32 products as on CUDA with ``torch.backends.cuda.matmul.allow_tf32`` (else three TF32 products
    each, as with TF32 off)."""
    from . import kernel

    B, H, L = 1, 2, 200
    out: Dict[tuple, Launch] = {}
    for label, f_kind, b_kind, causal, padded in CASES:
        if cases is not None and label not in cases:
            continue
        q, k, v = (torch.randn(B, H, L, head_dim).to(dtype).requires_grad_() for _ in range(3))
        gate = {"token": lambda: -torch.rand(B, H, L), "head": lambda: -torch.rand(1, H, 1), None: lambda: None}
        f, b = gate[f_kind](), gate[b_kind]()
        for g in (f, b):
            if g is not None:
                g.requires_grad_()
        pad = torch.zeros(B, L, dtype=torch.bool) if padded else None
        if pad is not None:
            pad[:, -3:] = True
        with recorded(kernel) as launches:
            y = kernel.kernel_attention(q, k, v, f, b, causal, True, pad, 1e-6, chunk_size=64, segment_chunks=2)
            y.backward(torch.ones_like(y))
        for launch in launches:
            if tf32 and "PREC" in launch.constexprs:
                launch.constexprs["PREC"] = "tf32"
            out.setdefault(launch.key(), launch)
    from . import feature_kernel

    x = torch.randn(B, H, L, head_dim).to(dtype).requires_grad_()
    with recorded(feature_kernel, FEATURE_MAP_LAUNCHED) as launches:  # LION-D/S's feature map
        feature_kernel.silu_norm_kernel(x).backward(torch.ones_like(x))
    out.update((launch.key(), launch) for launch in launches)
    return list(out.values())


def resources(cubin: bytes) -> Dict[str, int]:
    """{"registers", "stack"} of a cubin, from ``cuobjdump --dump-resource-usage``."""
    from triton.backends.nvidia import compiler as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = {key: re.search(rf"\b{tag}:(\d+)", text) for key, tag in (("registers", "REG"), ("stack", "STACK"))}
    return {key: int(m.group(1)) if m else 0 for key, m in found.items()}


# a transpose of a tensor-core product's result, in Triton's GPU IR: Triton 3.4 to 3.7.0 computed wrong
# products from such a tensor on Hopper (fla #640), so the kernels carry transposed states instead
_TRANSPOSED_MMA = re.compile(r"= tt\.trans [^\n]*?\} : tensor<[^,>]+, #mma\d*> ->")


def transposed_products(ttgir: str) -> int:
    """How many tensor-core results a compiled kernel (its TTGIR) transposes."""
    return len(_TRANSPOSED_MMA.findall(ttgir))


def compile_for(launch: Launch, arch: int) -> Dict[str, object]:
    """Compile one recorded launch for compute capability ``arch``: its resources, how many tensor-core
    results it transposes (``transposed_products``) and its compile time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import feature_kernel, kernel

    fn = getattr(kernel if launch.kernel in LAUNCHED else feature_kernel, launch.kernel)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, launch.signature, launch.constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": launch.num_warps,
                                                                            "num_stages": launch.num_stages})
    seconds = time.perf_counter() - start
    # Triton's shared memory is dynamic, so it is in its metadata, not in the binary's static counts
    return dict(resources(compiled.asm["cubin"]), shared=compiled.metadata.shared,
                transposed=transposed_products(compiled.asm["ttgir"]), seconds=round(seconds, 1))


def describe(launch: Launch) -> str:
    """The launch's specialisation in a few words: its flags that are on, and the block sizes."""
    flags = [k for k, v in launch.constexprs.items() if v is True]
    dt = launch.constexprs.get("DT")
    blocks = " ".join(f"{k}={launch.constexprs[k]}" for k in ("C", "BK", "BV") if k in launch.constexprs)
    return (f"{blocks}{' DT=' + str(dt) if dt is not None else ''} warps={launch.num_warps} "
            f"stages={launch.num_stages} {' '.join(flags)}")


def table(archs: List[int], head_dims: List[int], dtypes: List[torch.dtype], cases: Optional[List[str]] = None,
          tf32: bool = False) -> List[Dict[str, object]]:
    """One row per launch and target: what ``compile_for`` reads, with the launch's description."""
    rows = []
    for dtype in dtypes:
        for head_dim in head_dims:
            for launch in launches_of(head_dim, dtype, cases, tf32 and dtype == torch.float32):
                for arch in archs:
                    rows.append(dict(arch=f"sm_{arch}", dtype=str(dtype).replace("torch.", ""), head_dim=head_dim,
                                     kernel=launch.kernel, spec=describe(launch), **compile_for(launch, arch)))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lion_fairseq.ops.kernel_targets", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90 = sm_90)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"],
                        choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--cases", nargs="+", choices=[c[0] for c in CASES], default=None,
                        help="gate kinds to compile (default: all)")
    parser.add_argument("--tf32", action="store_true",
                        help="float32 products in TF32, as with torch.backends.cuda.matmul.allow_tf32 (default: 3xTF32, "
                             "as with it off)")
    parser.add_argument("--prefetch", action="store_true",
                        help="the walks load the next chunk's tiles ahead (kernel.PREFETCH, off as the kernel ships)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET: under the interpreter there is no compiler to run", file=sys.stderr)
        return 2
    from . import backend

    missing = backend._triton_missing()  # Triton 2 (torch < 2.4) has neither GPUTarget nor ASTSource
    if missing is not None:
        print(f"error: the kernels cannot be compiled here: {missing}", file=sys.stderr)
        return 2
    from .kernel import configured

    with configured(prefetch=(True, True)) if args.prefetch else nullcontext():
        rows = table(args.arch, args.head_dims, [getattr(torch, d) for d in args.dtypes], args.cases, args.tf32)
    import triton

    print(f"Triton {triton.__version__}\n")
    print("| target | dtype | D | kernel | specialisation | registers | stack bytes | shared bytes | "
          "transposed products | compile s |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['arch']} | {r['dtype']} | {r['head_dim']} | {r['kernel']} | {r['spec']} | {r['registers']} | "
              f"{r['stack']} | {r['shared']} | {r['transposed']} | {r['seconds']} |")
    print("\n| target | dtype | D | kernel | launches | with stack use (spilled registers) | most stack bytes |")
    print("|---|---|---:|---|---:|---:|---:|")
    groups: Dict[tuple, List[int]] = {}
    for r in rows:
        groups.setdefault((r["arch"], r["dtype"], r["head_dim"], r["kernel"]), []).append(r["stack"])
    for (arch, dtype, head_dim, name), stacks in groups.items():
        print(f"| {arch} | {dtype} | {head_dim} | {name} | {len(stacks)} | {sum(s > 0 for s in stacks)} | {max(stacks)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
