"""What the trained model says: the sample at the end and the answers the trackers get at each eval, generated in the
run's precision; a failure a line, never a failed run, and under ZeRO-3 a failure on some ranks ends the run."""

from types import SimpleNamespace

import pytest
import torch
from helpers import base_args, cpu_process, load_script, results
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune import models

pytestmark = pytest.mark.quick  # in process: `make test-quick`
single = load_script("single-gpu.py")


def test_a_failed_sample_is_a_line_not_a_failed_run(tmp_path, tiny, monkeypatch, capsys):
    """Everything is saved before the sample; an out-of-memory there must not turn a finished run into a failed one.
    The trackers' answers at each of the 4 evals fail the same way: said once, at the first."""
    import transformers

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(transformers.GenerationMixin, "generate", out_of_memory)
    out = tmp_path / "run"
    r = single.main(
        base_args(
            tiny, out, **{"--prompt": "The food", "--dataset": tiny["chats"], "--block-size": 64, "--eval-every": 1}
        )
        + ["--report-to", "tensorboard"]
    )
    assert r["sample"] is None and results(out)["eval_loss"] > 0 and (out / "final" / "model.safetensors").exists()
    said = capsys.readouterr().out
    assert "no sample (RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB)" in said
    assert len(r["evals"]) == 4 and said.count("no answers for the trackers (RuntimeError: CUDA out of memory") == 1


def test_the_sample_and_the_answers_are_generated_in_the_runs_precision(tmp_path, tiny, monkeypatch, capsys):
    """A bf16 run over fp32 weights gets FlashAttention-2 on a GPU, which refuses fp32 activations: generating
    outside the run's autocast gave no sample and no eval answers there. Here SDPA stands in for it with its
    refusal: transformers' own get_target_dtype decides what it would cast a query to, the kernel takes fp16 and
    bf16 only."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def like_flash_attention(module, query, *args, **kwargs):
        if (get_target_dtype(query, module) or query.dtype) not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only supports fp16 and bf16 data type")
        return sdpa_attention_forward(module, query, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", like_flash_attention)
    out = tmp_path / "run"
    r = single.main(
        base_args(
            tiny,
            out,
            **{
                "--prompt": "How was the food?",
                "--dataset": tiny["chats"],
                "--block-size": 64,
                "--precision": "bf16",
                "--max-steps": 2,
            },
        )
        + ["--report-to", "tensorboard"]
    )
    said = capsys.readouterr().out
    assert isinstance(r["sample"], str) and "no answers" not in said and "no sample" not in said, said[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    with pytest.raises(RuntimeError, match="FlashAttention only supports"):  # outside the autocast: refused
        models._generate(
            AutoModelForCausalLM.from_pretrained(out / "final"),
            tokenizer,
            tokenizer("Hi")["input_ids"],
            cpu_process(tokenizer.pad_token_id, None),
        )


def test_a_generation_that_failed_on_some_zero3_ranks_ends_the_run_and_on_all_is_a_line():
    """Under ZeRO-3 the ranks generate together (each layer's shards gathered from all): a failure on every rank is
    the one line above; on rank 1 alone, rank 0 waits in a gather rank 1 never joins, until --dist-timeout. Rank 1
    then ends the run at once, naming itself (the launcher stops the rest). Fed the rendezvous store's answers."""
    import threading

    from torch.distributed import HashStore

    error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    store = HashStore()
    with pytest.raises(
        SystemExit,
        match=r"^error: rank 1 could not generate under ZeRO-3 \(RuntimeError: CUDA out "
        r"of memory. Tried to allocate 2.00 GiB\) while 1 of 2 ranks went on",
    ):
        models._failed_together(error, store, SimpleNamespace(rank=1, world_size=2), wait_s=0.3)
    done, store = [], HashStore()  # every rank fails the same generation: each goes on to its own line, none ends
    for _ in range(2):  # the run, at its first failure and again at its second (each rank counts its own)
        ranks = [
            threading.Thread(
                target=lambda r=r: done.append(
                    models._failed_together(error, store, SimpleNamespace(rank=r, world_size=3), wait_s=60)
                )
            )
            for r in range(3)
        ]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join()
    assert done == [None] * 6
