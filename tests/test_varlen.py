"""torch's own varlen FlashAttention for packed documents (finetune/internals/varlen.py): the decision, fed the facts
of GPUs, of torch's two forms of the function and of models; and the plumbing, fed a CPU reference of the kernel
(torch's runs on CUDA only) that computes each document apart from the same cumulative lengths: the model's logits
and gradients over a batch of packed documents are the stock model's on each document run alone."""

import functools

import pytest
import torch
from helpers import FAMILIES, SIZES, base_args, build, cpu_process, data_args, documents_of, load_script, results
from test_hardware import A100, CPU, H100, T4
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from finetune import data, hardware
from finetune.internals import demo, varlen


def window_form(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.12 on: causal is window_size (-1, 0)."""
    assert window_size[1] == 0 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == int(cu_seq_q.diff().max())
    assert query.dtype == key.dtype == value.dtype  # FlashAttention takes one dtype
    return varlen.documents_apart(query, key, value, cu_seq_q, scale=scale, left=window_size[0], gqa=enable_gqa)


def causal_form(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10/2.11: is_causal, the default scale, one head count."""
    assert is_causal and key.shape[1] == query.shape[1] and torch.equal(cu_seq_q, cu_seq_k)
    assert query.dtype == key.dtype == value.dtype
    return varlen.documents_apart(query, key, value, cu_seq_q)


def test_torch_varlen_is_chosen_from_the_gpu_torchs_form_and_the_models_facts():
    """An Ampere+ GPU in 16 bits, torch's varlen of either form, a model that fits it: torch_varlen, unless the
    flash-attn package is installed (its kernel, as before); a sliding window only on the 2.12+ form; never for
    softcapping (Gemma 2), sinks (gpt-oss), heads over 256 wide, on a T4, a CPU or in fp32."""
    from torch.nn.attention.varlen import varlen_attn

    assert varlen.form(varlen_attn) == "window" and varlen.form(causal_form) == "is_causal"
    assert varlen.form(None) is None and varlen.form(lambda q, k, v: q) is None
    config = lambda family, **more: getattr(__import__("transformers"), FAMILIES[family][0])(
        **{**SIZES, **FAMILIES[family][1], **more}
    )
    facts = lambda cfg: varlen.model_facts(cfg, AutoModelForCausalLM._model_mapping[type(cfg)])
    llama, mistral, gemma2, gpt_oss = (config(f) for f in ("llama", "mistral", "gemma2", "gpt_oss"))
    choose = lambda gpu, kernel_form, cfg, precision="bf16", flash=False: hardware.attention(
        gpu, precision, flash, True, None, torch_varlen=varlen.fits(kernel_form, **facts(cfg))
    )
    for kernel_form in ("window", "is_causal"):
        assert choose(H100, kernel_form, llama) == choose(A100, kernel_form, llama) == "torch_varlen"  # GQA too
        assert choose(H100, kernel_form, llama, flash=True) == "flash_attention_2"
        assert choose(T4, kernel_form, llama) is None and choose(CPU, kernel_form, llama) is None
        assert choose(H100, kernel_form, llama, precision="fp32") is None
        assert choose(H100, kernel_form, gemma2) is None and choose(H100, kernel_form, gpt_oss) is None
        assert choose(H100, kernel_form, config("llama", head_dim=512)) is None
    assert choose(H100, "window", mistral) == "torch_varlen" and choose(H100, "is_causal", mistral) is None
    assert choose(H100, None, llama) is None  # a torch without varlen_attn
    assert facts(mistral)["window"] and not facts(llama)["window"] and facts(gemma2)["softcap"]
    assert facts(gpt_oss)["sinks"] and facts(llama)["interface"]
    opt = AutoConfig.for_model("opt", attention_dropout=0.1)
    assert not varlen.fits("window", **facts(opt))  # the kernel has no dropout
    assert facts(AutoConfig.for_model("gpt2"))["dropout"] == 0.1  # GPT-2 names it attn_pdrop
    deepseek = AutoConfig.for_model("deepseek_v3")  # MLA: keys of 192, values of 128
    assert facts(deepseek)["uneven_heads"] and not varlen.fits("window", **facts(deepseek))
    assert not varlen.fits("window", **facts(AutoConfig.for_model("mamba")))  # no attention heads: nothing fits


@pytest.fixture(scope="module")
def corpora(tiny, tmp_path_factory):
    """The tests' tokenizer; chats and preference pairs to pack."""
    root = tmp_path_factory.mktemp("varlen")
    demo.make_demo_pairs(root / "pairs.jsonl", n=24, seed=3, style="strings")
    return {
        "tokenizer": AutoTokenizer.from_pretrained(tiny["model"]),
        "chats": tiny["chats"],
        "pairs": str(root / "pairs.jsonl"),
        "root": root,
        "opt": tiny["model"],
    }


@pytest.mark.parametrize(
    "family, kernel",
    [
        ("llama", window_form),
        ("llama", causal_form),
        ("mistral", window_form),
        ("opt", causal_form),
        ("opt", window_form),
    ],
)
@pytest.mark.parametrize("corpus", ["chats", "pairs"])
def test_packed_documents_through_varlen_are_the_documents_run_apart(corpora, monkeypatch, family, kernel, corpus):
    """A batch of packed documents (chats; preference pairs, whose rejected answers get their prompt back) through
    the varlen attention: the logits and every parameter's gradient of the stock model (SDPA) run on each document
    alone, to 1e-5 (the gradients: all of them, by norm). Llama: grouped key/value heads (4 and 2; repeated for
    the 2.10/2.11 form); Mistral: a 16-token sliding window over longer documents; OPT: a model that scales its
    queries itself (scaling 1, pre-multiplied for the 2.10/2.11 form, which takes no scale)."""
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, varlen.NAME, varlen.attention(kernel))
    folder = corpora["opt"] if family == "opt" else corpora["root"] / family
    if family != "opt" and not folder.exists():
        build(family, corpora["tokenizer"], folder, max_position_embeddings=256)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    packed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=varlen.NAME)
    tokenizer = corpora["tokenizer"] if corpus == "chats" else None
    settings = data_args(corpora[corpus], block_size=128 if family != "opt" else 64)
    split, _ = data.prepare(settings, tokenizer or AutoTokenizer.from_pretrained(folder), seed=0)
    rows = [i for i in range(len(split)) if len(documents_of(split, i)) >= 2][:3]  # blocks of several documents
    inputs, _ = split.batch(rows, cpu_process(0, packed.config))
    cu = inputs["cu_seq_lens_q"]
    assert "attention_mask" not in inputs and len(cu) > 4 and int(cu.diff().max()) > 16  # several documents, long
    logits = packed(**inputs).logits[0]
    weights = torch.randn_like(logits)
    (logits * weights).sum().backward()
    ids, positions = inputs["input_ids"][0], inputs["position_ids"][0]
    apart = []
    for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        alone = stock(input_ids=ids[None, a:b], position_ids=positions[None, a:b]).logits[0]
        (alone * weights[a:b]).sum().backward()
        apart.append(alone)
    torch.testing.assert_close(logits, torch.cat(apart), rtol=1e-5, atol=1e-5)
    grads = [(p.grad.flatten(), q.grad.flatten()) for p, q in zip(packed.parameters(), stock.parameters())]
    ours, theirs = (torch.cat(g) for g in zip(*grads))  # to fp32's rounding of the sums (a key bias's is 0 by math)
    assert (ours - theirs).norm() <= 1e-5 * theirs.norm() and theirs.norm() > 0


