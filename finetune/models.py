"""The model: loading it (one line when it cannot), LoRA adapters, saving it in Hugging Face format (merged, and
the adapter), the sample answer at the end, and the bytes of model state each rank holds."""
import copy
import time
from pathlib import Path

import torch

from . import hardware, long_sequences, loss, preference, quantization
from .base import fail
from .internals import varlen

# The architectures (config.model_type) the tests train under ZeRO-3 on 2 ranks against one process (tests/
# test_models.py, which writes docs/models.md); others are not refused, only said to be untested.
TESTED = ("opt", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2", "mixtral",
          "qwen3_moe", "olmoe", "gpt_oss")


def notes(model):
    """What the run does differently for this model, or did not test, in a few words each (said once, at start)."""
    from . import loss

    net = loss.causal_lm(model)
    net = net.get_base_model() if hasattr(net, "get_base_model") else net
    config, said = net.config, []
    logits = loss.postprocessed_logits(config)
    if logits:
        said.append(f"the plain loss (its logits are post-processed: {logits})")
    if config._attn_implementation == "eager" and not getattr(net, "_supports_sdpa", True):
        said.append(f"eager attention ({type(net).__name__} has no SDPA)")
    if config.model_type not in TESTED:
        said.append(f"{config.model_type} is not among the architectures tested (docs/models.md)")
    return said


def load_pretrained(loader, name, **kwargs):
    """loader.from_pretrained(name), with one line saying what to do when it cannot (no weights, unknown id,
    offline)."""
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if Path(name).is_dir():
            fail(f"cannot load {name} ({first}); a model folder needs config.json, the weights (model.safetensors) "
                 f"and the tokenizer files, as save_pretrained writes them")
        fail(f"cannot load {name!r}: it is not a local folder, and the hub did not give it ({first}); check the id, "
             f"the network (HF_HUB_OFFLINE), or HF_TOKEN in the environment for a gated model")


def load_causal_lm(settings, config, device):
    """The model to fine-tune, in fp32 (the master weights; 16-bit copies are the engine's or autocast's; a LoRA base
    in the run's precision), with the attention implementation this hardware runs fastest (hardware.attention).
    `settings`: flags.Model, its precision resolved."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_flash_attn_2_available

    architecture = AutoModelForCausalLM._model_mapping.get(type(config), None) if not settings.trust_remote_code \
        else None
    kernel = varlen.torch_kernel()
    fits = device.type == "cuda" and varlen.fits(varlen.form(kernel), **varlen.model_facts(config, architecture))
    implementation = hardware.attention(hardware.facts(device), settings.precision, is_flash_attn_2_available(),
                                        getattr(architecture, "_supports_flash_attn", False),
                                        getattr(architecture, "_compatible_flash_implementations", None),
                                        torch_varlen=fits)
    if settings.attention != "auto":  # the user's choice, where it can run at all
        implementation = settings.attention
        if implementation == "flash_attention_2" and not is_flash_attn_2_available():
            fail("--attention flash_attention_2: the flash-attn package is not installed here (pip install "
                 "flash-attn), or this is no CUDA GPU; use --attention auto")
        if implementation == varlen.NAME and (varlen.form(kernel) is None or device.type != "cuda"):
            fail(f"--attention {varlen.NAME}: torch's varlen FlashAttention needs torch 2.10 or later and an NVIDIA "
                 f"GPU (this is torch {torch.__version__} on {device.type}); use --attention auto")
        if implementation == varlen.NAME and (not fits or settings.precision not in hardware.AUTOCAST_DTYPES):
            fail(f"--attention {varlen.NAME}: this model or precision does not fit torch's varlen kernel (16 bits; "
                 f"no softcapping, sinks or attention dropout; heads of at most 256; a sliding window from torch "
                 f"2.12); use --attention auto")
    if implementation == varlen.NAME:
        varlen.register(kernel)
    extra = {"attn_implementation": implementation} if implementation else {}
    experts = hardware.experts_implementation(settings.precision, hardware.experts_per_token(config)[0])
    if experts:
        register_autocast_experts()
        extra["experts_implementation"] = experts
    # LoRA in 16 bits: the frozen base is loaded in 16 bits (half the memory, on the CPU too); the adapters peft adds
    # are fp32. QLoRA: its linear layers in 4 or 8 bits (--load-in-4bit), computing in the run's precision
    dtype = hardware.AUTOCAST_DTYPES.get(settings.precision, torch.float32) if settings.lora_rank else torch.float32
    if quantization.bits(settings):
        extra["quantization_config"] = quantization.loading_config(settings, dtype)
    model = load_pretrained(AutoModelForCausalLM, settings.model, dtype=dtype, **extra,
                          trust_remote_code=settings.trust_remote_code)
    if quantization.bits(settings):
        quantization.keep_trainable(model, f"--load-in-{quantization.bits(settings)}bit")
    return model


class _WeightsIn:
    """An experts module seen with its floating parameters in `dtype`: a differentiable cast, as autocast makes of a
    Linear's weight (the gradient reaches the fp32 parameter in fp32)."""

    def __init__(self, module, dtype):
        self._module, self._dtype = module, dtype

    def __getattr__(self, name):
        value = getattr(self._module, name)
        is_weight = isinstance(value, torch.nn.Parameter) and value.is_floating_point()
        return value.to(self._dtype) if is_weight else value


