"""Preference pairs' rows -> one packing unit each (data.py prepares them; the loss: pair_loss.py).

The formats, found from the columns (TRL's names; docs/preference.md):
  prompt + chosen + rejected   strings (the answers follow the prompt), or messages (the prompt a list of turns,
                               chosen and rejected the assistant's turns), rendered with the chat template
  chosen + rejected            whole texts or conversations: the prompt is their shared beginning
A pair is one document of the prepared files: the chosen sequence, then the rejected one, which starts a segment of
its own, so packing places pairs whole and every micro-batch holds whole pairs. With isolated packing the rejected
sequence holds only the prompt's last token and its answer, and attends to the rest of the prompt where the chosen
sequence holds it (pair_document): the prompt is computed once. A sequence's log-probability is the sum over its
answer's tokens (the loss mask). --block-size bounds each sequence, the prompt and one answer, as TRL's max_length
does (a packed pair's row holds up to twice it): a longer one loses its answer's end (as TRL cuts a sequence at its
end), then, with the answers at a floor, the prompt's middle (its start and its end kept); one that cannot fit even
so is dropped, one with nothing to prefer skipped: each counted and said at start (fit).

Unpaired feedback (KTO; TRL's unpaired format: prompt + completion + label, true for a desirable completion) goes the
same way: its first sequence the row's completion, its second another row's completion after the same prompt (the
mismatched pair KTO's reference point, the KL term, is estimated from: mismatched), so a row is one unit, packed and
scored as a pair is; its label is kept beside it (data.py: desirable.npy).
"""
import collections

import numpy as np

COLUMNS = ("prompt", "chosen", "rejected")
UNPAIRED_COLUMNS = ("prompt", "completion", "label")  # KTO's rows
FORMATS = ("preference", "unpaired")  # data.py's formats whose rows are units of two sequences


# ----------------------------------------------------------------------------------------------------
# Rows -> pair documents

def _messages(value):
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value)


def split_prompt(row):
    """(prompt, chosen, rejected) of a row, with an implicit prompt taken as the answers' shared beginning (whole
    turns of a conversation; for text, up to the space before the first character that differs); or an error."""
    chosen, rejected = row["chosen"], row["rejected"]
    if row.get("prompt") is not None:  # (a file that gives some rows a prompt gives the others None)
        return row["prompt"], chosen, rejected, None
    if isinstance(chosen, str) and isinstance(rejected, str):
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        shared = len(chosen[:shared].rstrip())  # the space goes with the answers, as a tokenizer reads a word
        return chosen[:shared], chosen[shared:], rejected[shared:], None
    if _messages(chosen) and _messages(rejected):
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        return chosen[:shared], chosen[shared:], rejected[shared:], None
    return None, None, None, "chosen and rejected are not both strings or both lists of {role, content}"


def row_error(prompt, chosen, rejected):
    """Why a pair cannot be trained on, or None."""
    if not chosen or not rejected:
        return f"the {'chosen' if not chosen else 'rejected'} answer is empty"
    if chosen == rejected:
        return "chosen and rejected are the same: nothing to prefer"
    if isinstance(chosen, str) != isinstance(rejected, str) or isinstance(chosen, str) != isinstance(prompt, str):
        return "prompt, chosen and rejected are not all strings or all lists of {role, content}"
    if isinstance(chosen, list):
        for name, turns in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not _messages(turns):
                return f"{name} is not a list of {{role, content}} pairs of strings"
        for name, turns in (("chosen", chosen), ("rejected", rejected)):
            if turns[-1]["role"] != "assistant":
                return f"the last turn of {name} is the {turns[-1]['role']}'s, not the assistant's"
    return None


def sequence(tokenizer, prompt, answer, chat_document):
    """Token ids of prompt + answer and the mask of the answer's tokens (with the EOS that ends it)."""
    if isinstance(answer, str):
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return p + a, [0] * len(p) + [1] * len(a)
    ids, mask = chat_document(tokenizer, prompt + answer)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)  # where each assistant turn's tokens begin
    earlier = sum(m["role"] == "assistant" for m in prompt)  # the prompt's own assistant turns are context
    if earlier:
        mask = [0] * int(runs[earlier]) + list(mask[runs[earlier]:]) if len(runs) > earlier else [0] * len(mask)
    return list(ids), list(mask)


