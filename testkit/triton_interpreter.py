"""Triton kernels in CPU test modules: Triton's interpreter, or the module again in a fresh process.

Triton decides between compiled and interpreted functions when they are decorated, i.e. when
triton itself (its @jit standard library: tl.sum's combine function...) and then a kernel module
are imported, so TRITON_INTERPRET must be set before both: importing this module sets it on a
machine without CUDA (tests/conftest.py does too). With CUDA present (the GPU machine, where
gpu-marked tests are collected in the same process) the kernels stay compiled and the modules run
on the GPU instead. Where another module imported triton compiled first, a module's kernel tests
cannot run in this process; one test then runs the module in a fresh interpreter process.

A kernel test module imports this before triton, then:

    triton = pytest.importorskip("triton", ...)
    in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("no CUDA and the Triton interpreter is off", allow_module_level=True)


def _triton_compiled_mode() -> bool:
    """Whether triton's own @jit helpers were defined compiled (it was imported before the variable)."""
    from triton.runtime.jit import JITFunction
    import triton.language.standard as std
    return any(isinstance(v, JITFunction) for v in vars(std).values())


def interpreter_or_fresh_process(test_file: str):
    """(a marker for the module's kernel tests, the module's fresh-process test), after triton's import.

    The marker skips a test where this process cannot interpret the kernels; the test function
    (bind it to a `test_` name in the module) then runs the module's file in a fresh interpreter
    process, and is itself skipped where this process interprets them."""
    fresh = INTERPRETED and _triton_compiled_mode()
    in_process = pytest.mark.skipif(fresh, reason="triton was imported compiled before this module: "
                                    "test_in_a_fresh_interpreter_process runs these")

    @pytest.mark.skipif(not fresh, reason="this process runs the kernels in the interpreter itself")
    def test_in_a_fresh_interpreter_process():
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-6000:]

    return in_process, test_in_a_fresh_interpreter_process


def _interpreter():
    """triton.runtime.interpreter where kernels run in it and triton imports, else None."""
    if not INTERPRETED:
        return None
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    return interpreter


def _wrap(name: str, make) -> bool:
    """Put make(interpreter, Triton's function) in place of triton.runtime.interpreter.<name>, once
    per process. True when the wrapper is in place; False where the kernels are not interpreted,
    Triton has no such function, or make returns None (a function it does not know)."""
    interpreter = _interpreter()
    original = getattr(interpreter, name, None) if interpreter is not None else None
    if original is None:
        return False
    if getattr(original, "testkit_wrapper", False):
        return True
    wrapper = make(interpreter, original)
    if wrapper is None:
        return False
    wrapper.testkit_wrapper = True
    setattr(interpreter, name, wrapper)
    return True


def _wrap_method(owner_name: str, name: str, make) -> bool:
    """_wrap for a method: make(Triton's method) in place of triton.runtime.interpreter.<owner_name>.<name>,
    once per process. True when the wrapper is in place; False where the kernels are not interpreted,
    Triton has no such method, or make returns None."""
    interpreter = _interpreter()
    owner = getattr(interpreter, owner_name, None) if interpreter is not None else None
    original = getattr(owner, name, None)
    if original is None:
        return False
    if getattr(original, "testkit_wrapper", False):
        return True
    wrapper = make(original)
    if wrapper is None:
        return False
    wrapper.testkit_wrapper = True
    setattr(owner, name, wrapper)
    return True


def install_interpreter_patches() -> None:
    """Every patch of Triton's interpreter below, in this process (each once; where the kernels are
    not interpreted each leaves Triton as it is): tests/conftest.py for the suite's processes, and
    benchmarks/bench_common.py for a benchmark's dry run, whose kernels took twice their time under
    the interpreter as Triton ships it."""
    cache_builtin_names()  # the interpreter's launches find triton.language's builtins by a list made once
    cache_np_dtypes()  # and the numpy dtype of a Triton dtype by its name, once
    bfloat16_casts_by_shifts()  # bfloat16 to float32 and back (truncating) as shifts of the bits
    row_independent_dots()  # a dot gives a row the same bits wherever it sits in the tile, as on a GPU
    skip_discarded_overflow_checks()  # no integer overflow check a non-debug build would drop anyway
    vectorized_xor_reductions()  # tl.sort's XOR reductions in numpy, not element by element
    shared_block_shapes()  # a block shape's parts made once per shape, not at every op
    no_broadcast_between_equal_shapes()  # two blocks of one shape need no broadcast
    computation_types_once()  # a binary op's promoted dtype kept per pair of dtypes
    operands_of_one_type_as_they_are()  # a binary op of two tensors of one type: no casts, no broadcast
    languages_by_identity()  # a kernel's names for triton.language found by identity, patched once a launch


