"""Autograd registration of every tensor op in torch.ops.dsv4: none is differentiable. The stable ABI registers
kernels for CPU and CUDA only, so without this the dispatcher's autograd fallback applies: an output of a
requires-grad input gets a backward that only warns and leaves the inputs' gradients at None.
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("dsv4", "IMPL")  # kept alive: dropping it would unregister the kernels


def _registration_name(op):
    """"name" or "name.overload", as Library.impl takes it."""
    name = op._schema.name.split("::")[1]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _tensor_ops():
    """Every overload of torch.ops.dsv4 that takes a tensor (the introspection ops take none)."""
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsv4::")}
    for name in sorted(names):
        packet = getattr(torch.ops.dsv4, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any("Tensor" in str(a.type) for a in op._schema.arguments):
                yield op


# A fallthrough at the Autograd key is torch's way to declare an op non-differentiable: the call goes straight to
# the backend, its outputs never require grad, and a backward through them fails loudly ("does not require
# grad") instead of producing no gradient silently. It costs nothing per call.
for _op in _tensor_ops():
    _LIB.impl(_registration_name(_op), torch.library.fallthrough_kernel, "Autograd")
