"""The demo, generated here and downloaded from nowhere: a review corpus, tokenizers trained on it, tiny models.

`--demo` in every script uses it; a fork that trains on its own model and data can delete this file (and the
`--demo` flags). Everything is built once into .demo/ (ignored by git).
"""
import csv
import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository: the scripts, the configs, .demo/
DEMO_DIR = ROOT / ".demo"  # built on first use, ignored by git


_DISHES = "pasta ramen tacos burger curry salad pizza soup sushi dumplings steak pancakes noodles sandwich".split()
_PLACES = "place restaurant diner cafe bistro spot kitchen bar".split()
_WORDS = [  # one row per star rating (label 0 = 1 star ... label 4 = 5 stars)
    "awful terrible inedible disgusting cold greasy".split(),
    "bland disappointing overpriced soggy mediocre dry".split(),
    "okay decent average fine forgettable acceptable".split(),
    "good tasty fresh solid enjoyable satisfying".split(),
    "amazing outstanding perfect delicious incredible superb".split(),
]
_SERVICE = [
    "The staff ignored us for {n} minutes and never apologized.",
    "Service was slow and our order came out wrong.",
    "The service was fine, nothing special.",
    "Our server was friendly and checked on us often.",
    "The staff were wonderful and made us feel at home.",
]
_ENDINGS = [
    "Never again.", "I probably will not return.", "I might come back if I am nearby.",
    "I would come back.", "I cannot wait to come back!",
]
_OPENINGS = [
    "We came here for {occasion}.", "I stopped by on a {day} {time}.", "Visited with {company} last week.",
    "First time at this {place}.", "This {place} opened near my office.",
]


def _review(rng, label):
    adj = lambda: rng.choice(_WORDS[label])
    sentences = [
        rng.choice(_OPENINGS).format(
            occasion=rng.choice(["lunch", "dinner", "a birthday", "brunch", "a quick bite"]),
            day=rng.choice(["Monday", "Friday", "Saturday", "Sunday"]),
            time=rng.choice(["morning", "afternoon", "evening", "night"]),
            company=rng.choice(["friends", "my family", "coworkers", "my partner"]),
            place=rng.choice(_PLACES)),
        f"The {rng.choice(_DISHES)} was {adj()} and the {rng.choice(_DISHES)} was {adj()}.",
        _SERVICE[label].format(n=rng.randint(10, 45)),
        f"Prices were {['a rip-off', 'too high', 'fair', 'reasonable', 'a bargain'][label]}"
        f" at about {rng.randint(8, 40)} dollars each.",
        _ENDINGS[label],
    ]
    middle = sentences[1:-1]
    rng.shuffle(middle)
    return " ".join([sentences[0], *middle[: rng.randint(1, 3)], sentences[-1]])


STARS = ["1 star", "2 stars", "3 stars", "4 stars", "5 stars"]
RETURN = ["No.", "Probably not.", "Maybe, if nearby.", "Yes.", "Yes, gladly!"]
QUESTIONS = ["How many stars does this review give?", "Will the reviewer come back?"]


def make_demo_corpus(path, n=4000, seed=0):
    """Write n generated reviews with yelp_review_full's columns (label 0-4, text)."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "text"])
        for _ in range(n):
            label = rng.randrange(5)
            writer.writerow([label, _review(rng, label)])


def question(review, kind):
    return f"Review: {review}\n{QUESTIONS[kind]}"


def answer(label, kind):
    return STARS[label] + "." if kind == 0 else RETURN[label]


def make_demo_chats(path, n=4000, seed=0):
    """Write n generated chats, one per line of a .jsonl file: a user asks a question about a review, the assistant
    answers it (the `messages` format: the loss falls on the answers only)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label, kind = rng.randrange(5), rng.randrange(2)
            messages = [{"role": "user", "content": question(_review(rng, label), kind)},
                        {"role": "assistant", "content": answer(label, kind)}]
            f.write(json.dumps({"messages": messages}) + "\n")


def make_demo_pairs(path, n=400, seed=0, style="strings"):
    """Write n generated preference pairs, one per line of a .jsonl file: a question about a review, the right answer
    chosen over a wrong one. `style`: "strings" (prompt, chosen, rejected as text), "messages" (the prompt a list of
    turns, the answers the assistant's) or "implicit" (chosen and rejected whole conversations)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label, kind = rng.randrange(5), rng.randrange(2)
            wrong = rng.choice([other for other in range(5) if answer(other, kind) != answer(label, kind)])
            # a short review: the tests' pairs fit small blocks
            review = f"The {rng.choice(_DISHES)} was {rng.choice(_WORDS[label])}. {_ENDINGS[label]}"
            prompt = question(review, kind)
            good, bad = answer(label, kind), answer(wrong, kind)
            if style == "strings":
                row = {"prompt": prompt + "\nAnswer:", "chosen": " " + good, "rejected": " " + bad}
            else:
                turns = [{"role": "user", "content": prompt}]
                said = lambda text: [{"role": "assistant", "content": text}]
                row = {"prompt": turns, "chosen": said(good), "rejected": said(bad)} if style == "messages" else \
                    {"chosen": turns + said(good), "rejected": turns + said(bad)}
            f.write(json.dumps(row) + "\n")


def held_out_question(seed=12345):
    """A question about a review the demo never trains on, and its answer: what `make demo` asks at the end."""
    rng = random.Random(seed)
    label = rng.randrange(5)
    return question(_review(rng, label), 0), answer(label, 0)


def make_demo_tokenizer(texts, vocab_size=1000):
    """A byte-level BPE tokenizer trained on the corpus, with OPT's special tokens (</s> begins and ends)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "<pad>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def make_demo_lm(path, tokenizer, *, hidden=128, layers=2, heads=4, positions=256, seed=0):
    """A tiny OPT-architecture model with random weights, saved like a pretrained one."""
    from transformers import AutoModelForCausalLM, OPTConfig

    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                       ffn_dim=4 * hidden, num_attention_heads=heads, max_position_embeddings=positions,
                       word_embed_proj_dim=hidden, dropout=0.0, attention_dropout=0.0,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    _save_quietly(AutoModelForCausalLM.from_config(config), path)
    tokenizer.save_pretrained(path)


