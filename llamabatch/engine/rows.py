"""How a step's sequences (and deterministic fillers) become the rows of one llama_batch."""

from __future__ import annotations

from dataclasses import dataclass

from .scheduling.fillers import Filler
from .step import Step


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a step's rows landed: for rows[k], the batch row of its chunk's first token
    (first[k]) and the row of the decode's output it samples from (sampled[k]; -1 when its chunk
    stops short of its newest token: more prompt comes next step). output_row maps each batch
    row that has logits to its row of the output."""

    first: list[int]
    sampled: list[int]
    output_row: dict[int, int]


@dataclass(frozen=True, slots=True)
class Columns:
    """The batch's columns: token, position, seq_id and logits flag of each row."""

    tokens: list[int]
    pos: list[int]
    seq_ids: list[int]
    logits: list[int]


def lay_out(step: Step, fillers: list[Filler], filler_logits: bool) -> tuple[Columns, Layout]:
    """The batch for a step (its rows in order, fillers between them by seq_id), and where each
    row landed. Each sequence's chunk is its tokens from n_past on; a chunk that ends at its
    newest token asks for logits there, a drafting row on every row (its last token, then the
    drafts after it), a scored prompt on the rows it scores."""
    entries: list[tuple[object, int]] = list(zip(step.rows, step.chunks))
    if fillers:  # llama.cpp groups consecutive seq_ids into one micro-batch
        entries = sorted([*entries, *((filler, 1) for filler in fillers)], key=lambda entry: entry[0].seq_id)
    tokens: list[int] = []
    pos: list[int] = []
    seq_ids: list[int] = []
    logits: list[int] = []
    first: list[int] = []
    last: list[int] = []  # each row's batch row that it samples from, or -1
    others = False  # rows other than each sequence's last ask for logits
    for row, n in entries:
        if isinstance(row, Filler):
            tokens.append(0)
            pos.append(row.pos)
            seq_ids.append(row.seq_id)
            logits.append(int(filler_logits))
            others |= filler_logits
            continue
        start = row.n_past
        p = row.position(start) if row.shift else start  # its position: start, unless M-RoPE images came before
        first.append(len(tokens))
        if row.draft:  # its last token and the drafts after it, each with logits to verify it
            others = True
            n = 1 + len(row.draft)
            tokens.append(row.tokens[start])
            tokens += row.draft
            pos += range(p, p + n)
            seq_ids += [row.seq_id] * n
            logits += [1] * n
            last.append(len(tokens) - 1)
            continue
        if n == 1:  # most rows are one token (decoding): no slices and ranges for them
            tokens.append(row.tokens[start])
            pos.append(p)
            seq_ids.append(row.seq_id)
            logits.append(0)
        else:
            tokens += row.tokens[start : start + n]
            pos += range(p, p + n)
            seq_ids += [row.seq_id] * n
            logits += [0] * n
        scored = row.scored_rows(start, n)
        if scored:
            others = True
            at = first[-1] + scored.start - start
            logits[at : at + len(scored)] = [1] * len(scored)
        # Logits for sampling only where the chunk ends at the newest token: a prompt chunk cut
        # short by the budget (even to one token) has more prompt to come.
        last.append(len(tokens) - 1 if start + n == len(row.tokens) else -1)
        if last[-1] >= 0:
            logits[-1] = 1
    flagged = (i for i, flag in enumerate(logits) if flag) if others else (i for i in last if i >= 0)
    output_row = {i: k for k, i in enumerate(flagged)}
    return Columns(tokens, pos, seq_ids, logits), Layout(first, [output_row[i] if i >= 0 else -1 for i in last], output_row)


def lay_out_decodes(step: Step) -> tuple[list[int], list[int], list[int]]:
    """The batch of a plain step: each sequence's newest token at its position (n_past, less
    the shift of its M-RoPE images, all before it), every row with logits, so row k of the
    output is rows[k]'s."""
    rows = step.rows
    return [seq.tokens[-1] for seq in rows], [seq.n_past - seq.shift for seq in rows], [seq.seq_id for seq in rows]
