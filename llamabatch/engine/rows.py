"""How a step's sequences (and deterministic fillers) become the rows of one llama_batch."""

from __future__ import annotations

from .scheduler import Filler
from .sequence import Sequence


def lay_out(rows: list[Sequence | Filler], filler_logits: bool) -> tuple[list[int], list[int], list[int], list[int], dict[int, int]]:
    """The batch's tokens, positions, seq_ids and logits flags for `rows` (in the order given),
    and for each batch row that has logits, its row in the decode's output.

    Each sequence's chunk is its tokens from n_past on (seq.n_chunk of them; its row is recorded
    as seq.chunk_row). A chunk that ends at its sequence's newest token asks for logits there
    (that row is seq.i_batch, -1 otherwise); a drafting sequence asks for them on every row, a
    scored prompt on the rows it scores."""
    tokens: list[int] = []
    pos: list[int] = []
    seq_ids: list[int] = []
    logits: list[int] = []
    output_row: dict[int, int] = {}
    others = False  # rows other than each sequence's last ask for logits
    for row in rows:
        if isinstance(row, Filler):
            tokens.append(0)
            pos.append(row.pos)
            seq_ids.append(row.seq_id)
            logits.append(int(filler_logits))
            others |= filler_logits
            continue
        start, n = row.n_past, row.n_chunk
        row.chunk_row = len(tokens)
        if row.draft:  # its last token and the drafts after it, each with logits to verify it
            others = True
            tokens.append(row.tokens[start])
            tokens += row.draft
            pos += range(start, start + n)
            seq_ids += [row.seq_id] * n
            logits += [1] * n
            row.i_batch = len(tokens) - 1
            continue
        if n == 1:  # most rows are one token (decoding): no slices and ranges for them
            tokens.append(row.tokens[start])
            pos.append(start)
            seq_ids.append(row.seq_id)
            logits.append(0)
        else:
            tokens += row.tokens[start : start + n]
            pos += range(start, start + n)
            seq_ids += [row.seq_id] * n
            logits += [0] * n
        scored = row.scored_rows(start, n)
        if scored:
            others = True
            logits[row.chunk_row + scored.start - start : row.chunk_row + scored.stop - start] = [1] * len(scored)
        # Logits for sampling only where the chunk ends at the newest token: a prompt chunk cut
        # short by the budget (even to one token) has more prompt to come.
        row.i_batch = len(tokens) - 1 if start + n == len(row.tokens) else -1
        if row.i_batch >= 0:
            logits[-1] = 1
            output_row[row.i_batch] = len(output_row)
    if others:  # count every row that asks for logits
        output_row = {i: k for k, i in enumerate(i for i, flag in enumerate(logits) if flag)}
    return tokens, pos, seq_ids, logits, output_row


def lay_out_decodes(rows: list[Sequence]) -> tuple[list[int], list[int], list[int]]:
    """The batch of a plain step (scheduler.decodes_only): each sequence's newest token at its
    n_past, every row with logits, so row k of the output is rows[k]'s."""
    return [seq.tokens[-1] for seq in rows], [seq.n_past for seq in rows], [seq.seq_id for seq in rows]