def prompt_length(chosen, rejected):
    """The prompt's tokens: those both sequences begin with, up to the first answer token of either."""
    (c, cm), (r, rm) = chosen, rejected
    return next((i for i, (x, y) in enumerate(zip(c, r)) if x != y or cm[i] or rm[i]), min(len(c), len(r)))


ANSWER_FLOOR = 16  # tokens of each answer kept at least (all of a shorter one) before the prompt is cut
PROMPT_HEAD = 16  # the prompt's first tokens (the BOS, a system turn's start), never cut


def fit(chosen, rejected, block_size):
    """The pair's two (ids, mask) cut so that each sequence, the prompt and one answer, holds at most `block_size`
    tokens (TRL's max_length: packed or not, --block-size means what it means there), and how: (chosen, rejected,
    None) whole; (..., "answers") an answer's end cut, as TRL cuts a sequence at its end; (..., "prompt") the answers
    cut to ANSWER_FLOOR tokens and the prompt's middle cut (its first PROMPT_HEAD tokens and its end, the question and
    the turn's header, kept); (None, None, "dropped") when not even that fits. Packed, a pair's row holds the prompt
    once and both answers: up to twice the block (pair_document; blocks.write_split)."""
    (c, cm), (r, rm) = chosen, rejected
    p = prompt_length(chosen, rejected)
    a, b = len(c) - p, len(r) - p

    def answers_beside(n):  # the most each answer keeps beside a prompt of n tokens
        return min(a, block_size - n), min(b, block_size - n)

    def keep(ids, mask, head, tail, n):  # the prompt's first `head` and last `tail` tokens, then n of the answer
        return ids[:head] + ids[p - tail:p + n], mask[:head] + mask[p - tail:p + n]

    if answers_beside(p) == (a, b):
        return chosen, rejected, None
    floor_a, floor_b = min(a, ANSWER_FLOOR), min(b, ANSWER_FLOOR)
    a2, b2 = answers_beside(p)
    if a2 >= floor_a and b2 >= floor_b:
        return keep(c, cm, p, 0, a2), keep(r, rm, p, 0, b2), "answers"
    n = block_size - max(floor_a, floor_b)
    head = min(PROMPT_HEAD, p - 1)
    if p < 2 or n < head + 1:  # not even the prompt's head, its last token and a floor of each answer
        return None, None, "dropped"
    return keep(c, cm, head, n - head, floor_a), keep(r, rm, head, n - head, floor_b), "prompt"


def pair_document(chosen, rejected, share):
    """(ids, flags) of a pair: the chosen sequence, then the rejected one as a segment of its own (flag 2). `share`
    (isolated packing): the rejected sequence goes on from the prompt's last token, and sees the prompt's other
    tokens where the chosen sequence holds them (flag 4; blocks.py gives its tokens their positions and mask), so a
    prompt is computed once, not twice, and the numbers are those of two separate sequences."""
    (c, cm), (r, rm) = chosen, rejected
    keep = max(prompt_length(chosen, rejected) - 1, 0) if share else 0  # the prompt's tokens but its last
    flags = [m | (4 if i < keep else 0) for i, m in enumerate(cm)] + [2] + list(rm[keep + 1:])
    return c + r[keep:], flags


def documents(rows, tokenizer, block_size, chat_document, share=False):
    """The pair documents of these rows: ids and loss flags (1: predicted; 2: the rejected sequence starts here; 4:
    the rejected sequence attends to this prompt token too), empty for a pair left out; and what became of each:
    None (whole), "cut answers", "cut prompt", "dropped: ..." (too long even cut) or "skipped: ..." (no pair to
    learn from: an empty answer, two the same; public preference sets hold such rows), counted and said at start."""
    ids, loss, notes = [], [], []
    for row in rows:
        prompt, chosen, rejected, error = split_prompt(row)
        error = error or row_error(prompt, chosen, rejected)
        pair, note = None, f"skipped: {error}" if error else None
        if error is None:
            try:
                c, r = (sequence(tokenizer, prompt, answer, chat_document) for answer in (chosen, rejected))
                c, r, how = fit(c, r, block_size)
                if how == "dropped":
                    note = f"dropped: longer than --block-size {block_size} with {PROMPT_HEAD} prompt tokens and " \
                           f"{ANSWER_FLOOR} of each answer"
                elif c == r:
                    note = "skipped: the answers tokenize the same"
                else:
                    pair, note = pair_document(c, r, share), how and f"cut {how}"
            except ValueError as e:
                note = f"skipped: {e}"
        ids.append(pair[0] if pair else [])
        loss.append(pair[1] if pair else [])
        notes.append(note)
    return ids, loss, notes


