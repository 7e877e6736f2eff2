"""Reward models in sequence_classification.py: a preference file (chosen, rejected; with or without a prompt; an
optional margin) trains a one-output head so that the chosen answer scores higher (Bradley-Terry), as TRL's
RewardTrainer and DeepSpeed-Chat's step 2 do: the step before RLHF, GRPO with a learned reward, or best-of-n sampling.
Any model AutoModelForSequenceClassification builds: an encoder pools its first token, a decoder its last one that
is not padding (its pad token set: the EOS where the tokenizer has none, as TRL does).

A pair's two texts are the prompt followed by each answer (strings, each ending with the EOS as TRL adds it; or
messages, rendered with the chat template); a pair whose longer text passes --max-length is left out and counted (as
TRL filters it: a cut answer would be scored on what it did not say).

A decoder of the families ONE_ROW_MODELS lists scores a pair in one row (--pair-layout one-row): the tokens the two
texts share (the prompt) once, then the rest of each text, which sees those and itself at the positions it has
alone. Each text's reward is then the one it gets alone, and the prompt is computed once, not twice (TRL pads each
text in a row of its own)."""
import numpy as np
import torch
import torch.nn.functional as F
from transformers import Trainer

from .base import fail
from .blocks import attention_layout, document_masks
from .preference import without_dropout

COLUMNS = ("chosen", "rejected")


def is_preference(columns):
    return set(COLUMNS) <= set(columns)


def pair_texts(row, tokenizer):
    """(chosen text, rejected text) of a row: the prompt, if any, before each answer."""
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if prompt is not None:
        chosen, rejected = prompt + chosen, prompt + rejected
    if isinstance(chosen, list):
        render = lambda turns: tokenizer.apply_chat_template(turns, tokenize=False)
        return render(chosen), render(rejected)
    eos = tokenizer.eos_token or ""
    return tuple(text if text.endswith(eos) else text + eos for text in (chosen, rejected))


