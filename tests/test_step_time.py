"""A profiled step's time by kind (finetune/internals/step_time.py; bench/gpu.py's profile table): a GPU's profile
given as torch's profiler gives it (FunctionEvents, their tree made by torch's own EventList), with the kernels an H100
runs, and a real CPU profile of a training step."""

import pytest
import torch
from helpers import SIZES
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from finetune.internals import step_time

VOCABULARY = 128256  # Llama-3.2-1B's


def event(name, start, end, device=DeviceType.CPU, shapes=(), annotation=False, id=0, linked=0):
    return FunctionEvent(
        id=id,
        name=name,
        thread=1,
        start_us=start,
        end_us=end,
        fwd_thread=1,
        input_shapes=list(shapes),
        stack=[],
        scope=0,
        device_type=device,
        is_user_annotation=annotation,
        linked_correlation_id=linked,
    )


def gpu_profile():
    """(events, {kernel: kind}) of one step as torch.profiler lists it on an H100: ops on the host, each with the
    kernels it launched (torch's correlation: FunctionEvent.kernels), and the device's events with their times."""
    ops, device, kinds, at = [], [], {}, 100.0
    launches = [  # (op and its ancestors, outermost first; the op's shapes; its kernel; the kernel's us; kind)
        (
            ["aten::linear", "aten::matmul", "aten::mm"],
            [[8192, 2048], [2048, 2048]],
            "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT",
            100,
            "matmuls",
        ),
        (
            ["aten::mm"],
            [[4096, 2048], [2048, VOCABULARY]],
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel"
            "__5x_cublas",
            300,
            "head, loss and embedding",
        ),
        (
            ["aten::logsumexp"],
            [[4096, VOCABULARY]],
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float,"
            " at::native::func_wrapper_t<float, at::native::MaxNanFunctor<float>>>>",
            12,
            "head, loss and embedding",
        ),
        (
            [
                "aten::scaled_dot_product_attention",
                "aten::_scaled_dot_product_flash_attention",
                "aten::_flash_attention_forward",
            ],
            [[16, 32, 512, 64]] * 3,
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
            "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>, false, true, false>"
            "(pytorch_flash::Flash_fwd_params)",
            50,
            "attention",
        ),
        (
            ["aten::mul"],
            [[16, 512, 2048], []],
            "void at::native::vectorized_elementwise_kernel<4, "
            "at::native::AUnaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::"
            "MulFunctor<float>>, std::array<char*, 2ul>>(int, at::native::AUnaryFunctor<...>, std::array<char*, 2ul>)",
            10,
            "norms and element-wise",
        ),
        (["aten::copy_"], [[2048], [2048]], "Memcpy HtoD (Pinned -> Device)", 3, "norms and element-wise"),
        (
            ["Optimizer.step#AdamW.step", "aten::_fused_adamw_"],
            [],
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
            "(at::native::ADAM_MODE)1, false>>",
            20,
            "optimizer",
        ),
        (
            ["nccl:all_reduce"],
            [[1048576]],
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            5,
            "communication",
        ),
    ]
    clock = 0.0
    for names, shapes, kernel, us, kind in launches:
        for depth, name in enumerate(names):  # nested ranges on the host, each op with its correlation id
            last = depth == len(names) - 1
            ops.append(
                event(
                    name,
                    clock + depth,
                    clock + 20 - depth,
                    shapes=shapes if last else (),
                    annotation=name.startswith(("Optimizer.step", "nccl:")),
                    id=len(ops) + 1,
                )
            )
        ops[-1].append_kernel(kernel, 0, us)
        device.append(event(kernel, at, at + us, DeviceType.CUDA, linked=ops[-1].id))
        kinds[kernel] = kind
        clock, at = clock + 25, at + us + 2  # 2 us idle after each kernel
    # an inductor kernel: a range named as its kernel around the runtime's launch (torch links the kernel to it)
    triton = "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0"
    ops += [event(triton, clock, clock + 10, id=100), event("cuLaunchKernel", clock + 1, clock + 9, id=7, linked=100)]
    ops[-2].append_kernel(triton, 0, 8)
    device.append(event(triton, at, at + 8, DeviceType.CUDA, id=7, linked=100))
    kinds[triton] = "norms and element-wise"
    # a kernel no op launched (a library's own): its name alone
    device.append(event("Memset (Device)", at + 10, at + 11, DeviceType.CUDA))
    kinds["Memset (Device)"] = "norms and element-wise"
    # the optimizer's range also comes as a GPU annotation spanning its kernels, linked to the range: no kernel
    step = next(e for e in ops if e.name.startswith("Optimizer.step"))
    step.append_kernel(step.name, 0, 30)
    adam = next(d for d in device if "Adam" in d.name)
    start, end = adam.time_range.start - 5, adam.time_range.end + 5
    device.append(event(step.name, start, end, DeviceType.CUDA, annotation=True, linked=step.id))
    events = EventList(ops + device)
    events._populate_cpu_children()  # torch's own tree of the host's ops (what profile.events() has done)
    return events, kinds


