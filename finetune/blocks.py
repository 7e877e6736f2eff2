"""Documents -> blocks -> batches: packing the tokenized documents of a split into blocks (--packing), written once as
memory-mapped files, and the model's inputs and shifted targets for a batch of blocks, with the mask that keeps each
document to itself (or FlashAttention's boundaries)."""
import copy
import inspect
from bisect import bisect_left, insort
from typing import Any, NamedTuple

import numpy as np
import torch

from .base import fail

CHUNK = 4096  # pieces of documents written at a time: at most 48 MB of output pages mapped at once
# bits of the per-token flags: this token is predicted (carries loss); a document starts here; (preference pairs) the
# next segment, the pair's rejected sequence, attends to this token too: the prompt the two sequences share
LOSS, DOC_START, SHARED = 1, 2, 4


def best_fit_decreasing(lengths, block_size):
    """Place documents into blocks, every document whole unless it is longer than a block: longest first, each into
    the fullest block it fits in. A long document is cut into pieces of a block each, and its last piece is placed
    like a document. Returns the pieces (document, start, length) in block order, and each piece's block."""
    counts = -(-lengths // block_size)  # pieces per document
    doc = np.repeat(np.arange(len(lengths), dtype=np.int32), counts)
    start = ((np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)) * block_size).astype(np.int32)
    length = np.minimum(lengths[doc] - start, block_size).astype(np.int32)
    order = np.argsort(-length, kind="stable")  # longest first; stable, so the placement is reproducible
    block = np.empty(len(doc), dtype=np.int32)
    free, rooms, nblocks = {}, [], 0  # free: room left -> blocks with that much room; rooms: its keys, sorted
    for a in range(0, len(order), 65_536):  # a slice at a time: no million-element Python lists
        for piece, n in zip(order[a:a + 65_536].tolist(), length[order[a:a + 65_536]].tolist()):
            i = bisect_left(rooms, n)
            if i < len(rooms):
                room = rooms[i]
                b = free[room].pop()
                if not free[room]:
                    del free[room], rooms[i]
            else:
                room, b, nblocks = block_size, nblocks, nblocks + 1
            block[piece] = b
            if room - n:
                if room - n not in free:
                    free[room - n] = []
                    insort(rooms, room - n)
                free[room - n].append(b)
    order = np.argsort(block, kind="stable")  # block after block, each block's pieces in document order
    return doc[order], start[order], length[order], block[order]


