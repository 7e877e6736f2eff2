"""Does it work with my model? The architectures people fine-tune, each a tiny model built from its family's config
with the family's structure (grouped-query attention, a tied or untied head, logit softcapping, sliding windows,
experts with top-k routing), trained by the pair on chats packed into blocks: ZeRO-3 on 2 ranks gives single-gpu.py's
losses, gradient norms and weights; packed documents see only themselves (the eval loss of packed blocks is each
document's alone); LoRA adapts what it should; the export reloads with stock transformers and generates. One launch
runs every family's ZeRO-3 run (tests/zero_runs.py). docs/models.md's table is what this finds: the test fails when
it is out of date, and `UPDATE_DOCS=1` rewrites it."""

import json
import os

import pytest
import torch
from helpers import (
    FAMILIES,
    ROOT,
    assert_close_losses,
    assert_same_weights,
    base_args,
    build,
    check,
    cpu_process,
    independent_loss,
    launch,
    load_script,
    results,
    weights,
)

from finetune import hardware, models, training

single = load_script("single-gpu.py")
LORA_ZERO3 = "qwen3_moe"  # the family also trained with LoRA under ZeRO-3 (its fused experts adapted)


def flags(tiny, model, out, **more):
    """Chats (the loss on the answers) packed into blocks of 64: documents longer than the 16-token windows."""
    return base_args(
        tiny,
        out,
        **{
            "--model": str(model),
            "--dataset": tiny["chats"],
            "--block-size": 64,
            "--weight-decay": 0.1,
            "--grad-accum": 2,
            **more,
        },
    )