def mismatched(prompts, completions):
    """Each row's KL completion: the completion of the nearest earlier row with another prompt and another
    completion (the first rows take the last ones'), as TRL's KTO takes the batch's completions shifted by one; None
    where none of the 64 rows before has one (an empty completion gives none, and gets none). Another prompt: a file
    that lists a prompt's good and bad completions one after the other would otherwise pair a prompt with one of its
    own answers."""
    usable = [i for i, c in enumerate(completions) if c and isinstance(c, (str, list))]
    other = [None] * len(completions)
    for place, i in enumerate(usable):
        for back in range(1, min(len(usable), 65)):
            j = usable[place - back]
            if prompts[j] != prompts[i] and completions[j] != completions[i]:
                other[i] = completions[j]
                break
    return other


def unpaired_documents(rows, tokenizer, block_size, chat_document, share=False):
    """documents() of unpaired rows (prompt, completion, label, kl_completion: mismatched's): the completion as the
    first sequence, the KL completion after the same prompt as the second."""
    checked = []
    for row in rows:
        label, error = row["label"], None
        if not isinstance(label, bool) and label not in (0, 1):
            error = "the label is not true or false"
        elif not row["completion"]:
            error = "the completion is empty"
        elif row["kl_completion"] is None:
            error = "no other row's completion to estimate the KL term from"
        pair = {"prompt": row["prompt"], "chosen": row["completion"], "rejected": row["kl_completion"]}
        checked.append(error or pair)
    ids, loss, notes = documents([row for row in checked if not isinstance(row, str)], tokenizer, block_size,
                                 chat_document, share)
    kept = iter(zip(ids, loss, notes))
    out = [([], [], f"skipped: {row}") if isinstance(row, str) else next(kept) for row in checked]
    return [list(x) for x in zip(*out)] if out else ([], [], [])


def counted(notes):
    """'3 pairs cut (2 answers' ends, 1 prompt's middle too); 1 dropped (...); 2 skipped (...)' from documents'
    notes, or ''."""
    kinds = collections.Counter(n.split(":")[0] for n in notes if n)

    def reasons(kind):  # the two most frequent, each with its count where there are several
        found = collections.Counter(x.split(": ", 1)[1] for x in notes if x and x.startswith(kind)).most_common()
        return found[0][0] if len(found) == 1 else "; ".join(f"{n}: {why}" for why, n in found[:2])
    parts = []
    if kinds["cut answers"] + kinds["cut prompt"]:
        parts.append(f"{kinds['cut answers'] + kinds['cut prompt']} pairs cut to fit a block ({kinds['cut answers']} "
                     f"the answers' ends, {kinds['cut prompt']} the prompt's middle too)")
    for kind in ("dropped", "skipped"):
        if kinds[kind]:
            parts.append(f"{kinds[kind]} {kind} ({reasons(kind)})")
    return "; ".join(parts)


def examples_prompt(row):
    """(messages or None, prompt text, preferred answer) of a prepared example row, for the answers and the sample
    (an unpaired row's completion where it is desirable, else no answer)."""
    if "completion" in row:
        prompt, chosen, error = row["prompt"], row["completion"] if row["label"] else None, None
    else:
        prompt, chosen, _, error = split_prompt(row)
    if error or prompt is None:
        return None, "", ""
    if isinstance(prompt, list):
        return prompt, prompt[-1]["content"] if prompt else "", chosen[-1]["content"] if chosen else ""
    return None, prompt, chosen or ""