def tokenized_pairs(split, tokenizer, max_length, name):
    """The split as chosen_ids and rejected_ids (and margin, where the file has one), its over-long pairs left out;
    and their count."""
    wrong = next((c for c in COLUMNS if not all(isinstance(v, (str, list)) for v in split[c])), None)
    if wrong:
        fail(f"dataset {name}: {wrong} must be text or a list of messages in every row")

    def tokenize(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        texts = [pair_texts(row, tokenizer) for row in rows]
        ids = lambda k: [tokenizer(t[k], add_special_tokens=not isinstance(rows[0]["chosen"], list))["input_ids"]
                         for t in texts]
        return {"chosen_ids": ids(0), "rejected_ids": ids(1)}

    margin = ["margin"] if "margin" in split.column_names else []
    pairs = split.map(tokenize, batched=True, remove_columns=[c for c in split.column_names if c not in margin])
    longest = np.maximum([len(x) for x in pairs["chosen_ids"]], [len(x) for x in pairs["rejected_ids"]])
    kept = np.flatnonzero(longest <= max_length)
    return pairs.select(kept), len(pairs) - len(kept)


class PairCollator:
    """A batch of pairs as one batch of texts, the chosen ones first, then the rejected ones, padded together: one
    forward scores both."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, pairs):
        texts = [{"input_ids": p["chosen_ids"]} for p in pairs] + [{"input_ids": p["rejected_ids"]} for p in pairs]
        batch = dict(self.tokenizer.pad(texts, return_tensors="pt"))
        if "margin" in pairs[0]:
            batch["margin"] = torch.tensor([float(p["margin"]) for p in pairs])
        return batch


def shared_prefix(chosen, rejected):
    """How many leading tokens a pair's two texts share, each keeping at least its last token (whose reward counts)."""
    n = min(len(chosen), len(rejected)) - 1
    differ = np.flatnonzero(np.asarray(chosen[:n]) != np.asarray(rejected[:n]))
    return int(differ[0]) if len(differ) else max(n, 0)


def pooled_token(ids, pad_id):
    """The token a decoder's head scores a text at, as transformers finds it alone: the last that is not padding (where
    the EOS pads, as GPT-2's, the one before a final EOS)."""
    kept = np.flatnonzero(np.asarray(ids) != pad_id)
    return int(kept[-1]) if len(kept) else 0


# the decoders whose sequence-classification forward takes position ids and a 4-D mask through every layer as given,
# each checked against its texts scored alone (tests/test_reward.py); others are padded apart: ALiBi models (Bloom,
# Falcon, MPT) place tokens by column, recurrent layers (Jamba, Qwen3-Next) carry the chosen text into the rejected one
ONE_ROW_MODELS = ("opt", "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")


def one_row_layout(model, pair_layout, replicas=1):
    """The one-row layout's attention mask (attention_layout's "bool" for SDPA or "additive" for eager attention), or
    None where the pairs' texts are padded apart: --pair-layout apart, an encoder (it pools its first token, which sees
    the whole text), a model not in ONE_ROW_MODELS, another attention (FlashAttention takes no 4-D mask, flex
    attention adds it to the scores), or the Trainer's DataParallel over `replicas` GPUs (a replica a thread: the
    head's kept output would be one replica's)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if pair_layout != "one-row" or model.config.model_type not in ONE_ROW_MODELS or replicas > 1 or \
            implementation not in ("sdpa", "eager"):
        return None
    return attention_layout(implementation)


class OneRowCollator:
    """A batch of pairs, a pair a row: the tokens its two texts share (shared_prefix) once, then the rest of the
    chosen text, then the rest of the rejected one, which attends to the shared tokens and to itself, not to the chosen
    text, at the positions it has alone; padding attends to itself. `ends`: where each row's (chosen, rejected)
    texts are scored (pooled_token, in the row). The mask is 4-D (blocks.document_masks: bool for SDPA, additive for
    eager attention, the model's sliding window)."""

    def __init__(self, pad_id, model_config, layout):
        self.pad_id, self.model_config, self.layout = pad_id, model_config, layout

    def __call__(self, pairs):
        parts = []
        for pair in pairs:
            shared = shared_prefix(pair["chosen_ids"], pair["rejected_ids"])
            parts.append((pair["chosen_ids"][:shared], pair["chosen_ids"][shared:], pair["rejected_ids"][shared:]))
        width = max(sum(map(len, p)) for p in parts)
        ids = np.full((len(parts), width), self.pad_id, dtype=np.int64)
        positions, segments = np.zeros_like(ids), np.full_like(ids, 3)  # segments: 0 shared, 1 chosen, 2 rejected
        ends = np.zeros((len(parts), 2), dtype=np.int64)
        for row, (shared, chosen, rejected) in enumerate(parts):
            k, c, r = len(shared), len(chosen), len(rejected)
            ids[row, :k + c + r] = shared + chosen + rejected
            positions[row, :k + c + r] = np.r_[np.arange(k + c), np.arange(k, k + r)]
            segments[row, :k + c + r] = np.repeat([0, 1, 2], [k, c, r])
            scored = pooled_token(shared + chosen, self.pad_id), pooled_token(shared + rejected, self.pad_id)
            ends[row] = scored[0], scored[1] + (c if scored[1] >= k else 0)
        segments, positions = torch.from_numpy(segments), torch.from_numpy(positions)
        query, key = segments[:, None, :, None], segments[:, None, None, :]
        same = ((query == key) | (key == 0) & (query != 3)) & torch.ones(width, width, dtype=torch.bool).tril()
        batch = {"input_ids": torch.from_numpy(ids), "position_ids": positions, "ends": torch.from_numpy(ends),
                 "attention_mask": document_masks(same, self.model_config, self.layout, positions)}
        if "margin" in pairs[0]:
            batch["margin"] = torch.tensor([float(p["margin"]) for p in pairs])
        return batch


def bradley_terry(chosen, rejected, margin=None, center=0.0):
    """TRL's reward loss: the mean of -log sigmoid(r_chosen - r_rejected - margin), plus `center` times the mean of
    (r_chosen + r_rejected)^2 (Eisenstein et al. 2023: rewards near 0 on average; TRL's center_rewards_coefficient)."""
    loss = -F.logsigmoid(chosen - rejected - (0 if margin is None else margin)).mean()
    return loss + center * ((chosen + rejected) ** 2).mean() if center else loss


class RewardTrainer(Trainer):
    """The HF Trainer with the Bradley-Terry loss over a batch's pairs (PairCollator's or OneRowCollator's layout);
    its predictions, each pair's (chosen, rejected) rewards, for reward_metrics. The model trains without dropout, as
    TRL's RewardTrainer does by default (DistilBERT's head drops 20% of its input): a pair's two rewards are then of
    the same function, and one process and any number of ranks train alike. In the one-row layout the head's output
    at every token is kept as the forward makes it (a hook on the head: the model itself pools one token a row)."""

    def __init__(self, *args, center=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.center, self.per_token, self.keeping = center, None, None
        without_dropout(self.model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        margin, ends = inputs.pop("margin", None), inputs.pop("ends", None)
        if ends is not None and self.keeping is None:  # hooked at the first forward, after DeepSpeed's hooks: under
            # ZeRO-3 its hook wraps the head's output so that the backward gathers the head's weight first
            keep = lambda module, args, output: setattr(self, "per_token", output)
            self.keeping = self.model.score.register_forward_hook(keep)
        logits = model(**inputs).logits
        if ends is None:  # a batch's chosen texts, then its rejected ones
            chosen, rejected = logits.squeeze(-1).float().chunk(2)
        else:  # each row's two scored tokens
            rows = torch.arange(len(ends), device=ends.device)[:, None]
            chosen, rejected = self.per_token[rows, ends].squeeze(-1).float().unbind(1)
            self.per_token = None
        loss = bradley_terry(chosen, rejected, margin, self.center)
        return (loss, torch.stack([chosen, rejected], dim=1)) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, rewards = self.compute_loss(model, inputs, return_outputs=True)
        return loss.detach(), rewards.detach(), torch.zeros(len(rewards), device=rewards.device)  # (no labels)


def reward_metrics(rewards):
    """The held-out pairs' accuracy (the chosen answer scored higher), mean margin, and the score that picks the best
    epoch: accuracy, ties broken by the lower Bradley-Terry loss (as classification_metrics does)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    difference = rewards[:, 0] - rewards[:, 1]
    accuracy = float(np.mean(difference > 0))
    loss = float(np.mean(np.logaddexp(0.0, -difference)))
    return {"accuracy": accuracy, "margin": float(np.mean(difference)),
            "accuracy_then_loss": accuracy - min(loss, 100.0) / (101.0 * len(difference))}