def write_split(batches, row_tokens, packing, folder, pairs=False):
    """The split's blocks, as files: tokens.npy and flags.npy (one entry per token, block after block) and
    blocks.npy (per block: start, length, predicted tokens, and the sum of its segments' squared lengths, which
    counts the attention's work). Written in chunks, so memory stays flat in the corpus size. `pairs`: each document
    is a preference pair (its rejected sequence flagged as a document start): a block's count is of its pairs, and
    pieces.npy lists the pairs of the blocks, in order, each by its place among the split's kept pairs (0 ..
    pairs_total - 1, the index of its reference scores: a row skipped or dropped holds no place)."""
    lengths = write_sources(batches, folder)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    doc, src, n, block = placed(lengths, offsets, row_tokens, packing, pairs)
    nblocks = int(block[-1]) + 1 if len(block) else 0
    count = lambda index, weights: np.bincount(index, weights, minlength=nblocks).astype(np.int64)
    table = np.zeros((nblocks, 4), dtype=np.int64)  # start, length, predicted tokens, attended
    table[:, 1], table[:, 3] = count(block, n), count(block, n.astype(np.int64) ** 2)
    table[:, 0] = np.cumsum(table[:, 1]) - table[:, 1]
    out, total = np.cumsum(n, dtype=np.int64) - n, int(n.sum())  # each piece's place in the output
    for name, size in (("tokens.bin", 4), ("flags.bin", 1)):
        with open(folder / name, "wb") as f:
            f.truncate(total * size)
    # The pieces in source order, a chunk at a time, each written to its place. The files are mapped anew per chunk
    # and read in order: a random read of a mapped file maps its neighbouring 64 KB too (the kernel's fault-around),
    # which would map the whole source within a chunk; a write maps its page only.
    order = np.argsort(src, kind="stable")
    for a in range(0, len(order), CHUNK):
        piece = order[a:a + CHUNK]
        m = n[piece]
        first = np.cumsum(m) - m  # each piece's first token in this chunk
        within = np.arange(first[-1] + m[-1]) - np.repeat(first, m)
        read, write = np.repeat(src[piece], m) + within, np.repeat(out[piece], m) + within
        flags = np.memmap(folder / "source-loss", np.uint8, "r")[read] & (LOSS | DOC_START | SHARED)
        flags[first] = DOC_START | (flags[first] & SHARED)  # every piece starts a segment
        table[:, 2] += count(np.repeat(block[piece], m), flags & LOSS)
        np.memmap(folder / "flags.bin", np.uint8, "r+")[write] = flags
        tokens = np.memmap(folder / "source-tokens", np.int32, "r")[read]
        np.memmap(folder / "tokens.bin", np.int32, "r+")[write] = tokens
    if pairs:  # a pair's two sequences attend to themselves (the rejected also to the shared prompt); count: pairs
        source = np.memmap(folder / "source-loss", np.uint8, "r")
        owner = np.repeat(np.arange(len(lengths)), lengths)  # each token's pair
        starts = np.flatnonzero(source & DOC_START)  # each pair's rejected sequence (a pair left out has none)
        rejected = np.zeros(len(lengths), np.int64)
        rejected[owner[starts]] = starts - offsets[owner[starts]]
        shared = np.bincount(owner, (source & SHARED) > 0, minlength=len(lengths)).astype(np.int64)
        chosen, rest, prefix = rejected[doc], n - rejected[doc], shared[doc]
        table[:, 2], table[:, 3] = count(block, None), count(block, chosen ** 2 + rest ** 2 + 2 * rest * prefix)
        np.save(folder / "pieces.npy", np.searchsorted(np.unique(doc), doc))  # (each kept pair once: fit to a block)
    np.save(folder / "blocks.npy", table[table[:, 2] > 0])  # a block with nothing to learn (a long prompt's piece)
    for name in ("source-tokens", "source-loss"):
        (folder / name).unlink()
    return int((lengths > row_tokens).sum()) if packing != "stream" and not pairs else 0  # documents cut (a pair:
    # preference/rows.py's fit fitted it, and counted it)


def write_sources(batches, folder):
    """The documents' tokens and loss flags, one after the other, into source-tokens and source-loss; their lengths."""
    lengths = []
    with open(folder / "source-tokens", "wb") as tokens_out, open(folder / "source-loss", "wb") as loss_out:
        for batch in batches:
            ids, loss = batch.column(0), batch.column(1)
            lengths.append(np.diff(np.asarray(ids.offsets)))
            tokens_out.write(np.asarray(ids.values, dtype=np.int32)[ids.offsets[0].as_py():].tobytes())
            loss_out.write(np.asarray(loss.values, dtype=np.uint8)[loss.offsets[0].as_py():].tobytes())
    return np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)


def placed(lengths, offsets, row_tokens, packing, pairs):
    """(the document of each piece (None for a stream), where it starts in the source, its length, its block), in
    block order, as --packing places them into rows of `row_tokens`; each piece starts a segment of its block."""
    if packing == "isolated":
        doc, start, n, block = best_fit_decreasing(lengths, row_tokens)
        return doc, offsets[doc] + start, n, block
    if packing == "stream":  # concatenated and cut: each block is one segment, documents see each other
        src = np.arange(0, offsets[-1], row_tokens)
        return None, src, np.minimum(row_tokens, offsets[-1] - src), np.arange(len(src))
    # one document per row, cut at the row (the rest is dropped); a pair whole, its two sequences a row each later
    keep = lengths > 0
    doc, src = np.flatnonzero(keep), offsets[:-1][keep]
    return doc, src, lengths[keep] if pairs else np.minimum(lengths[keep], row_tokens), np.arange(len(src))



