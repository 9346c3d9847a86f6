"""flash-linear-attention's real Triton kernels, and LION's own (ops/kernel.py), on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, set by conftest.py before fla is imported). Five patches of the
interpreter, none of fla's files (measured with triton 3.9.0 and fla-core 0.6.0):

- the autotuner benchmarks its configs on a device driver, of which the CPU has none ("0 active
  drivers"): each kernel keeps its first config, as Triton does when only one is given;
- the interpreter leaves the variable of a ``range``/``tl.range`` loop a Python int, where compiled Triton
  makes it a tensor, so fla's ``i_t.to(tl.int64)`` fails: the AST rewriter that the interpreter runs over
  every kernel makes it a tensor at the top of each such loop, as it already does for assignments;
- the interpreter converts float32 to bfloat16 by dropping the low 16 bits, where a GPU rounds to nearest
  (even), as Triton's semantics say: a kernel's bfloat16 stores then came out with twice the GPU's error,
  and biased toward zero. They round to nearest here;
- each call of a ``@triton.jit`` helper patched the language modules again, scanning them whole, though
  the launch running it had patched them already: a helper whose modules are patched runs as it is
  (the same values, in 40-60% less time);
- every integer +, - and * computed an overflow check in int64 for a device assertion that only debug mode
  evaluates, and the interpreter is never in debug mode: the checks are built only in debug mode.

The interpreter computes 16-bit floats on their raw bits, so only float32 runs here, which is what
``lion_attention`` hands fla (``ops/fla.py``)."""
import ast
import dataclasses
import functools
import importlib.util
import inspect
import os
from typing import Optional

import numpy as np

AVAILABLE = (os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
             and importlib.util.find_spec("fla") is not None)


def _loop_variable_as_tensor(node: ast.For) -> Optional[ast.Assign]:
    """``i = interpreter_semantic.to_tensor(i, False)`` for ``for i in range(...)`` / ``tl.range(...)``."""
    call = node.iter
    if not (isinstance(call, ast.Call) and isinstance(node.target, ast.Name)):
        return None
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
    if name != "range":
        return None
    to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                              ctx=ast.Load())
    value = ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)],
                     keywords=[])
    return ast.copy_location(ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())], value=value), node)


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> the bits of the nearest bfloat16 (ties to even), as uint16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def install() -> None:
    """Apply the patches (idempotent). Call before the first kernel runs: kernels are rewritten once."""
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    if getattr(interpreter.FunctionRewriter.ast_transformer, "lion_patched", False):
        return
    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(bfloat16_bits(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]

    class Transformer(type(interpreter.FunctionRewriter.ast_transformer)):
        lion_patched = True

        def visit_For(self, node: ast.For) -> ast.For:
            node = self.generic_visit(node)
            assign = _loop_variable_as_tensor(node)
            if assign is not None:
                node.body.insert(0, assign)
            return node

    interpreter.FunctionRewriter.ast_transformer = Transformer()

    # A helper's own patches are never undone (Triton drops their scope): a patch is in place from the
    # launch's start to its end, or for good.
    patch_lang = interpreter._patch_lang
    in_place = []  # the language modules of each patch not yet undone

    @functools.lru_cache(maxsize=None)
    def language_modules(fn) -> frozenset:
        return frozenset(v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang_once(fn):
        langs = language_modules(fn)
        if langs and langs <= frozenset().union(*in_place):
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        in_place.append(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            restore()
            in_place.remove(langs)

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_lang_once

    # Integer overflow checks: Triton builds them (int64 casts, a range test) for every integer +, - and *, to
    # feed a device_assert that does nothing unless debug is on, which the interpreter never turns on. They
    # are built only where they can fire.
    builder = interpreter.interpreter_builder  # the one every launch uses
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=builder.options.debug)