def register_autocast_experts():
    """transformers' grouped_mm experts (integrations/moe.py), their weights cast to the autocast dtype where autocast
    is on (hardware.experts_implementation): what it is registered as in transformers' ExpertsInterface."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    def forward(experts, hidden_states, *args, **kwargs):
        device = hidden_states.device.type
        if torch.is_autocast_enabled(device):
            experts = _WeightsIn(experts, torch.get_autocast_dtype(device))
        return grouped_mm_experts_forward(experts, hidden_states, *args, **kwargs)
    ALL_EXPERTS_FUNCTIONS.register("grouped_mm_autocast", forward)


def load_tokenizer(name, **kwargs):
    """The model's tokenizer; one without a padding token pads with EOS (padding is masked from attention and loss)."""
    from transformers import AutoTokenizer

    tokenizer = load_pretrained(AutoTokenizer, name, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare_model(model, settings, seed, tokens=None):
    """LoRA (--lora-rank > 0): low-rank adapters on the chosen linear layers through peft; only they train, the
    base weights are frozen (and kept in 16 bits when the run is bf16/fp16). Then --tiled-mlp, and gradient
    checkpointing (its kept inputs on the host: --offload-activations).
    `settings`: flags.Model; `seed` draws the adapters; `tokens`: the most a micro-batch holds (--tiled-mlp)."""
    if settings.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets, parameters = lora_targets(model, settings.lora_targets)
        config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules=targets,
                            target_parameters=parameters, lora_dropout=0.0, task_type="CAUSAL_LM")
        torch.manual_seed(seed)  # the adapters' initialization, the same in every script and on every rank
        try:
            model = get_peft_model(model, config)
        except ValueError as e:
            fail(f"--lora-targets {settings.lora_targets}: {str(e).splitlines()[0][:200]}; name linear layers of the "
                 f"model")
        head = model.get_output_embeddings()
        if settings.loss_chunk and hasattr(head, "lora_A") and not loss.postprocessed_logits(model.config):
            fail(f"--lora-targets {settings.lora_targets} puts an adapter on the output head, which the chunked loss "
                 f"reads as its base weight (loss.py): the adapter would never train. Leave the head out of "
                 f"--lora-targets, or pass --loss-chunk 0")
        if settings.precision in hardware.AUTOCAST_DTYPES:
            # frozen weights: no fp32 master needed. Under ZeRO-3 the adapters too: DeepSpeed skips its 16-bit cast
            # for a model made under zero.Init and takes the run's dtype from the first trainable parameter
            # (stage3.py), so fp32 adapters would train in fp32, and in fp16 with a loss scale fixed at 1 (no overflow
            # check). The engine keeps fp32 masters of them; under ZeRO-1/2 it casts them itself.
            zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
            for p in model.parameters():
                if (not p.requires_grad or zero3) and not quantization.is_quantized(p):
                    p.data = p.data.to(hardware.AUTOCAST_DTYPES[settings.precision])
    if settings.tiled_mlp:  # after LoRA: the tiles run the adapters too
        long_sequences.tile_mlps(model, model.config, tokens)
    if settings.offload_activations:  # gradient checkpointing, the layers' inputs in host memory
        long_sequences.offload_layer_inputs(model, tokens)
    elif settings.gradient_checkpointing:
        # non-reentrant: gradients reach the adapters even though the frozen embeddings' outputs need none
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if settings.gradient_checkpointing or settings.offload_activations:
        model.config.use_cache = False
    return model


