"""Count the bytes of model state a rank holds: what plan.py plans, measured.

Parameters (under ZeRO-3 their shards), gradients, the optimizer's state and every buffer DeepSpeed keeps for them
(flat 16-bit copies, fp32 masters, gradient partitions, reduce buckets, offload staging), each storage counted
once at its full size: a view into a flat buffer adds nothing. Found by walking the objects the engine and the
optimizer hold, not the garbage collector (which misses gradients never read from Python, and sees activations).
"""
import collections
import dataclasses
import enum
import types

import torch

_TENSOR_ATTRIBUTES = ("ds_tensor", "ds_secondary_tensor", "grad_accum", "cpu_data", "SCB")
_SKIP = {"training_dataloader", "training_data", "data_sampler", "lr_scheduler", "timers", "monitor",
         "dp_process_group", "real_dp_process_group", "ds_process_group", "mpu", "_forward_hooks",
         "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_grad_acc_hooks"}
_ATOMS = (str, bytes, int, float, bool, complex, type(None), enum.Enum, type, types.FunctionType, types.MethodType,
          types.BuiltinFunctionType, types.ModuleType, torch.dtype, torch.device)
_WALK_MODULES = ("deepspeed", "torch.optim", "collections", "bitsandbytes")


def held_bytes(model, optimizer):
    """Bytes of tensor storage reachable from the model and its optimizer (a DeepSpeed engine and its optimizer,
    or a module and a torch optimizer), each storage once."""
    storages, seen = {}, set()
    stack = [optimizer, getattr(model, "optimizer", None), getattr(model, "basic_optimizer", None),
             getattr(model, "module", model)]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and obj.untyped_storage().nbytes():
                storage = obj.untyped_storage()
                storages[(obj.device, storage.data_ptr())] = storage.nbytes()
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            stack += [getattr(obj, a) for a in _TENSOR_ATTRIBUTES if isinstance(getattr(obj, a, None), torch.Tensor)]
            stack.append(getattr(obj, "nvme_swapper", None))  # NVMe offload: its pinned swap buffers
            stack.append(getattr(obj, "quant_state", None))  # a 4-bit weight's scales
        elif isinstance(obj, torch.nn.Module):
            stack += [*obj._parameters.values(), *obj._buffers.values(), *obj._modules.values()]
            stack.append(vars(obj).get("state"))  # an 8-bit layer's int8 weights and scales
        elif isinstance(obj, dict):
            stack += [v for k, v in obj.items() if k not in _SKIP]
            stack += [k for k in obj if isinstance(k, torch.Tensor)]  # torch optimizers key their state by tensor
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack += list(obj)
        elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith(_WALK_MODULES):
            stack += [v for k, v in vars(obj).items() if k not in _SKIP] if hasattr(obj, "__dict__") else []
    return sum(storages.values())