def test_a_run_through_torch_varlen_trains_as_the_masked_one(tiny, tmp_path, monkeypatch):
    """single-gpu.py with torch_varlen chosen (the reference kernel standing in for torch's CUDA one): the batches in
    the varlen layout through the chunked loss, the eval and the sample at the end (no boundaries there: SDPA, causal)
    train as SDPA with the documents' mask does, to fp32's rounding."""
    single = load_script("single-gpu.py")
    argv = lambda out: base_args(
        tiny, tmp_path / out, **{"--dataset": tiny["chats"], "--block-size": 64, "--batch-size": 4, "--prompt": "Hi"}
    )
    single.main(argv("sdpa"))
    monkeypatch.setattr(hardware, "attention", lambda *facts, **more: varlen.NAME)
    calls = []
    counted = functools.wraps(window_form)(lambda *a, **k: calls.append(1) or window_form(*a, **k))
    monkeypatch.setattr(varlen, "torch_kernel", lambda: counted)
    single.main(argv("varlen"))
    masked, packed = results(tmp_path / "sdpa"), results(tmp_path / "varlen")
    torch.testing.assert_close(packed["losses"], masked["losses"], rtol=1e-5, atol=0)
    assert packed["eval_loss"] == pytest.approx(masked["eval_loss"], rel=1e-5) and packed["sample"]
    assert len(calls) >= 2 * 4  # every layer of every step


@pytest.mark.parametrize("kernel", [window_form, causal_form])
def test_under_autocast_the_kernel_gets_one_16_bit_dtype(corpora, monkeypatch, kernel):
    """single-gpu.py's bf16 is autocast over fp32 weights: Llama's rotary embeddings leave queries and keys in fp32
    beside 16-bit values, and torch's kernel (a custom op) has no autocast rule. They reach it in bf16, all three
    (the reference kernels check), and the logits are the stock model's on each document alone under the same
    autocast, to bf16's rounding."""
    from transformers import AttentionInterface

    seen = []
    kernel_seen = functools.wraps(kernel)(lambda q, *a, **k: seen.append(q.dtype) or kernel(q, *a, **k))
    monkeypatch.setitem(AttentionInterface._global_mapping, varlen.NAME, varlen.attention(kernel_seen))
    folder = corpora["root"] / "llama"
    if not folder.exists():
        build("llama", corpora["tokenizer"], folder, max_position_embeddings=256)
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    packed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=varlen.NAME)
    split, _ = data.prepare(data_args(corpora["chats"], block_size=128), corpora["tokenizer"], seed=0)
    rows = [i for i in range(len(split)) if len(documents_of(split, i)) >= 2][:3]
    inputs, _ = split.batch(rows, cpu_process(0, packed.config))
    cu, ids, positions = inputs["cu_seq_lens_q"], inputs["input_ids"][0], inputs["position_ids"][0]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        logits = packed(**inputs).logits[0].float()
        apart = torch.cat(
            [
                stock(input_ids=ids[None, a:b], position_ids=positions[None, a:b]).logits[0].float()
                for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])
            ]
        )
    assert set(seen) == {torch.bfloat16} and len(seen) == 2  # both layers, in bf16
    torch.testing.assert_close(logits, apart, rtol=0.05, atol=0.05)
