"""What `torch.compile(fullgraph=True)` hands Inductor for a front that calls one of our `triton_op`s, traced on the
CPU: the op runs its fake implementation and the AOT compiler only records the graph, nothing is launched.

`wrap_triton` passes interpreted kernels (TRITON_INTERPRET=1) through untraced, so every interpreted `@triton.jit`
function of the given modules (the kernel and the helpers it calls) is swapped for a compiled-mode `JITFunction` of
the same code for the trace.
"""

from __future__ import annotations

import pytest
import torch


def traced_launches(monkeypatch, modules, front, *args):
    """Trace `front(*args)` and return (gm, launched): the AOT forward graph and the kernels of its user-defined
    Triton launches (`triton_kernel_wrapper_functional` nodes), in graph order."""
    import triton
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.interpreter import InterpretedFunction

    twins = {}
    for module in modules:
        for name, fn in list(vars(module).items()):
            if isinstance(fn, InterpretedFunction):
                monkeypatch.setattr(module, name, twins.setdefault(id(fn), triton.JITFunction(fn.fn)))
    graphs = []

    def record(gm, example_inputs):
        launched = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]) for n in gm.graph.nodes
                    if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        graphs.append((gm, launched))  # the side table empties with the dynamo reset below
        raise RuntimeError("traced")  # the CPU cannot launch the kernel: stop at the graph

    torch._dynamo.reset()
    try:
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="traced"), torch.no_grad():
            torch.compile(front, backend=aot_autograd(fw_compiler=record), fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    (gm, launched), = graphs
    return gm, launched
