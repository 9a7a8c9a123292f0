"""Torch modes that catch what a steady-state step must never do: read device values on the host
(a sync) or anything CUDA graph capture cannot hold."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class NoHostReads(TorchDispatchMode):
    """Raises on every op that reads device values on the host."""

    FORBIDDEN = {
        torch.ops.aten._local_scalar_dense,
        torch.ops.aten.nonzero,
        torch.ops.aten.is_nonzero,
        torch.ops.aten.equal,
        torch.ops.aten.masked_select,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in self.FORBIDDEN:
            raise AssertionError(f"host read in the tick: {func}")
        if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_):
            # Boolean-mask indexing runs nonzero inside the kernel (hidden from this mode).
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                raise AssertionError(f"host read in the tick (boolean-mask indexing): {func}")
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
            src = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
            dst_device = args[0].device if func.overloadpacket is torch.ops.aten.copy_ else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None \
                    and torch.device(dst_device).type == "cpu":
                raise AssertionError(f"device->host copy in the tick: {func}")
        return func(*args, **kwargs)


class HostReadOrUpload(TorchFunctionMode):
    """Rejects what cannot run inside CUDA graph capture without a host sync: reading tensor
    values into Python, tensors from host data (a host->device copy on CUDA), data-dependent
    shapes (nonzero / boolean indexing) and copies to the host."""

    FORBIDDEN = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "tensor", "as_tensor",
                 "from_numpy", "nonzero", "masked_select", "cpu", "numpy", "unique"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.FORBIDDEN:
            raise AssertionError(f"capture hazard: {name}")
        if name == "__getitem__" and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                raise AssertionError("capture hazard: boolean-mask indexing")
        return func(*args, **(kwargs or {}))
