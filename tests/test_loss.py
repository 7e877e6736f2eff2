"""The chunked loss equals the plain cross-entropy, loss and gradients, for OPT, GPT-2 and Llama (tied and untied
heads), with padding and masked labels; and it never holds all the logits at once."""

import pytest
import torch
from helpers import cpu_process, data_args
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, OPTConfig

from finetune import data, loss

pytestmark = pytest.mark.quick  # in process: `make test-quick`

ARCHITECTURES = {
    "opt (tied)": lambda v: OPTConfig(
        vocab_size=v,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=32,
        dropout=0.0,
    ),
    "gpt2 (tied)": lambda v: GPT2Config(
        vocab_size=v, n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ),
    "llama (untied)": lambda v: LlamaConfig(
        vocab_size=v,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "llama (tied)": lambda v: LlamaConfig(
        vocab_size=v,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module")
def chats(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    train, _ = data.prepare(data_args(tiny["chats"], block_size=256), tokenizer, seed=0)
    return train, tokenizer


def gradients(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_chunked_loss_and_gradients_equal_the_plain_cross_entropy(chats, name):
    train, tokenizer = chats
    torch.manual_seed(0)
    config = ARCHITECTURES[name](len(tokenizer))
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    chunked = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    chunked.load_state_dict(plain.state_dict())
    chunked = loss.CausalLMLoss(chunked, chunk_tokens=37)  # several chunks, the last one short
    # four blocks of unequal length: padding at the ends, the prompts' labels masked
    rows = sorted(range(len(train)), key=lambda i: train.lengths[i])[:: len(train) // 4][:4]
    inputs, labels = train.batch(rows, cpu_process(tokenizer.pad_token_id, chunked.config))
    assert (labels[0] == -100).float().mean() > 0.5 and inputs["input_ids"].shape[0] == 4

    logits = plain(**inputs).logits  # the model's own forward: all the logits
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[0].flatten(), reduction="sum")
    (reference / 3).backward()  # as training scales it: by the count of tokens that carry loss
    mine = chunked(inputs, labels).loss
    (mine / 3).backward(retain_graph=True)
    assert mine.item() == pytest.approx(reference.item(), rel=1e-6)
    want, got = gradients(plain), gradients(chunked)
    assert want.keys() == got.keys()
    largest = max(g.abs().max().item() for g in want.values())
    for n in want:  # relative to the parameter's own gradient (k_proj's bias has none: softmax ignores it)
        scale = max(want[n].abs().max().item(), 1e-9 * largest)
        assert (want[n] - got[n]).abs().max().item() <= 1e-6 * scale, n
    with pytest.raises(RuntimeError, match="modified by an inplace"):  # the saved gradients were scaled in place
        mine.backward()


def test_plain_path_and_generation_are_the_models_own(chats):
    """The loss is a module around the model, which keeps its own forward (generate is the stock one) and its state
    dict's names: checkpoints, final/ and adapters written before the loss was a module load as they were."""
    train, tokenizer = chats
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ARCHITECTURES["opt (tied)"](len(tokenizer)))
    before = model.generate(torch.tensor([[2, 5, 6]]), max_new_tokens=4, do_sample=False)
    names = list(model.state_dict())
    trained = loss.CausalLMLoss(model, chunk_tokens=0)
    assert "forward" not in vars(model) and trained.causal_lm is model  # no forward put on the model
    assert model.generate(torch.tensor([[2, 5, 6]]), max_new_tokens=4, do_sample=False).equal(before)
    inputs, labels = train.batch([0, 1], cpu_process(tokenizer.pad_token_id, model.config))
    with torch.no_grad():
        logits = model(**inputs).logits
        plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[0].flatten(), reduction="sum")
        assert trained(inputs, labels).loss.item() == pytest.approx(plain.item(), rel=1e-6)
    # the names a checkpoint holds, and the tensors: the model's own
    assert list(trained.state_dict()) == names and "model.decoder.embed_tokens.weight" in names
    assert [n for n, _ in trained.named_parameters()] == [n for n, _ in model.named_parameters()]
    trained.load_state_dict(model.state_dict())
    trained.eval()
    assert not model.training and not model.model.decoder.training


class LargestLogits(TorchDispatchMode):
    """The largest tensor of logits (last dimension: the vocabulary) any operation makes, by number of elements."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 32])
def test_the_logits_of_all_tokens_never_exist_at_once(chats, chunk):
    """In chunks, the largest tensor of forward and backward is one chunk's logits, not (tokens x vocabulary)."""
    train, tokenizer = chats
    torch.manual_seed(0)
    vocab = len(tokenizer)
    model = loss.CausalLMLoss(AutoModelForCausalLM.from_config(ARCHITECTURES["llama (untied)"](vocab)), chunk)
    inputs, labels = train.batch(list(range(4)), cpu_process(tokenizer.pad_token_id, model.config))
    tokens = inputs["input_ids"].numel()
    with LargestLogits(vocab) as seen:
        model(inputs, labels).loss.backward()
    if chunk:
        assert seen.largest == chunk * vocab  # one chunk's logits (and their gradient, in place)
    else:  # the plain path: every position's logits
        assert seen.largest == tokens * vocab
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


class MatmulFlops(TorchDispatchMode):
    """2·m·k·n for every matrix product (mm, addmm and in place), and each product's output shape."""

    def __init__(self):
        super().__init__()
        self.flops, self.shapes = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[-2:] if name != "mm" else args[:2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.shapes.append(tuple(out.shape))
        return out


def test_a_frozen_head_gets_no_gradient_work(chats):
    """LoRA freezes the head: the loss then makes no (vocabulary x hidden) gradient for it, a third of its matmuls;
    the hidden states' gradient, all the adapters need, is the same."""
    train, tokenizer = chats
    torch.manual_seed(0)
    model = loss.CausalLMLoss(AutoModelForCausalLM.from_config(ARCHITECTURES["llama (untied)"](len(tokenizer))), 32)
    inputs, labels = train.batch(list(range(4)), cpu_process(tokenizer.pad_token_id, model.config))
    head = model.lm.get_output_embeddings().weight
    hidden_grads, counts = {}, {}
    for frozen in (False, True):
        head.requires_grad_(not frozen)
        model.zero_grad()
        with MatmulFlops() as counts[frozen]:
            model(inputs, labels).loss.backward()
        hidden_grads[frozen] = model.model.norm.weight.grad.clone()  # through the hidden states
        assert (head.grad is None) == frozen
    tokens, (vocab, hidden) = len(labels[1]), head.shape
    assert counts[False].flops - counts[True].flops == 2 * tokens * vocab * hidden  # the head's weight gradient
    assert tuple(head.shape) in counts[False].shapes and tuple(head.shape) not in counts[True].shapes
    assert torch.equal(hidden_grads[False], hidden_grads[True])