class Targets(NamedTuple):
    """What the loss takes of a batch beside the model's inputs (Blocks.batch): the labels, shifted (-100: no loss),
    and the flat index of the positions that carry loss. Preference pairs add each predicted token's answer (2 a
    pair: chosen, rejected), the count of pairs, and their reference log-probabilities (None while those are
    scored: the loss then returns the answers' log-probabilities). Unpaired rows (KTO: a pair's answers are the
    completion and the KL completion) add whether each completion is desirable, and the KL term of the batch's step
    (preference.kl_point)."""
    labels: Any
    index: Any
    sequence: Any = None
    pairs: int = 0
    reference: Any = None
    desirable: Any = None
    kl: Any = None

    @property
    def counted(self):
        """What the loss is divided by over a batch: its pairs, or its tokens that carry loss."""
        return self.pairs if self.sequence is not None else len(self.index)

class Batch(NamedTuple):
    """A micro-batch, whole: the model's inputs (a dict) and the loss's targets (Targets)."""
    inputs: dict
    targets: Targets


class HostRows(NamedTuple):
    """A batch's rows on the host before they go to the device (Blocks.rows): token ids, positions, shifted labels,
    where each segment starts, which answer each token is of (pairs), the shared prompt's tokens and how many of
    them each token sees (pairs, or None), the varlen boundaries (or None), the rows' width."""
    ids: Any
    positions: Any
    labels: Any
    starts: Any
    sequence: Any
    shared: Any
    prefix: Any
    bounds: Any
    width: int