@pytest.mark.parametrize("linked", [True, False], ids=["linked", "by-name-and-duration"])
def test_a_gpu_steps_kernels_go_to_their_kinds_and_idle_is_the_gaps_between_them(linked):
    """Each device event once, by the op that launched it (found by torch's linked correlation id, or where a torch
    has none by the op's .kernels), the annotation neither a kernel nor busy time; idle: the gaps."""
    events, kinds = gpu_profile()
    if not linked:
        for e in events:
            e.linked_correlation_id = 0
    found = step_time.of_events(events, steps=2, vocabulary=VOCABULARY)
    expected = {k: {"ms": 0.0, "kernels": 0.0} for k in step_time.KINDS}
    for e in events:
        if e.device_type == DeviceType.CUDA and e.name in kinds:
            expected[kinds[e.name]]["ms"] += e.time_range.elapsed_us() / 1e3 / 2
            expected[kinds[e.name]]["kernels"] += 1 / 2
    for k in step_time.KINDS:
        assert found[k] == pytest.approx(expected[k], abs=1e-12), k
    busy = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA and e.name in kinds)
    gaps = 2.0 * (len(kinds) - 2) + 2.0  # 2 us after each kernel but the last two, then 2 us to the memset
    assert found["idle_ms"] == pytest.approx(gaps / 1e3 / 2) and found["step_ms"] == pytest.approx((busy + gaps) / 2e3)
    assert sum(found[k]["kernels"] for k in step_time.KINDS) == len(kinds) / 2  # the annotation is no kernel


def test_a_cpu_profile_of_training_steps_gives_each_op_its_kind():
    """A real CPU profile of two steps of a 2-layer Llama (forward, backward, torch's fused AdamW): each op by its
    kind, per step: every linear layer's matmul (7 a layer: 1 forward and 2 backward mm each), the head's apart with
    the loss and the embedding, the attention's, the optimizer's; the kinds' own times add up to the busy time."""
    import collections

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, attn_implementation="sdpa", **SIZES)  # the suite's tiny sizes, 2 layers
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, 96, (2, 24))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    events = [e for e in profile.events() if not e.is_user_annotation]
    by_kind = collections.defaultdict(collections.Counter)
    for e in events:
        by_kind[step_time.kind(e.name, step_time._context(e), e.input_shapes, 96)][e.name] += 0.5
    # (aten::linear over aten::matmul, or after a ZeRO-3 engine in this process DeepSpeed's memory-efficient linear,
    # which stays as torch.nn.functional.linear: aten::matmul, forward and backward)
    assert by_kind["matmuls"]["aten::mm"] == 42 and set(by_kind["matmuls"]) <= {
        "aten::linear",
        "aten::matmul",
        "aten::mm",
    }
    head = by_kind["head, loss and embedding"]
    assert (head["aten::mm"], head["aten::nll_loss_forward"], head["aten::embedding_dense_backward"]) == (3, 1, 1)
    attention = by_kind["attention"]
    assert attention["aten::_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert attention["aten::_scaled_dot_product_flash_attention_for_cpu_backward"] == 2
    assert by_kind["optimizer"]["aten::_fused_adamw_"] == 1 and not by_kind["communication"]
    found = step_time.of_events(profile.events(), steps=2, vocabulary=96)
    own = sum(e.self_cpu_time_total for e in events) / 1e3 / 2
    assert sum(found[k]["ms"] for k in step_time.KINDS) == pytest.approx(own)
    assert found["step_ms"] - found["idle_ms"] == pytest.approx(own) and found["idle_ms"] > 0
