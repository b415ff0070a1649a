"""Record what a model does on its example inputs: every PyTorch call, in which module, from which source line,
which tensors it read and wrote.

A ``TorchFunctionMode`` sees each call the model's Python makes (``F.linear`` inside an ``nn.Linear``,
``q @ k.transpose(-2, -1)``, ``torch.softmax``, ``x.item()``); PyTorch disables the mode inside the call, so the
calls that PyTorch's own functions make are not recorded twice. Forward hooks keep a stack of module paths. Tensors
are identified by ``id``, and every tensor seen is kept alive until the trace is dropped, so an id is never reused
within one trace. This is the data flow the detectors match patterns on; it works on any eager model, on any
device, without the tracing restrictions of ``torch.fx``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

# Calls that only change a tensor's view or dtype: data flow goes through them unchanged.
VIEW_OPS = frozenset(
    "view reshape transpose permute contiguous float to type half bfloat16 double flatten unflatten unsqueeze squeeze "
    "expand expand_as getitem split chunk unbind t clone dropout type_as view_as narrow select movedim swapaxes "
    "broadcast_to".split()
)
# Calls that make the host wait for the device (or would, on a GPU).
HOST_SYNC_OPS = frozenset(
    "item tolist nonzero cpu numpy bool int float_ index repr format str unique masked_select".split()
)
_ALIASES = {
    "matmul": "matmul", "__matmul__": "matmul", "__rmatmul__": "matmul", "bmm": "matmul", "mm": "matmul",
    "einsum": "matmul", "baddbmm": "matmul",
    "__mul__": "mul", "__rmul__": "mul", "mul": "mul", "multiply": "mul",
    "__truediv__": "div", "div": "div", "divide": "div", "true_divide": "div",
    "__add__": "add", "__radd__": "add", "add": "add", "__iadd__": "add",
    "__sub__": "sub", "__rsub__": "sub", "sub": "sub", "__neg__": "neg", "neg": "neg",
    "__getitem__": "getitem", "__pow__": "pow", "pow": "pow", "square": "square",
    "__bool__": "bool", "__int__": "int", "__float__": "float_", "__index__": "index",
    "__repr__": "repr", "__format__": "format", "__str__": "str",
    "_softmax": "softmax", "masked_fill_": "masked_fill", "index_add_": "index_add",
}  # fmt: skip
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))


def canonical_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # a property such as Tensor.T or Tensor.shape
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return _ALIASES.get(name, name)


@dataclass
class Op:
    index: int
    name: str  # canonical name: "linear", "matmul", "softmax", "mul", "item" ...
    module: str  # path of the innermost module running ("" for the root)
    location: str  # "file.py:123" of the user code that made the call
    inputs: list[int]  # ids of tensor arguments, in order
    outputs: list[int]  # ids of tensor results
    in_shapes: list[tuple]
    out_shapes: list[tuple]
    in_dtypes: list[torch.dtype]
    args: tuple = field(repr=False, default=())  # the call's arguments (tensors kept alive by the trace)
    kwargs: dict = field(repr=False, default_factory=dict)


@dataclass
class ModuleCall:
    path: str
    type_name: str
    first_op: int  # index of its first recorded op
    last_op: int = -1  # one past its last


def _tensors(obj, out: list):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


def _user_location() -> str:
    """file:line of the innermost frame outside torch and this package: the line the model's author wrote."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR) and not filename.startswith(_HERE) and "<frozen" not in filename:
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Trace:
    """The recorded calls of one forward, and the module tree they ran in."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.ops: list[Op] = []
        self.module_calls: list[ModuleCall] = []
        self.modules: dict[str, torch.nn.Module] = dict(model.named_modules())
        self.tensors: dict[int, torch.Tensor] = {}  # keeps every tensor alive: ids stay unique
        self.producer: dict[int, int] = {}  # tensor id -> index of the op that produced it
        self.consumers: dict[int, list[int]] = {}  # tensor id -> indices of the ops that read it
        self.param_names: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
        self.output = None

    # ---- recording -------------------------------------------------------------------------------------------
    def _record(self, func, args, kwargs, result, module: str) -> None:
        name = canonical_name(func)
        ins = _tensors((args, kwargs), [])
        outs = _tensors(result, [])
        if not outs and name not in HOST_SYNC_OPS:
            return  # .shape, .dim(), .size(): no data flow, no sync
        for t in ins + outs:
            self.tensors.setdefault(id(t), t)
        op = Op(
            index=len(self.ops),
            name=name,
            module=module,
            location=_user_location(),
            inputs=[id(t) for t in ins],
            outputs=[id(t) for t in outs],
            in_shapes=[tuple(t.shape) for t in ins],
            out_shapes=[tuple(t.shape) for t in outs],
            in_dtypes=[t.dtype for t in ins],
            args=tuple(args),
            kwargs=dict(kwargs or {}),
        )
        self.ops.append(op)
        for tid in op.inputs:
            self.consumers.setdefault(tid, []).append(op.index)
        for tid in op.outputs:
            if tid not in op.inputs:  # an in-place op keeps its first producer
                self.producer.setdefault(tid, op.index)

    # ---- queries ---------------------------------------------------------------------------------------------
    def origin(self, tid: int, skip: frozenset = VIEW_OPS) -> Op | None:
        """The op that made ``tid``, looking through views and casts (None for inputs and parameters)."""
        seen = 0
        while tid in self.producer and seen < 64:
            op = self.ops[self.producer[tid]]
            if op.name not in skip or not op.inputs:
                return op
            tid, seen = op.inputs[0], seen + 1
        return None

    def uses(self, tid: int, skip: frozenset = VIEW_OPS) -> list[Op]:
        """The ops that read ``tid``, looking through views and casts."""
        out, stack, seen = [], [tid], set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            for i in self.consumers.get(t, []):
                op = self.ops[i]
                if op.name in skip:
                    stack.extend(op.outputs)
                else:
                    out.append(op)
        return sorted(out, key=lambda o: o.index)

    def linear_module(self, op: Op | None) -> str | None:
        """The path of the nn.Linear whose call produced ``op`` (an F.linear recorded inside it), else None."""
        if op is None or op.name != "linear":
            return None
        module = self.modules.get(op.module)
        return op.module if isinstance(module, torch.nn.Linear) else None

    def ops_in(self, path: str) -> list[Op]:
        """Ops recorded inside the module at ``path`` or its children."""
        prefix = path + "." if path else ""
        return [op for op in self.ops if op.module == path or op.module.startswith(prefix)]


class _Recorder(TorchFunctionMode):
    def __init__(self, trace: Trace, stack: list[str]):
        super().__init__()
        self.trace, self.stack = trace, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.trace._record(func, args, kwargs, result, self.stack[-1])
        return result


def record(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Trace:
    """Run ``model(*args, **kwargs)`` once (gradients on, as in training) and return its :class:`Trace`."""
    trace = Trace(model)
    stack = [""]
    paths = {m: p for p, m in trace.modules.items()}
    handles = []

    def pre(module, _inputs):
        stack.append(paths[module])
        trace.module_calls.append(ModuleCall(paths[module], type(module).__name__, len(trace.ops)))

    def post(module, _inputs, _output):
        if len(stack) > 1:
            stack.pop()
        for call in reversed(trace.module_calls):
            if call.path == paths[module] and call.last_op < 0:
                call.last_op = len(trace.ops)
                break

    for module in trace.modules.values():
        if module is model:
            continue
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        with _Recorder(trace, stack):
            trace.output = model(*args, **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    return trace