class Blocks:
    """A prepared split, memory-mapped. Per block: `lengths` (tokens), `predicted` (tokens that carry loss) and
    `attended` (the tokens each token attends to, summed: for the FLOPs count), known up front, so the loss
    normalization and the throughput figures need no device synchronization."""
    desirable = None  # unpaired rows (KTO): whether each unit's completion is desirable, by its place

    def __init__(self, folder, meta):
        self.tokens = np.memmap(folder / "tokens.bin", np.int32, "r") if (folder / "tokens.bin").stat().st_size else []
        self.flags = np.memmap(folder / "flags.bin", np.uint8, "r") if (folder / "flags.bin").stat().st_size else []
        table = np.load(folder / "blocks.npy")
        self.starts, self.lengths, self.predicted, self.attended = (table[:, i] for i in range(4))
        self.format, self.examples, self.cut = meta["format"], meta.get("examples", []), meta[folder.name]["cut"]
        self.pairs_said = meta[folder.name].get("pairs", "")  # preference pairs cut, dropped, skipped: counted
        self.source = f"{folder.parent.name}/{folder.name}"  # the prepared data's key (data.py: its inputs' hash)
        paired = self.format in ("preference", "unpaired")  # (preference.FORMATS)
        self.pieces = np.load(folder / "pieces.npy") if paired else None  # pairs, block by block
        self.pairs_total = len(self.pieces) if self.pieces is not None else 0
        if self.format == "unpaired":
            self.desirable = np.load(folder / "desirable.npy")
        self.first_piece = np.cumsum(self.predicted) - self.predicted
        self.packing, self.row_tokens = meta["packing"], meta["row_tokens"]  # (a row's most tokens)
        self.split_rows = self.pieces is not None and meta["packing"] == "none"  # a pair's sequences: two rows
        self.reference = None  # the pairs' reference log-probabilities (with_reference)
        if len(self.starts) == 0 or self.predicted.sum() == 0:
            cut = f"; {self.cut} documents were cut at the block size: raise --block-size" if self.cut else ""
            fail(f"the {folder.name} split has no tokens to learn from (empty texts, or the loss masked "
                 f"everywhere{cut})")

    def with_reference(self, scores):
        """The same blocks with their pairs' reference log-probabilities, (pairs, 2) (preference.reference): a
        column of the data, as TRL's precomputed reference log-probabilities are."""
        scored = copy.copy(self)
        scored.reference = scores
        return scored

    def __len__(self):
        return len(self.starts)

    def describe(self, packing):
        if self.desirable is not None:
            said = f"; {self.pairs_said}" if self.pairs_said else ""
            return f"{self.pairs_total} completions ({int(self.desirable.sum())} desirable) in {len(self)} sequences " \
                   f"of <= {self.lengths.max()} tokens (unpaired, KTO, {packing} packing{said})"
        if self.pieces is not None:
            said = f"; {self.pairs_said}" if self.pairs_said else ""
            return f"{self.pairs_total} pairs in {len(self)} sequences of <= {self.lengths.max()} tokens " \
                   f"(preference, {packing} packing{said})"
        cut = f"; {self.cut} documents longer than a block were cut: raise --block-size?" if self.cut else ""
        return f"{len(self)} sequences of <= {self.lengths.max()} tokens ({self.format}, {packing} packing{cut})"

    def batch(self, indices, process, *, carry_loss=True, sequence_shard=None, width=None, kl=None):
        """The model's inputs and the loss targets for these blocks (a Batch). Labels are shifted here, on the host
        (label t is token t+1, or -100), so the loss never copies the logits to shift them; with them comes the flat
        index of the positions that carry loss, so the loss computes logits for those only. Each document attends
        only to itself: a block-diagonal causal mask (unless a row is one whole segment), or, with FlashAttention,
        the rows laid end to end without padding and cut at the documents' boundaries (varlen). Padding attends to
        itself only and carries no loss. `process`: training.Process (its device, padding token and the model's
        config). `sequence_shard`: (this rank's place, ranks) in a sequence-parallel group: its slice of the tokens
        and targets (sequence_parallel.py), no mask (the attention builds it). `width`: rows padded to this many
        tokens at least (--compile: one shape, one graph; FlashAttention's single row is left as it is). `kl`: KTO's
        reference point for the step (preference.kl_point), handed to the loss."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        layout = attention_layout(getattr(process.model_config, "_attn_implementation", None))
        host = self.rows(indices, process.pad_id, width, carry_loss=carry_loss, varlen=layout == "varlen")
        device = process.device
        if sequence_shard and sequence_shard[1] > 1:
            from .internals import sequence_parallel
            inputs, (labels, index) = sequence_parallel.shard(host, *sequence_shard, process, layout)
            return Batch(inputs, Targets(labels, index))
        segments = np.cumsum(host.starts, axis=-1)
        where_loss = np.flatnonzero(host.labels != -100)
        index = process.to_device(where_loss)
        ids, positions, labels, segments = process.to_device(np.stack([host.ids, host.positions, host.labels,
                                                                       segments]))
        inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
        if layout == "varlen":
            cu = process.to_device(host.bounds)
            longest = int(np.diff(host.bounds).max())
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        elif host.starts[:, 1:].any() or width and self.packing != "stream":
            # (else one causal segment a row, no padding: the model's own mask; under --compile only where every batch
            # is so, a stream, so that one graph takes them all)
            causal = torch.ones(host.width, host.width, dtype=torch.bool, device=device).tril()
            same = (segments[:, None, :, None] == segments[:, None, None, :]) & causal
            if host.prefix is not None:  # a rejected answer's tokens also see the prompt in the segment before theirs
                key, query = process.to_device(np.stack([host.shared, host.prefix > 0]))
                same |= ((segments[:, None, :, None] - 1 == segments[:, None, None, :]) & key[:, None, None, :]
                         & query[:, None, :, None])
            inputs["attention_mask"] = document_masks(same, process.model_config, layout, positions)
        if self.pieces is None:
            return Batch(inputs, dynamic(Targets(labels, index), width))
        # pairs: per predicted token its sequence (2 per pair: chosen, rejected), and the pairs' references
        pairs = self.pair_ids(indices) if carry_loss else np.zeros(0, np.int64)
        # (pinned and asynchronous on a GPU, as the batch's other host arrays: no wait on the device a micro-step)
        reference = process.to_device(self.reference.numpy()[pairs]) if self.reference is not None else None
        desirable = process.to_device(self.desirable[pairs]) if self.desirable is not None else None
        sequence = process.to_device(host.sequence.ravel()[where_loss])
        return Batch(inputs, dynamic(Targets(labels, index, sequence, len(pairs), reference, desirable, kl), width))

    def rows(self, indices, pad_id, width=None, *, carry_loss=True, varlen=False):
        """These blocks on the host (HostRows): each a row, padded to the longest (and to `width`); with `varlen` the
        real tokens of all in one row and the segments' boundaries."""
        first, lengths = self.starts[indices], self.lengths[indices]
        if self.split_rows:  # --packing none with pairs: the chosen sequence a row, the rejected the next
            chosen = np.array([1 + np.flatnonzero(self.flags[a + 1:a + n] & DOC_START)[0]
                               for a, n in zip(first, lengths)])
            first = np.stack([first, first + chosen], 1).ravel()
            lengths = np.stack([chosen, lengths - chosen], 1).ravel()
        width = max(int(lengths.max()), width or 0)
        cols = np.arange(width)
        real = cols[None, :] < lengths[:, None]
        where = np.where(real, first[:, None] + cols[None, :], 0)
        ids = np.where(real, self.tokens[where], pad_id).astype(np.int64)
        flags = np.where(real, self.flags[where], DOC_START)  # each pad token is a segment of its own
        starts, shared = (flags & DOC_START) > 0, (flags & SHARED) > 0
        positions = cols[None, :] - np.maximum.accumulate(np.where(starts, cols[None, :], 0), axis=1)
        prefix = shared_prefix(starts, shared) if shared.any() else None
        if prefix is not None:  # a rejected answer goes on from the prompt it shares with its chosen one
            positions = positions + prefix
        labels = np.full_like(ids, -100)
        labels[:, :-1] = np.where(flags[:, 1:] & LOSS & carry_loss, ids[:, 1:], -100)
        sequence = np.cumsum(starts & real).reshape(real.shape) - 1  # pairs: which answer each token is of
        if not varlen:
            return HostRows(ids, positions, labels, starts, sequence, shared, prefix, None, width)
        # one row of the real tokens; FlashAttention takes the segments' boundaries
        ids, labels, starts, sequence = (x[real] for x in (ids, labels, starts, sequence))
        if prefix is not None:
            ids, labels, starts, sequence = unshared(ids, labels, starts, sequence, shared=shared[real],
                                                     prefix=prefix[real])
        at = np.arange(len(ids))
        positions = at - np.maximum.accumulate(np.where(starts, at, 0))
        ids, positions, labels, starts, sequence = (x[None] for x in (ids, positions, labels, starts, sequence))
        bounds = np.append(np.flatnonzero(starts[0]), starts.size).astype(np.int32)
        return HostRows(ids, positions, labels, starts, sequence, shared, prefix, bounds, width)

    def pair_ids(self, indices):
        """The pairs (rows of the split) in these blocks, in the order their sequences lie in a batch of them."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        return np.concatenate([self.pieces[a:a + k] for a, k in zip(self.first_piece[indices],
                                                                     self.predicted[indices])]).astype(np.int64)


def shared_prefix(starts, shared):
    """Per token, how many tokens of the segment before its own it attends to as well (the SHARED ones): a pair's
    rejected answer, the prompt its chosen sequence holds; 0 elsewhere (a row's first segment: the row before it ends
    with a whole pair or padding)."""
    segment = np.cumsum(starts.ravel()) - 1
    counts = np.bincount(segment, shared.ravel(), minlength=segment[-1] + 1).astype(np.int64)
    return np.concatenate([[0], counts[:-1]])[segment].reshape(starts.shape)


def unshared(ids, labels, starts, sequence, *, shared, prefix):
    """FlashAttention's varlen layout (one row, cut at the segments' boundaries) cannot let a segment see another:
    each rejected answer gets its own copy of the shared prompt back, before it, carrying no loss."""
    at = np.flatnonzero(starts & (prefix > 0))  # the rejected answers' first tokens
    where = np.repeat(at, prefix[at])
    first = np.zeros(len(where), dtype=bool)
    first[np.cumsum(prefix[at]) - prefix[at]] = True  # the copy starts the segment
    starts = starts.copy()
    starts[at] = False
    return (np.insert(ids, where, ids[shared]), np.insert(labels, where, -100), np.insert(starts, where, first),
            np.insert(sequence, where, sequence[where]))


def document_masks(same, config, layout, positions=None):
    """The 4-D mask of each document attending to itself (`same`), with the model's sliding window where its layers
    have one: a 4-D mask passes transformers' mask building as it is, so a layer that attends only to its last
    `sliding_window` tokens (Mistral's, Gemma 2/3's local layers, gpt-oss's) must get that window here, or training
    would attend further than inference does. Models that mix full and sliding layers take a mask per layer type."""
    # a multimodal model (Gemma 3 4B and up) keeps its layers' settings in its text config (hardware.text_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    # a mask per layer type where the model takes one (its config class declares layer_types); Mistral's model takes
    # one mask, windowed in every layer, even when a checkpoint's config lists layer types (transformers warns of those)
    declared = any("layer_types" in inspect.get_annotations(k) for k in type(config).__mro__)
    types = getattr(config, "layer_types", None) if declared else None
    kinds = set(types or ["sliding_attention" if window else "full_attention"])
    as_layout = lambda m: m if layout != "additive" else torch.zeros(m.shape, device=m.device).masked_fill_(
        ~m, torch.finfo(torch.float32).min)  # eager attention adds the mask to the scores
    masks = {"full_attention": same}
    if window and "sliding_attention" in kinds:  # the last `window` positions, itself in (a shared prompt: apart)
        i = torch.arange(same.shape[-1], device=same.device) if positions is None else positions[:, None, :]
        masks["sliding_attention"] = same & (i[..., :, None] - i[..., None, :] < window)
    masks = {kind: as_layout(masks.get(kind, same)) for kind in kinds}
    return masks.popitem()[1] if len(masks) == 1 else masks


def attention_layout(implementation):
    """How a batch tells the model where documents end, for its attention implementation: SDPA takes a boolean 4D
    mask (True: attend), eager attention an additive one (a 4D mask passes transformers' mask building as it is),
    FlashAttention no mask but the documents' boundaries in one padding-free row (its varlen kernel, flash-attn's or
    torch's)."""
    if implementation and ("flash" in implementation or implementation == "torch_varlen"):  # and the hub's kernels
        return "varlen"
    return "additive" if implementation == "eager" else "bool"


def dynamic(targets, width):
    """Under --compile (a `width`), the loss's sizes marked dynamic: the count of tokens that carry loss (and of
    pairs) changes from batch to batch, and the compiled forward, which takes the targets, would compile anew for the
    first change."""
    if width:
        for tensor in (targets.index, targets.sequence, targets.reference, targets.desirable):
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return targets


def rank_batches(count, batch_size, rank, world_size):
    """This rank's blocks for each pass over `count` blocks in order: the same number of passes on every rank (a
    collective each under ZeRO-3), the last ones short or empty."""
    per_pass = batch_size * world_size
    for start in range(0, count, per_pass):
        yield torch.arange(start, min(start + per_pass, count))[rank * batch_size:(rank + 1) * batch_size]
