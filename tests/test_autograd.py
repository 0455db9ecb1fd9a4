"""The ops are not differentiable (sgl_dsv4_kernels/_autograd.py): every tensor op has an Autograd kernel, so an
output computed from requires-grad inputs does not require grad and a backward through it raises, instead of the
dispatcher's fallback warning and leaving the gradients at None; opcheck's autograd test runs on such inputs."""
import warnings

import pytest
import torch

import sgl_dsv4_kernels as dsv4  # noqa: F401  registers the ops
from samples import all_samples
from test_compress_forward import _opcheck_case as compress_forward_case
from test_low_ratio import C1_NAMES, C2_NAMES, c1_args, c2_args
from test_writers import _c_args, _k_args

pytestmark = pytest.mark.usefixtures("single_thread")


def _tensor_op_names():
    names = set()
    for qualname in torch._C._dispatch_get_all_op_names():
        if not qualname.startswith("dsv4::"):
            continue
        packet = getattr(torch.ops.dsv4, qualname.split("::")[1].split(".")[0])
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            if any("Tensor" in str(a.type) for a in schema.arguments):
                names.add(qualname.split(".")[0] + ("" if overload == "default" else f".{overload}"))
    return sorted(names)


def test_every_tensor_op_has_an_autograd_kernel():
    names = _tensor_op_names()
    assert len(names) >= 24, names
    missing = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "Autograd")]
    assert not missing, f"no Autograd kernel (the not-implemented fallback would run): {missing}"


def _cases(device):
    """(name, op, args, kwargs) with at least one floating-point input for every op family that has one."""
    ops = torch.ops.dsv4
    cases = [(s.name, s.op, s.args, s.kwargs) for s in all_samples(device)
             if s.name.startswith(("store-v4-float32", "store-v41-freqs", "fq_"))]
    a = c1_args(device)
    cases.append(("c1", ops.c1_decode_norm_rope_store.default, tuple(a[k] for k in C1_NAMES), {}))
    a = c2_args(device)
    cases.append(("c2", ops.c2_decode_or_verify_norm_rope_store.default, tuple(a[k] for k in C2_NAMES), {}))
    a = _k_args(device)
    cases.append(("k_writer", ops.fused_k_norm_rope_flashmla.default,
                  (a["kv"], a["weight"], a["eps"], a["freqs"], a["positions"], a["out_loc"], a["kvcache"]),
                  dict(page_size=a["page_size"], layout=a["layout"])))
    a = _c_args(device)
    cases.append(("compress_writer", ops.compress_norm_rope_store.default,
                  (a["kv"], a["plan"], a["norm_weight"], a["norm_eps"], a["freqs"], a["out_loc"], a["kvcache"]),
                  dict(page_size=16, compress_ratio=4, is_decode=True, layout=0, use_fp4=False)))
    for ratio, is_decode in ((4, True), (128, False)):
        e, x, plan = compress_forward_case(device, ratio, is_decode)
        cases.append((f"compress_forward-{ratio}-{is_decode}", ops.compress_forward.default,
                      (e.state, x, e.ape.to(device), plan.plan, plan.plan_w, e.D, ratio, is_decode), {}))
    return cases


CASE_NAMES = [c[0] for c in _cases("cpu")]


def _case(device, name):
    return {c[0]: c[1:] for c in _cases(device)}[name]


def _requiring_grad(op, args, kwargs):
    """The floating-point tensors the op only reads get requires_grad=True; written ones stay as they are."""
    schema = op._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    names = [a.name for a in schema.arguments]

    def prepare(name, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and name not in written:
            return value.detach().clone().requires_grad_()
        return value

    args = tuple(prepare(n, v) for n, v in zip(names, args))
    kwargs = {k: prepare(k, v) for k, v in kwargs.items()}
    leaves = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    assert leaves, "the case has no floating-point input"
    return args, kwargs, leaves


@pytest.mark.parametrize("name", CASE_NAMES)
def test_outputs_of_requires_grad_inputs_are_not_differentiable(device, name):
    op, args, kwargs = _case(device, name)
    args, kwargs, leaves = _requiring_grad(op, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warned "autograd kernel was not registered" on backward
        result = op(*args, **kwargs)
        outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]
        for out in outputs:
            assert not out.requires_grad and out.grad_fn is None, f"{name}: output has a grad_fn"
            with pytest.raises(RuntimeError, match="does not require grad"):
                out.float().sum().backward()
    assert all(t.grad is None for t in leaves)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_opcheck_with_requires_grad_inputs(device, name):
    """Without requires-grad inputs opcheck skips its autograd-registration test; here it runs."""
    op, args, kwargs = _case(device, name)
    args, kwargs, _ = _requiring_grad(op, args, kwargs)
    torch.library.opcheck(op, args, kwargs)