def _save_quietly(model, path):
    """save_pretrained without its "Writing model shards" bar (the demo builds its models before the scripts quiet
    the libraries)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            logging.enable_progress_bar()


def make_demo_wordpiece_tokenizer(texts, vocab_size=1000):
    """A lowercasing WordPiece tokenizer trained on the corpus, with BERT's special tokens: [CLS] text [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special,
                                                             show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "attention_mask"])  # DistilBERT: no token types


def make_demo_encoder(path, tokenizer, *, dim=64, layers=2, heads=2, positions=256, seed=0):
    """A tiny DistilBERT-architecture encoder with random weights and no task head, saved like a pretrained one."""
    from transformers import AutoModel, DistilBertConfig

    config = DistilBertConfig(vocab_size=len(tokenizer), dim=dim, n_layers=layers, n_heads=heads,
                              hidden_dim=4 * dim, max_position_embeddings=positions, dropout=0.0,
                              attention_dropout=0.0, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    _save_quietly(AutoModel.from_config(config), path)
    tokenizer.save_pretrained(path)


def assets(root=DEMO_DIR):
    """Build the demo's data and models once (atomically, so ranks racing here are safe); return their paths."""
    root = Path(root)
    if not (root / "DONE").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
        make_demo_corpus(tmp / "reviews.csv")
        make_demo_chats(tmp / "questions.jsonl")
        with open(tmp / "reviews.csv") as f:
            texts = [row["text"] for row in csv.DictReader(f)]
        with open(tmp / "questions.jsonl") as f:
            chats = [" ".join(m["content"] for m in json.loads(line)["messages"]) for line in f]
        make_demo_lm(tmp / "opt-demo", make_demo_tokenizer(texts + chats + ["### User: ### Assistant:"]))
        make_demo_encoder(tmp / "distilbert-demo", make_demo_wordpiece_tokenizer(texts))
        (tmp / "DONE").touch()
        try:
            tmp.rename(root)
        except OSError:  # another process finished first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return {"reviews": root / "reviews.csv", "questions": root / "questions.jsonl", "lm": root / "opt-demo",
            "encoder": root / "distilbert-demo"}


LR = 3e-3  # high, so that a model trained from scratch learns in a minute


def defaults():
    """--demo: questions about generated reviews, answered by a tiny model trained from scratch, with settings that
    train in about a minute on a CPU."""
    paths = assets()
    return {"dataset": str(paths["questions"]), "model": str(paths["lm"]), "block_size": 128, "lr": LR,
            "epochs": 3, "log_every": 50, "prompt": held_out_question()[0]}


def classification_defaults():
    paths = assets()
    return {"dataset": str(paths["reviews"]), "model": str(paths["encoder"]), "text_column": "text",
            "label_column": "label", "max_length": 128, "lr": 1e-3, "epochs": 3, "batch_size": 32}


def summary(single, zero, classification):
    """What `make demo` ends with: both runs' losses and how they agree, the answers to the held-out question, the
    classification accuracy."""
    runs = [(name, json.loads((Path(d) / "results.json").read_text())) for name, d in
            (("single-gpu.py", single), ("zero-optimization.py", zero))]
    print("\n--- demo summary " + "-" * 60)
    for name, r in runs:
        print(f"{name:<22}{r['world_size']} rank(s)  loss {r['losses'][0]:.2f} -> {r['losses'][-1]:.4f}  eval loss "
              f"{r['eval_loss']:.4f} (answers only)  {r['tokens_per_sec']:,.0f} tok/s")
    a, b = (np.array(r["losses"]) for _, r in runs)
    n = min(len(a), len(b))
    rel = np.abs(a[:n] - b[:n]) / np.abs(a[:n])
    # where the two runs part: fp32 rounding (summation order differs over ranks), grown by the demo's high lr
    same = int(np.argmax(rel > 1e-6)) if (rel > 1e-6).any() else n
    print(f"same global batches: the first {same} step losses agree to {rel[:max(same, 1)].max():.0e} (relative), "
          f"fp32 rounding; from there the demo's high learning rate ({LR:g}) grows that rounding as the "
          f"loss falls toward 0, and both runs end at the eval losses above")
    question, expected = held_out_question()
    print(f"held-out question: {question.splitlines()[-1]!r} about a review it never saw; expected {expected!r}")
    for name, r in runs:
        print(f"  {name:<20} answered {r.get('sample')!r}")
    c = json.loads((Path(classification) / "results.json").read_text())
    print(f"sequence_classification.py ({c['world_size']} ranks): accuracy {c['accuracy']:.3f}, macro-F1 "
          f"{c['f1_macro']:.3f} on {len(c['labels'])} star ratings")