def cache_builtin_names() -> bool:
    """Triton's interpreter patches the builtins of `triton.language` (tl, tl.tensor, tl.math, tl.core)
    at every launch and again at every call of one @jit function from another, and finds them each
    time with `inspect.getmembers` (a sorted walk over every attribute): up to a fifth of a kernel
    test's time under the interpreter. The names of those builtins never change, so they are listed
    once, here, and each patch looks up only those. A name is patched exactly where Triton's own
    `_patch_builtin` would patch it (its current value is a builtin), in the same order, so the
    kernels run as before. A package is patched whole and put back whole (the launch's scope), so
    where its first listed name is no builtin none is: a call from one @jit function to another,
    inside the launch's patch, skips the walk (it would patch nothing). True when installed; a
    Triton without that function is left as it is."""
    return _wrap("_patch_builtin", _patch_builtin_by_names)


def _patch_builtin_by_names(interpreter, original):
    import inspect

    import triton.language as tl

    try:
        if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
            return None
    except (TypeError, ValueError):
        return None
    is_builtin = tl.core.is_builtin
    # listed now, before any launch has patched them
    names = {id(pkg): (pkg, tuple(name for name, member in inspect.getmembers(pkg) if is_builtin(member)))
             for pkg in (tl, tl.tensor, tl.math, tl.core, tl.core.tensor, tl.core.tensor_descriptor_base)}

    def patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None or listed[0] is not pkg:
            return original(pkg, builder, scope)
        if listed[1] and not is_builtin(getattr(pkg, listed[1][0])):
            return  # a launch's patch is in place (a call from one @jit function to another): none is builtin
        for name in listed[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    return patch_builtin


def cache_np_dtypes() -> bool:
    """The interpreter maps a Triton dtype to the numpy dtype holding its values at every cast,
    constant and binary op (`_get_np_dtype`), building its table of 19 dtypes anew each time: about
    a tenth of a kernel test's time. A scalar dtype's entry depends on its name alone (the table's
    keys hash and compare by name), so each name's answer is kept after its first lookup; pointer
    and block types, and a name the table lacks, go to Triton's function as before. True when
    installed."""
    return _wrap("_get_np_dtype", _np_dtype_by_name)


def _np_dtype_by_name(interpreter, original):
    import triton.language as tl

    by_name = {}

    def get_np_dtype(tt_dtype):
        if type(tt_dtype) is not tl.dtype:  # pointer_type and block_type are subclasses
            return original(tt_dtype)
        found = by_name.get(tt_dtype.name)
        if found is None:
            found = by_name[tt_dtype.name] = original(tt_dtype)
        return found

    return get_np_dtype


def bfloat16_casts_by_shifts() -> bool:
    """The interpreter casts bfloat16 to float32 and float32 to bfloat16 with `_convert_float`, a
    general converter between float formats: about twenty numpy operations over the sign, exponent
    and mantissa apart, a twentieth of a bfloat16 kernel test's time. The two formats share their
    sign and exponent bits, so where no value is subnormal (exponent bits zero, mantissa not) its
    result is the bits shifted: bfloat16 to float32 puts 16 zero bits after them, a truncating cast
    (no rounding mode, or round toward zero) drops the low 16. Those inputs get the shift (the same
    bits, dtype and shape: every bfloat16 value and float32 values of every exponent were compared);
    one with a subnormal value, a round-to-nearest cast and every other pair of formats are
    Triton's as before. True when installed; the wrapper keeps Triton's function as `.original`
    (the test compares the two)."""
    return _wrap("_convert_float", _float_casts_by_shifts)


def _float_casts_by_shifts(interpreter, original):
    import numpy as np
    import triton.language as tl

    ir = getattr(interpreter, "_ir", None)
    if ir is None:
        return None
    rtne = ir.ROUNDING_MODE.RTNE

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32 and input.dtype.itemsize == 2:
            bits = np.ascontiguousarray(input).view(np.uint16)
            if not ((bits & np.uint16(0x7FFF)) - np.uint16(1) < np.uint16(0x7F)).any():  # no subnormal
                return (bits.astype(np.uint32) << np.uint32(16)).reshape(input.shape)
        elif (input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != rtne
              and input.dtype.itemsize == 4):
            bits = np.ascontiguousarray(input).view(np.uint32)
            if not ((bits & np.uint32(0x7FFFFFFF)) - np.uint32(1) < np.uint32(0x7FFFFF)).any():  # no subnormal
                return (bits >> np.uint32(16)).astype(np.uint16).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert_float.original = original
    return convert_float


def skip_discarded_overflow_checks() -> bool:
    """Triton checks every integer add, sub and mul of a kernel for overflow (`sanitize_overflow`):
    the operands again in int64, the result compared with the type's bounds, and the comparison
    handed to `device_assert`, which drops it unless the build is a debug one. The interpreter's
    builder is never one (InterpreterOptions.debug is False), so it computed every check and threw
    it away: about a third of a GQA kernel test's time under the interpreter. With the checks off
    the kernels compute exactly what they computed; a builder in debug mode is left as it is. True
    when switched off."""
    interpreter = _interpreter()
    if interpreter is None:
        return False
    import dataclasses

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or options.debug or not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def row_independent_dots() -> bool:
    """The interpreter's `tl.dot` is numpy's matmul of the two tiles, in float32 for a float32
    accumulator: OpenBLAS's sgemm, whose result for a row can depend on where the row sits in the
    tile (seen with numpy 2.4's OpenBLAS 0.3.31 on an AMD EPYC, AVX2: a permutation of the rows gave
    other bits), while the kernels' batch-invariance tests (a row's bits whatever the rows beside
    it) hold on the GPU, whose dot gives every row of a tile the same reduction. Here such a dot
    multiplies and sums in float64 (float32 products are exact there) and rounds once to float32:
    the same rounded value for a row wherever it sits, but where two summation orders straddle a
    float32 rounding boundary (a chance of about K * 2^-29 per element for K terms). Integer and
    fp8 dots are Triton's as before. True when installed."""
    return _wrap_method("InterpreterBuilder", "create_dot", _float64_dot)


def _float64_dot(original):
    import numpy as np

    interpreter = _interpreter()

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        floats = (np.float16, np.float32)
        if d.data.dtype != np.float32 or a.data.dtype not in floats or b.data.dtype not in floats:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    return create_dot


def vectorized_xor_reductions() -> bool:
    """The interpreter reduces with numpy where it knows the combine function (sums, min and max,
    argmin and argmax) and otherwise element by element in Python, calling the combine function on
    0-d tensors: `tl.sort`'s bitonic network reduces with `_xor_combine` at every stage, so a kernel
    that sorts (the MoE's routing sort) spent about a third of its test time there. An XOR of
    integers is exact in any order: here it is numpy's `bitwise_xor.reduce` over the same axis, the
    same values, the same dtype. Every other reduction is Triton's as before. True when installed;
    the wrapper keeps Triton's method as `.original` (the test compares the two)."""
    return _wrap_method("ReduceOps", "apply_impl", _numpy_xor_reduce)


def _numpy_xor_reduce(original):
    import numpy as np
    import triton.language as tl

    xor = getattr(tl.standard, "_xor_combine", None)
    if xor is None:
        return None

    def apply_impl(self, input):
        value = input[0]
        if self.combine_fn is not xor or len(input) != 1 or not np.issubdtype(value.handle.data.dtype, np.integer):
            return original(self, input)
        data = np.bitwise_xor.reduce(value.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(data, value.dtype)

    apply_impl.original = original
    return apply_impl


def shared_block_shapes() -> bool:
    """Every tl op under the interpreter makes a block type for its result and a tensor of it, and
    each made its shape anew: a triton `tuple` of the dims with a type per dim, checked for powers of
    two and named (block_type), then a tuple of constexprs and their product (tensor): about a fifth
    of a kernel test's time. A kernel has a few shapes, so those parts are made once per shape (of
    ints) and shared by the types and tensors of that shape; the first block type of a shape is made
    by Triton's own constructor (its checks and errors included) and a shape that is not all ints
    always is. Nothing changes them after construction (a kernel gets new tensors from each op), so
    every type and tensor holds what it held. True when installed."""
    interpreter = _interpreter()
    if interpreter is None:
        return False
    import builtins
    import math

    import triton.language.core as core

    block_type, tensor = core.block_type, core.tensor
    if getattr(block_type.__init__, "testkit_wrapper", False):
        return True
    try:
        probe = block_type(core.float32, [2, 4])
        made = core.tensor(None, probe)
    except Exception:
        return False
    if not (isinstance(probe.shape, core.tuple) and isinstance(made.shape, core.tuple)
            and probe.name == f"<{probe.shape}, {core.float32}>" and made.numel == 8):
        return False  # a Triton whose types are built otherwise: left as it is
    original_block_type_init = block_type.__init__
    by_dims: dict = {}  # dims (ints) -> (the block type's shape, numel, shape text)
    for_tensors: dict = {id(()): ((), core.constexpr(1), core.tuple([]))}  # id(shared shape) -> its tensor parts

    def dims_of(shape):
        values = shape.values if type(shape) is core.tuple else shape
        if type(values) is not list and type(values) is not builtins.tuple:
            return None
        dims = builtins.tuple(v.value if type(v) is core.constexpr else v for v in values)
        return dims if dims and all(type(d) is int for d in dims) else None

    def block_type_init(self, element_ty, shape):
        dims = dims_of(shape)
        found = by_dims.get(dims) if dims is not None else None
        if found is None:
            original_block_type_init(self, element_ty, shape)
            if dims is not None:
                by_dims[dims] = (self.shape, self.numel, str(self.shape))
                for_tensors[id(self.shape)] = (self.shape, core.constexpr(math.prod(dims)),
                                               core.tuple([core.constexpr(d) for d in dims]))
            return
        self.element_ty = element_ty
        self.shape, self.numel, text = found
        self.name = f"<{text}, {element_ty}>"

    def tensor_init(self, handle, type):
        self.handle = handle
        shape = type.shape if type.is_block() else ()
        found = for_tensors.get(id(shape))
        if found is not None and found[0] is shape:
            _, self.numel, self.shape = found
        else:
            self.numel = core.constexpr(math.prod(shape))
            self.shape = core.tuple([core.constexpr(s) for s in shape])
        self.type = type
        self.dtype = type.scalar

    block_type_init.testkit_wrapper = tensor_init.testkit_wrapper = True
    block_type.__init__, tensor.__init__ = block_type_init, tensor_init
    return True


def no_broadcast_between_equal_shapes() -> bool:
    """Each binary op of two blocks asks `broadcast_impl_value` for their common shape, which compares
    the dims one by one and each shape with the result through triton's tuple equality: where both
    blocks have the same dims it returns them as they are, which is what this asks first. True when
    installed."""
    import triton.language.core as core

    def make(original):
        def broadcast_impl_value(self, lhs, rhs):
            a, b = lhs.type, rhs.type
            if type(a) is core.block_type and type(b) is core.block_type and (
                    a.shape is b.shape or a.shape.values == b.shape.values):
                return lhs, rhs
            return original(self, lhs, rhs)
        return broadcast_impl_value

    return _wrap_method("TritonSemantic", "broadcast_impl_value", make)


def computation_types_once() -> bool:
    """Each binary op of two values asks `computation_type_impl` for the dtype both are cast to,
    a walk of promotion rules over the two scalar dtypes, whether each is a Python scalar and
    whether the op divides: a function of those five alone (an error raised for a pair is raised
    again). Here each answer is kept after its first time. True when installed."""
    import triton.language as tl

    def make(original):
        answers: dict = {}

        def computation_type_impl(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
            if type(a_ty) is not tl.dtype or type(b_ty) is not tl.dtype:  # pointer and block types: Triton's
                return original(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
            key = (a_ty.name, bool(a_is_scalar), b_ty.name, bool(b_is_scalar), bool(div_or_mod))
            found = answers.get(key)
            if found is None:
                found = answers[key] = original(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
            return found
        return computation_type_impl

    return _wrap_method("TritonSemantic", "computation_type_impl", make)


def operands_of_one_type_as_they_are() -> bool:
    """Every binary op (add, mul, comparisons...) first makes its two operands alike
    (`binary_op_type_checking_impl`): the dtype both are computed in (`computation_type_impl`),
    each operand cast to it, then both broadcast to one shape: about a quarter of a kernel test's
    time. Where both operands are tensors of one shape (or both scalars) and of one dtype, no
    pointer, and that dtype is the one they are computed in, each cast gives its operand back and
    the broadcast gives both back: here that case returns the operands as they are, after the same
    computation_type_impl call (whose errors it raises as before). Every other case is Triton's.
    True when installed."""
    import triton.language as tl
    import triton.language.core as core

    tensor, block_type, dtype = core.tensor, core.block_type, tl.dtype

    def make(original):
        def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                         arithmetic_check=True, div_or_mod=False):
            if type(lhs) is tensor and type(rhs) is tensor and arithmetic_check is True:
                a, b = lhs.type, rhs.type
                if type(a) is block_type and type(b) is block_type:
                    alike = a.shape is b.shape or a.shape.values == b.shape.values
                else:
                    alike = type(a) is dtype and type(b) is dtype  # scalars (a pointer's type is a subclass)
                if alike:
                    a, b = lhs.dtype, rhs.dtype
                    if type(a) is dtype and type(b) is dtype and a.name == b.name:
                        common = self.computation_type_impl(a, False, b, False, div_or_mod)
                        if type(common) is dtype and common.name == a.name:
                            return lhs, rhs
            return original(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        binary_op_type_checking_impl.original = original
        return binary_op_type_checking_impl

    return _wrap_method("TritonSemantic", "binary_op_type_checking_impl", make)


# triton/runtime/interpreter.py's _patch_lang as `languages_by_identity` was written against (sha256 of
# its source): another Triton's is left as it is.
_PATCH_LANG_SHA256 = "e5beeba74ada48294c1d0dbee3e55a5ac185992e2197b7ee706f3f061d880989"


def languages_by_identity() -> bool:
    """At every launch and every call of one @jit function from another, the interpreter's
    `_patch_lang` finds the names a kernel's module gives triton.language by walking the module's
    globals with `inspect.ismodule` and a list comparison (`value in [tl, tl.core]`, which for a
    module is identity): about a twentieth of a kernel test's time. Here the same walk asks
    `is tl or is tl.core`, the same modules in the same order.

    A call of one @jit function from another patches the language again (`_patch_lang` once more,
    into a scope nobody restores): triton.language's tensor methods and its range, reduce, scan...
    set anew to closures that do what the launch's in place already do, about a tenth of a kernel
    test's time. Here a module whose patch a launch has in place (its scope not yet restored) is
    not patched again; a module no launch has patched is, as Triton patches it. When the launch's
    scope is restored every attribute is back as it was, as before. True when installed."""
    import hashlib
    import inspect

    def make(interpreter, original):
        try:
            if hashlib.sha256(inspect.getsource(original).encode()).hexdigest() != _PATCH_LANG_SHA256:
                return None
        except (OSError, TypeError):
            return None
        tl = interpreter.tl
        in_place: dict[int, object] = {}  # id(module) -> the scope whose patch of it is in place

        class Scope(interpreter._LangPatchScope):
            def __init__(self):
                super().__init__()
                self.patched = []

            def restore(self):
                super().restore()
                for lang in self.patched:
                    if in_place.get(id(lang)) is self:
                        del in_place[id(lang)]

        def patch_lang(fn):
            scope = Scope()
            langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
            assert len(langs) >= 1, "triton.language must be visible from within jit'd function"
            builder, patch_builtin = interpreter.interpreter_builder, interpreter._patch_builtin
            for lang in langs:
                patch_builtin(lang, builder, scope)
                patch_builtin(lang.tensor, builder, scope)
                if lang == tl:
                    patch_builtin(lang.math, builder, scope)
                if id(lang) in in_place:
                    continue  # a call inside a launch: the launch's patch of this module is in place
                interpreter._patch_lang_tensor(lang.tensor, scope)
                interpreter._patch_lang_core(lang, scope)
                in_place[id(lang)] = scope
                scope.patched.append(lang)
            patch_builtin(tl.core.tensor_descriptor_base, builder, scope)
            return scope
        return patch_lang

    return _wrap("_patch_lang", make)


@contextlib.contextmanager
def nearest_even_bf16_casts():
    """Inside the block the interpreter casts float32 to bfloat16 as a GPU does, to nearest even;
    its own cast truncates (seen with triton 3.9), so a kernel's bf16 values differ from torch's
    in the last bit wherever torch rounds up. With it a kernel that rounds where torch rounds gives
    torch's bits. Nothing changes where the kernels are not interpreted."""
    interpreter = _interpreter()
    builder = getattr(interpreter, "InterpreterBuilder", None) if interpreter is not None else None
    original = getattr(builder, "cast_impl", None)
    if original is None:
        yield
        return
    import numpy as np
    import triton.language as tl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        data = np.asarray(src.data, dtype=np.float32)
        bits = torch.from_numpy(data.copy()).bfloat16().view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits.reshape(data.shape), dst_type.scalar)

    builder.cast_impl = cast_impl
    try:
        yield
    finally:
        builder.cast_impl = original