# peft 0.21 renames the targets of a mixture of experts (model types it converts as it does Mixtral's: Qwen3-MoE, OLMoE,
# ...): a layer named like an MLP's projection becomes a parameter of the fused experts, and the router's weight joins
# (utils/transformers_weight_conversion.py). Such layers are adapted through their weight instead, which it keeps.
PEFT_RENAMED = ("gate", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj")


def lora_targets(model, targets):
    """(target_modules, target_parameters) of the adapters. --lora-targets all-linear: every linear layer of
    attention and MLP, as peft's all-linear; in a mixture of experts also each expert (their weights are fused
    parameters, experts x in x out, that only target_parameters reaches), and never a router (a layer of the experts'
    block with one output per expert: adapting it would move every token's choice of experts). Otherwise the names
    given."""
    if targets != "all-linear":
        return targets.split(","), None
    experts = {}  # module -> its fused experts' parameters
    for name, module in model.named_modules():
        fused = [n for n, p in module.named_parameters(recurse=False) if len(getattr(p, "ds_shape", p.shape)) == 3]
        if fused and not isinstance(module, torch.nn.modules.conv._ConvNd):
            experts[name] = [f"{name}.{n}" for n in fused]
    if not experts:
        return "all-linear", None
    count = hardware.experts_per_token(model.config)[0]
    head = model.get_output_embeddings()
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    blocks = {name.rpartition(".")[0] for name in experts}
    routers = {n for n in linear
               if n.rpartition(".")[0] in blocks and model.get_submodule(n).out_features in (count, 1)}
    kept = [n for n in linear if n not in routers]
    renamed = [n for n in kept if n.rpartition(".")[2] in PEFT_RENAMED]
    parameters = [p for names in experts.values() for p in names] + [f"{n}.weight" for n in renamed]
    return sorted(set(kept) - set(renamed)), sorted(parameters)


def save_final(model, tokenizer, folder, state_dict=None):
    """The model in Hugging Face format (safetensors), which stock AutoModelForCausalLM.from_pretrained loads. With
    LoRA: the adapters merged into the weights there, and the adapter itself in folder/adapter (PeftModel loads it
    onto the base model). `state_dict`: the whole model's, when ZeRO-3 had to gather it."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    if not hasattr(model, "peft_config"):
        model.save_pretrained(folder, state_dict=state_dict)
        return
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    # The merge below adds the adapters into the base weights in place: into a copy on the CPU where the tensors are
    # on a GPU, into the gathered ones as they are (ZeRO-3: already rank 0's host memory, never copied twice), and
    # into copies of the training model's own weights only where it trains on the CPU.
    live = {p.data_ptr() for p in model.parameters() if p.device.type == "cpu"}
    state, copies = {}, {}
    for k, v in (state_dict or model.state_dict()).items():
        if v.device.type == "cpu" and v.data_ptr() not in live:
            state[k] = v.detach()
        else:  # one copy per tensor: tied weights (embeddings and head) stay one tensor, and the export stays tied
            if (v.device, v.data_ptr()) not in copies:
                copies[v.device, v.data_ptr()] = v.detach().to("cpu", copy=True)
            state[k] = copies[v.device, v.data_ptr()]
    model.save_pretrained(folder / "adapter", state_dict=state)  # peft keeps the adapter's tensors, full size
    config = model.get_base_model().config
    if getattr(config, "quantization_config", None):  # QLoRA: merged into the base dequantized, saved unquantized
        state = quantization.full_precision_state(model, state, model.get_input_embeddings().weight.dtype)
        config = copy.deepcopy(config)
        del config.quantization_config
    with torch.device("meta"):  # a model without storage, given the tensors above
        merged = get_peft_model(AutoModelForCausalLM.from_config(config), model.peft_config["default"])
    merged.load_state_dict(state, assign=True, strict=False)
    merged.merge_and_unload().save_pretrained(folder)


def sample(model, tokenizer, prompt, split, process):
    """The trained model's answer to --prompt: a chat message for chat data, the text as it is otherwise, with the
    tokenizer's own special tokens; for preference pairs, the prompt of the first held-out pair of `split`. With the
    model in memory, under the run's precision (FlashAttention refuses the fp32 activations of fp32 weights): under
    ZeRO-3 every rank takes part (its layers are gathered one at a time, as in training), so no rank ever holds a
    whole copy: it runs before rank 0 writes the outputs, so no rank waits on a collective while rank 0 saves. A
    failure here is a line, never a failed run. `process`: training.Process."""
    if not prompt or not _generates(model, process.rank):
        return None
    try:
        messages = [{"role": "user", "content": prompt}] if split.format == "messages" else None
        if split.format in preference.FORMATS:  # the first held-out row's prompt (a skipped one has none)
            usable = [p for p in map(preference.examples_prompt, split.examples) if p[1]]
            messages, prompt, _ = usable[0] if usable else (None, prompt, None)
        answer = _generate(model, tokenizer, _prompt_ids(tokenizer, messages, prompt), process)
        process.say(f"sample: {prompt!r} -> {answer!r}")
        return answer
    except Exception as e:  # noqa: BLE001 (any failure: the run itself succeeded)
        process.say(f"no sample ({type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})")
        return None


def answers(model, tokenizer, split, process):
    """The model's answers to the prompts of a few eval rows of `split` (chats: the turns before the last assistant's;
    prompt/completion: the prompt), beside the expected ones, for the trackers at each eval, under the run's
    precision. Greedy: no random number is drawn, so training goes on exactly as without it. None for plain text;
    the exception where it fails (RunStats.log_eval says it once: a view of the run, never a reason to stop it)."""
    fmt = split.format
    if fmt == "text" or not split.examples or not _generates(model, process.rank):
        return None
    rows = []
    try:
        for row in split.examples:
            if fmt == "messages":
                last = max(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
                messages, expected = row["messages"][:last], row["messages"][last]["content"]
                prompt = messages[-1]["content"] if messages else ""
            elif fmt in preference.FORMATS:  # the preferred (desirable) answer is the expected one
                messages, prompt, expected = preference.examples_prompt(row)
            else:
                messages, prompt, expected = None, row["prompt"], row["completion"]
            answer = _generate(model, tokenizer, _prompt_ids(tokenizer, messages, prompt), process)
            rows.append({"prompt": prompt, "expected": expected, "answer": answer})
    except Exception as e:  # noqa: BLE001
        return e
    return rows


def _generates(model, rank):
    """Whether this rank generates: rank 0, and under ZeRO-3 every rank (each layer's shards are gathered)."""
    engine = model if hasattr(model, "zero_optimization_partition_weights") else None
    return rank == 0 or (engine is not None and engine.zero_optimization_partition_weights())


def _prompt_ids(tokenizer, messages, prompt):
    if messages is None:
        return tokenizer(prompt)["input_ids"]
    text = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _generate(model, tokenizer, ids, process, max_new_tokens=40):
    """Greedy decoding of the model in memory, within its positions; it is left in the mode it was in."""
    engine = model if hasattr(model, "zero_optimization_partition_weights") else None
    net = loss.causal_lm(model)
    positions = getattr(hardware.text_config(net.config), "max_position_embeddings", None)
    if positions:
        ids, max_new_tokens = ids[-(positions - 1):], min(max_new_tokens, positions - min(len(ids), positions - 1))
    synced = engine is not None and engine.zero_optimization_partition_weights()
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad(), process.autocast, torch.compiler.set_stance("force_eager"):  # as the evals
            out = net.generate(input_ids=torch.tensor([ids], device=process.device), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id, synced_gpus=synced)
    except Exception as e:
        if synced:
            _failed_together(e, torch.distributed.distributed_c10d._get_default_store(), process)
        raise
    finally:
        net.train(was_training)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def _failed_together(error, store, process, wait_s=20.0):
    """Under ZeRO-3 every rank generates together, gathering each layer's shards from all the others. A failure on
    every rank (the same forward fails the same way everywhere) is a line, as in one process; on some ranks only (an
    out-of-memory), the others wait in a gather this rank will never join, until --dist-timeout: end the run now
    instead, naming the ranks. The ranks that failed count themselves in the rendezvous store, whose calls need no
    collective, and wait a few seconds for the rest. Each rank's own count of its failed generations, kept in the
    store too, names the failure: the same on every rank where they fail together."""
    rank, world_size = process.rank, process.world_size
    failure = store.add(f"finetune/generation-failures/rank-{rank}", 1)
    key = f"finetune/generation-failed/{failure}"
    failed, deadline = store.add(key, 1), time.monotonic() + wait_s
    while failed < world_size and time.monotonic() < deadline:
        time.sleep(0.1)
        failed = store.add(key, 0)
    if failed < world_size:
        reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        fail(f"rank {rank} could not generate under ZeRO-3 ({type(error).__name__}: {reason}) while "
             f"{world_size - failed} of {world_size} ranks went on, and they cannot finish without it: the run stops "
             f"here. Its last checkpoint is complete: rerun with --resume, and --prompt '' to skip the sample")


def held_bytes(model, optimizer):
    """Bytes of model state this rank holds, for each rank: parameters (under ZeRO-3 their shards), gradients and
    the optimizer's state and buffers, each storage counted once. plan.py plans this figure."""
    from .internals import memory

    held = memory.held_bytes(model, optimizer)
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, held)
        return every
    return [held]