@pytest.fixture(scope="module")
def matrix(tiny, tmp_path_factory):
    """Every family trained by single-gpu.py in this process, and by zero-optimization.py under ZeRO-3 on 2 ranks in
    one launch; and LORA_ZERO3 with LoRA both ways."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("matrix")
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    runs, zero_argvs = {}, []
    for name in [*FAMILIES, f"{LORA_ZERO3}+lora"]:
        family = name.split("+")[0]
        model = root / family / "model"
        if not model.exists():
            build(family, tokenizer, model)
        lora = {"--lora-rank": 4} if name.endswith("+lora") else {}
        single.main(flags(tiny, model, root / name / "one", **{"--batch-size": 4, **lora}))
        zero_argvs.append(
            flags(tiny, model, root / name / "two", **{"--batch-size": 2, "--zero-stage": 3, **lora}) + ["--deepspeed"]
        )
        runs[name] = {
            "model": model,
            "one": root / name / "one",
            "two": root / name / "two",
            "argv": flags(tiny, model, root / name / "one", **{"--batch-size": 4}),
        }
    (root / "runs.json").write_text(json.dumps(zero_argvs))
    run = check(launch("forked", "tests/zero_runs.py", [str(root / "runs.json")], timeout=900))
    for r in runs.values():
        r["stdout"] = run.stdout
    return runs


@pytest.mark.parametrize("name", [*FAMILIES, f"{LORA_ZERO3}+lora"])
def test_zero3_on_2_ranks_trains_as_one_process(matrix, name):
    one, two = results(matrix[name]["one"]), results(matrix[name]["two"])
    assert two["world_size"] == 2 and two["ran"]["zero_stage"] == 3 and len(one["losses"]) == 4
    assert_close_losses(one["losses"], two["losses"])
    assert_close_losses(one["grad_norms"], two["grad_norms"])
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert_same_weights(weights(matrix[name]["one"] / "final"), weights(matrix[name]["two"] / "final"), atol=1e-4)
    if name.endswith("+lora"):  # the adapters themselves, the experts' among them
        from safetensors.torch import load_file

        adapters = [
            load_file(str(matrix[name][run] / "final" / "adapter" / "adapter_model.safetensors"))
            for run in ("one", "two")
        ]
        assert_same_weights(*adapters)
        assert any("experts" in key for key in adapters[0]), sorted(adapters[0])


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents_see_only_themselves(matrix, name):
    """The eval loss the run reports (packed blocks, the documents' masks with each layer type's window) equals the
    stock model's on each document alone, in float64."""
    moe = {"experts_implementation": "eager"} if "num_experts_per_tok" in FAMILIES[name][1] else {}  # fp64 experts
    total, count = independent_loss(matrix[name]["one"] / "final", matrix[name]["argv"], "eval", **moe)
    assert results(matrix[name]["one"])["eval_loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_export_reloads_with_stock_transformers_and_generates(matrix, name):
    """final/ of the ZeRO-3 run (gathered from the shards): AutoModelForCausalLM loads it and its logits are the
    single process's; greedy generation gives the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(matrix[name]["two"] / "final")
    one, two = (AutoModelForCausalLM.from_pretrained(matrix[name][run] / "final").eval() for run in ("one", "two"))
    ids = tokenizer("How many stars does this review give?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert (one(ids).logits - two(ids).logits).abs().max() < 1e-4
        out = [
            m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id) for m in (one, two)
        ]
    assert out[0].shape[1] > ids.shape[1] and torch.equal(out[0], out[1])


@pytest.mark.parametrize("name", [n for n in FAMILIES if "num_experts_per_tok" in FAMILIES[n][1]])
def test_the_ranks_route_to_different_experts(matrix, tiny, name):
    """What ZeRO-3 had to survive: the two ranks' shares of the first micro-batch send their tokens to different
    experts (counted at each layer's experts, from the router's choice) with the initial weights."""
    from transformers import AutoModelForCausalLM

    from finetune import data

    config = single.parse_args(matrix[name]["argv"])
    model = AutoModelForCausalLM.from_pretrained(matrix[name]["model"]).eval()
    train = data.prepare(config.data, models.load_tokenizer(config.model.model), seed=config.train.seed)[0]
    first = training.GlobalBatches(len(train), 8, config.train.seed)(0)[:4]  # micro-step 1: 2 rows for each of 2 ranks
    chosen = []
    experts_modules = [m for m in model.modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]
    hooks = [
        m.register_forward_pre_hook(lambda module, args: chosen[-1].append(args[1].flatten())) for m in experts_modules
    ]
    counts = []
    for share in first.view(2, -1):
        chosen.append([])
        inputs, _ = train.batch(share, cpu_process(0, model.config))
        with torch.no_grad():
            model(**inputs)
        experts = hardware.experts_per_token(model.config)[0]
        counts.append(torch.stack([torch.bincount(c, minlength=experts) for c in chosen[-1]]))
    for hook in hooks:
        hook.remove()
    assert len(experts_modules) == 2 and not torch.equal(counts[0], counts[1]), counts


def lora_adapted(model_folder, argv):
    """What --lora-targets all-linear adapts in this model: {adapted layer or parameter: its shape}."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder)
    config = single.parse_args(argv + ["--lora-rank", "4"])
    adapted = models.prepare_model(model, config.model, config.train.seed)
    names = {}
    for name, module in adapted.named_modules():
        if hasattr(module, "lora_A") and len(module.lora_A):
            base = module.get_base_layer()
            target = getattr(module, "parameter_name", None)  # a wrapped parameter (target_parameters)
            where = name.split("base_model.model.", 1)[-1].replace(".base_layer", "")
            shape = getattr(base, target).shape if target else base.weight.shape
            names[f"{where}.{target}" if target else where] = tuple(shape)
    return names


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_all_linear_adapts_attention_mlp_and_experts_never_a_router(matrix, name):
    """Dense models: exactly peft's all-linear. A mixture of experts: its linear layers too, and every expert's
    fused weights (peft's all-linear adapts them for some families and not others, and the router for some)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapted = lora_adapted(matrix[name]["model"], matrix[name]["argv"])
    model = AutoModelForCausalLM.from_pretrained(matrix[name]["model"])
    experts = hardware.experts_per_token(model.config)[0]
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head}
    if not experts:
        peft_all = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
        assert (
            set(adapted)
            == {n.split("base_model.model.", 1)[1] for n, m in peft_all.named_modules() if hasattr(m, "lora_A")}
            == linear
        )
        return
    fused = {f"{n}.{p}" for n, m in model.named_modules() for p, w in m.named_parameters(recurse=False) if w.dim() == 3}
    assert fused and fused <= set(adapted) and linear <= set(adapted), sorted(adapted)
    assert all(shape[0] != experts or len(shape) == 3 for shape in adapted.values()), adapted  # no router
    assert set(adapted) == fused | linear


def structure(config):
    """The family's features as the table lists them."""
    text, said = config.get_text_config(), []
    said.append(f"GQA {text.num_attention_heads}/{text.num_key_value_heads} heads")
    said.append("tied head" if text.tie_word_embeddings else "untied head")
    kinds = set(getattr(text, "layer_types", None) or [])
    if getattr(text, "sliding_window", None):
        every = kinds == {"sliding_attention"} or not kinds
        said.append(f"sliding window {text.sliding_window} ({'every layer' if every else 'alternate layers'})")
    if getattr(text, "final_logit_softcapping", None):
        said.append(f"logits softcapped at {text.final_logit_softcapping:g}")
    experts, k = hardware.experts_per_token(config)
    if experts:
        said.append(f"{experts} experts, top {k}")
    return ", ".join(said)


def table(matrix):
    """docs/models.md's table: a row per family, from the models and runs of this module."""
    from transformers import AutoModelForCausalLM

    rows = [
        "| architecture | class (`model_type`) | structure in the test | LoRA `all-linear` adapts | the run says |",
        "|---|---|---|---|---|",
    ]
    for name, (_, _, known_as) in FAMILIES.items():
        model = AutoModelForCausalLM.from_pretrained(matrix[name]["model"])  # as the scripts load it on a CPU
        adapted = lora_adapted(matrix[name]["model"], matrix[name]["argv"])
        layers = sorted({n.rsplit(".", 1)[-1] for n, shape in adapted.items() if len(shape) == 2})
        fused = sorted({n.rsplit(".", 1)[-1] for n, shape in adapted.items() if len(shape) == 3})
        lora = ", ".join(layers) + (f"; each expert's {', '.join(fused)}" if fused else "")
        said = "; ".join(models.notes(model)) or "-"
        rows.append(
            f"| {known_as} | `{type(model).__name__}` (`{model.config.model_type}`) | {structure(model.config)}"
            f" | {lora} | {said} |"
        )
    return "\n".join(rows)


def test_the_table_in_docs_is_what_the_tests_found(matrix):
    """docs/models.md shows what this module checks for each family (the rows' tests pass or CI fails);
    UPDATE_DOCS=1 rewrites it."""
    doc = ROOT / "docs" / "models.md"
    start, end = "<!-- the table: written by tests/test_models.py -->\n", "\n<!-- end of the table -->"
    text = doc.read_text()
    before, rest = text.split(start)
    current = rest.split(end)[0]
    found = table(matrix)
    if os.environ.get("UPDATE_DOCS"):
        doc.write_text(before + start + found + end + rest.split(end)[1])
    assert current == found, "docs/models.md is out of date: rerun with UPDATE_DOCS=1"
    assert set(models.TESTED) == {"opt", *FAMILIES}  # the run calls these tested, and no other


def test_a_mixture_of_experts_under_dpo_starts_at_ln2_with_its_router_noise_off(tiny, tmp_path):
    """Preference pairs (DPO) on a mixture of experts (a tiny Mixtral, 2 of 4 experts a token, with the router jitter
    its config may set): the router's noise is off with dropout (preference.without_dropout), so the model is its own
    reference at step 1 (the loss ln 2; with the noise on, 0.7 or so), and it trains from there."""
    import math

    from finetune.internals import demo

    pairs = tmp_path / "pairs.jsonl"
    demo.make_demo_pairs(pairs, n=48, seed=3, style="strings")
    model = build("mixtral", models.load_tokenizer(tiny["model"]), tmp_path / "moe", router_jitter_noise=0.1)
    single.main(
        base_args(
            tiny,
            tmp_path / "run",
            **{
                "--model": str(model),
                "--dataset": str(pairs),
                "--block-size": 64,
                "--lr": 1e-3,
                "--beta": 0.5,
                "--max-steps": 8,
                "--save-every": 0,
                "--warmup-ratio": 0,
            },
        )
    )
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    assert r["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert r["rewards/margins"][0] == pytest.approx(0, abs=1e-6)
    assert all(math.isfinite(x) for x in r["losses"]) and len(set(r["losses"])) == 8
