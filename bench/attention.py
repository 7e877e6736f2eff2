"""Attention alone, forward and backward, over blocks of packed documents: what each way of keeping the documents
apart costs against attention that does not (bench/gpu.py runs it first, within its budget).

    python3 bench/attention.py          # a CUDA GPU, bf16: out/gpu/ATTENTION.md, and $OUT/ATTENTION.md where set
    python3 bench/attention.py --dry    # the CPU, fp32, a small shape: the rows a CPU can run, in seconds

Rows, over the same queries, keys and values: SDPA with the documents' block-diagonal causal mask (isolated packing
without a varlen kernel: SDPA's flash kernel takes no mask); torch's varlen FlashAttention through
finetune.internals.varlen's attention function (what --attention auto picks on Ampere+ without flash-attn);
flash-attn's varlen function, where installed; SDPA causal without a mask (stream packing's attention: each row one
sequence, so another output).
Columns: the median milliseconds of a forward and a backward, the ratio of SDPA causal's time to it (above 1: faster
than attention that keeps no documents apart), and the largest difference of its output from each document run
apart in fp32 (varlen.documents_apart). Shapes: 16 x 512 and 8 x 2048 tokens with OPT-125m's heads (12 of 64) and
Llama-3.2-1B's (32 queries, 8 keys and values, 64 wide); documents of 32 to half a row (a fixed seed) fill each row.
"""

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu import keep  # noqa: E402

from finetune.internals import varlen  # noqa: E402

SHAPES, HEADS = [(16, 512), (8, 2048)], {"OPT-125m": (12, 12, 64), "Llama-3.2-1B": (32, 8, 64)}
DRY_SHAPES, DRY_HEADS = [(2, 128)], {"tiny, GQA": (4, 2, 16)}
MASKED, VARLEN, FLASH, CAUSAL = (
    "SDPA, the documents' mask",
    "torch varlen",
    "flash-attn varlen",
    "SDPA causal, no mask",
)


def documents(rows, width, generator):
    """Cumulative lengths (int32) of documents of 32 to width/2 tokens filling `rows` rows of `width` end to end,
    each row's last document cut at the row's end."""
    lengths = []
    for _ in range(rows):
        left = width
        while left:
            lengths.append(min(left, int(torch.randint(32, width // 2 + 1, (1,), generator=generator))))
            left -= lengths[-1]
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def documents_mask(cu, rows, width):
    """(rows, 1, width, width), True where a token sees another: its own document's, up to itself."""
    starts = torch.zeros(rows * width, dtype=torch.long)
    starts[cu[1:-1].long()] = 1
    document = starts.cumsum(0).view(rows, width)
    at = torch.arange(width)
    return ((document[:, :, None] == document[:, None, :]) & (at[:, None] >= at[None, :]))[:, None]


def by_rows(fn, rows, width):
    """fn over (rows, heads, width, head size), from and back to (tokens, heads, head size)."""

    def run(q, k, v):
        out = fn(*(x.view(rows, width, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v)))
        return out.transpose(1, 2).reshape(q.shape)

    return run


def kernels(cu, rows, width, device, torch_kernel):
    """{row's name: its attention over (tokens, heads, head size), or why it cannot run here}."""
    mask, longest = documents_mask(cu, rows, width).to(device), int(cu.diff().max())
    cu = cu.to(device)
    found = {
        MASKED: by_rows(
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1]
            ),
            rows,
            width,
        )
    }
    if torch_kernel is None:
        found[VARLEN] = "not in this torch" if device.type == "cuda" else "CUDA only"
    else:
        through = varlen.attention(torch_kernel)  # as the model calls it: (1, heads, tokens, head size) in
        found[VARLEN] = lambda q, k, v: through(
            None,
            *(x.transpose(0, 1)[None] for x in (q, k, v)),
            None,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
        )[0][0]
    try:
        from flash_attn import flash_attn_varlen_func

        found[FLASH] = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
    except ImportError:
        found[FLASH] = "not installed"
    found[CAUSAL] = by_rows(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]),
        rows,
        width,
    )
    return found


def timed(fn, inputs, grad, repeats):
    """Median milliseconds of fn's forward and backward (three calls first, to warm up), and its output."""
    sync = torch.cuda.synchronize if grad.is_cuda else (lambda: None)
    times = []
    for _ in range(3 + repeats):
        for x in inputs:
            x.grad = None
        sync()
        start = time.perf_counter()
        out = fn(*inputs)
        out.backward(grad)
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times[3:]), out.detach()


def main(argv=None, torch_kernel=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="the CPU, fp32, a small shape")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "out" / "gpu"))
    args = p.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; bench/attention.py --dry runs on the CPU")
    device = torch.device("cpu" if args.dry else "cuda")
    dtype = torch.float32 if args.dry else torch.bfloat16
    torch_kernel = torch_kernel or (None if args.dry else varlen.torch_kernel())
    generator, rows = torch.Generator().manual_seed(0), []
    for (name, (heads, kv_heads, size)), (batch, width) in itertools.product(
        (DRY_HEADS if args.dry else HEADS).items(), DRY_SHAPES if args.dry else SHAPES
    ):
        cu = documents(batch, width, generator)
        q, k, v = (
            torch.randn(batch * width, h, size, generator=generator).to(device, dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)
        )
        grad = torch.randn(q.shape, generator=generator).to(device, dtype)
        apart = varlen.documents_apart(*(x.detach().float() for x in (q, k, v)), cu.to(device), gqa=kv_heads != heads)
        found = kernels(cu, batch, width, device, torch_kernel)
        for attention, fn in found.items():
            row = {"heads": name, "shape": f"{batch} x {width}", "attention": attention, "documents": len(cu) - 1}
            rows.append(row)
            if isinstance(fn, str):
                row["status"] = fn
                continue
            row["ms"], out = timed(fn, (q, k, v), grad, args.repeats)
            row["difference"] = None if attention == CAUSAL else (out.float() - apart).abs().max().item()
            row["status"] = "ok"
        causal = rows[-1].get("ms")
        for row in rows[-len(found) :]:
            row["x_causal"] = causal / row["ms"] if row.get("ms") and causal else None
    keep(
        report(rows, torch.cuda.get_device_name() if not args.dry else "CPU, dry run", dtype),
        Path(args.out) / "ATTENTION.md",
    )
    return rows


def report(rows, device, dtype):
    lines = [
        f"Attention alone, forward and backward; {device}, {str(dtype).removeprefix('torch.')}; "
        f"{time.strftime('%Y-%m-%d')}",
        "",
        "| heads | rows x tokens | documents | attention | ms | x SDPA causal | largest difference from each "
        "document apart | status |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        cells = [
            r["heads"],
            r["shape"],
            str(r["documents"]),
            r["attention"],
            f"{r['ms']:.3f}" if r.get("ms") else "-",
            f"{r['x_causal']:.2f}x" if r.get("x_causal") else "-",
            f"{r['difference']:.1e}" if r.get("difference") is not None else "-",
            r["status"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
