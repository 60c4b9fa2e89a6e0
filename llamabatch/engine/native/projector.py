"""The owner of libmtmd's handle, the projector that reads images and audio clips into embeddings
the text model takes; and their decoding into sequences' positions, through a Batch of embedding rows."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

try:  # a binding built without libmtmd still serves text
    import llama_cpp.mtmd_cpp as mtmd
except (ImportError, OSError):  # the module, or the library it loads
    mtmd = None  # type: ignore[assignment]

from ...catalog import check_gguf
from ...errors import ModelError, PromptError
from . import backend
from .handles import Batch, Context, Model, _Owner

# Where a prompt's text shows its next image or clip (libmtmd's default marker, set on the projector).
MEDIA_MARKER = "<__media__>"

# Encoded images and clips kept for the next prompt that shows the same one (the same photo asked
# about by several questions is encoded once): a few of a 7B model's 576-token images.
ENCODED_CACHE_BYTES = 64 << 20


def is_audio(data: bytes) -> bool:
    """Whether libmtmd reads these bytes as audio (WAV, MP3, FLAC), as its helper tells them
    from images (mtmd-helper.cpp's is_audio_file)."""
    if len(data) < 12:
        return False
    wav = data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    mp3 = data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
    return wav or mp3 or data[:4] == b"fLaC"


@dataclass(frozen=True, eq=False)
class Encoded:
    """One image or audio clip as the text model takes it: a row of embeddings per KV cell it fills."""

    key: str  # libmtmd's id for it: a hash of its file's bytes
    embeddings: np.ndarray  # (n_tokens, n_embd) float32
    non_causal: bool  # its positions attend to each other both ways (Gemma 3's images)
    # M-RoPE (Qwen2-VL and kin): an image's rows sit on a grid of positions (time, row, column,
    # unused), each row's four at `base + first * moves` for an image starting at position
    # `first`; the positions after it begin n_pos on, fewer than its rows. None: one position a row.
    n_pos: int
    base: np.ndarray | None = None  # (4, n_tokens) int32, section-major as llama_batch takes them
    moves: np.ndarray | None = None  # (4, n_tokens) int32, 0 or 1

    @property
    def n_tokens(self) -> int:
        return len(self.embeddings)

    def positions(self, first: int) -> np.ndarray:
        """Its rows' positions when it starts at position `first`: (1, n_tokens), one a row, or
        (4, n_tokens) on M-RoPE's grid."""
        if self.base is None or self.moves is None:
            return np.arange(first, first + self.n_tokens, dtype=np.int32)[None, :]
        return self.base + first * self.moves


Piece = list[int] | Encoded  # a prompt read by the projector: text tokens and images, in order


class Projector(_Owner):
    """A multimodal projector (an mmproj GGUF) for one text model: prompts with images or audio
    clips become text tokens and encoded media. Encoding takes a lock: libmtmd's context runs one
    at a time."""

    kind = "projector"

    def __init__(self, path: Path, model: Model, n_threads: int, offload: bool = True) -> None:
        check_gguf(path)
        if mtmd is None:
            raise ModelError("this llama-cpp-python was built without libmtmd (llama_cpp.mtmd_cpp): it cannot load a projector")
        backend.route_log(mtmd.mtmd_log_set)
        backend.route_log(mtmd.mtmd_helper_log_set)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings = offload, n_threads, False
        params.media_marker = MEDIA_MARKER.encode()
        with backend.log.capture() as log:
            handle = mtmd.mtmd_init_from_file(str(path).encode(), model.handle, params)
        if not handle:
            said = [line for line in log if "error" in line.lower() or "failed" in line.lower()]
            raise ModelError(f"cannot load the projector {path}: {said[-1].strip() if said else 'libmtmd refused it (--verbose shows why)'}")
        super().__init__(handle)
        self.path = path
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(handle))  # four positions a row (Qwen2-VL and its kin)
        self.vision = bool(mtmd.mtmd_support_vision(handle))
        self.audio = bool(mtmd.mtmd_support_audio(handle))
        self.marker = MEDIA_MARKER
        self.n_embd = llama_cpp.llama_model_n_embd_inp(model.handle)
        self.n_encoded = 0  # images and clips encoded (a cached one is not encoded again)
        self._lock = threading.Lock()
        self._encoded: OrderedDict[str, Encoded] = OrderedDict()

    def _free(self, handle) -> None:
        mtmd.mtmd_free(handle)

    def read(self, text: str, media: list[bytes], add_special: bool) -> list[Piece]:
        """The prompt's text tokens and its images and clips, encoded, in order: each marker in
        `text` is the next one. One libmtmd cannot decode, or this projector does not read, is
        refused (PromptError), naming which."""
        with self._chunks(text, media, add_special) as chunks:
            return [self._piece(chunk) for chunk in chunks]

    def count(self, text: str, media: list[bytes], add_special: bool) -> int:
        """The positions read() would fill, from the images' sizes and the clips' lengths, without
        encoding any (a job's estimate reads every image of it)."""
        with self._chunks(text, media, add_special) as chunks:
            return sum(mtmd.mtmd_input_chunk_get_n_tokens(chunk) for chunk in chunks)

    @contextmanager
    def _chunks(self, text: str, media: list[bytes], add_special: bool) -> Iterator[list]:
        """libmtmd's chunks of the prompt (text, and each image or clip decoded and cut to the
        projector's sizes), freed after the block; the lock held throughout."""
        if text.count(self.marker) != len(media):
            raise PromptError(f"the prompt has {text.count(self.marker)} media markers for {len(media)} images and clips (each {self.marker} is the next one)")
        kinds = [self._kind(data) for data in media]
        with self._lock:
            bitmaps = []
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                for k, (data, kind) in enumerate(zip(media, kinds)):
                    bitmaps.append(self._bitmap(data, f"{kind} {kinds[: k + 1].count(kind)}"))
                data = text.encode()
                words = mtmd.mtmd_input_text(text=data, text_len=len(data), add_special=add_special, parse_special=True)
                array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
                code = mtmd.mtmd_tokenize(self.handle, chunks, ctypes.byref(words), array, len(bitmaps))
                if code != 0:
                    raise PromptError(f"the projector could not read the prompt with its images and clips (libmtmd's mtmd_tokenize returned {code})")
                yield [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                for bitmap in bitmaps:
                    mtmd.mtmd_bitmap_free(bitmap)

    def _kind(self, data: bytes) -> str:
        """"audio clip" or "image", as libmtmd will read it; PromptError where this projector reads no such thing."""
        if is_audio(data):
            if not self.audio:
                raise PromptError(f"the projector {self.path.name} reads no audio (an audio clip needs a projector that takes audio)")
            return "audio clip"
        if not self.vision:
            raise PromptError(f"the projector {self.path.name} reads no images (it takes audio: WAV, MP3, FLAC)")
        return "image"

    def _bitmap(self, data: bytes, name: str):
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        with backend.log.capture():
            bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.handle, buffer, len(data), False)
        if not bitmap:
            what = "audio libmtmd can decode (WAV, MP3, FLAC)" if name.startswith("audio") else "an image libmtmd can decode (JPEG, PNG, BMP, GIF, ...)"
            raise PromptError(f"{name}: not {what}, {len(data)} bytes")
        return bitmap

    def _piece(self, chunk) -> Piece:
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            return tokens[: n.value]
        key = mtmd.mtmd_input_chunk_get_id(chunk).decode()
        found = self._encoded.get(key)
        if found is not None:
            self._encoded.move_to_end(key)
            return found
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        with backend.log.capture():
            code = mtmd.mtmd_encode_chunk(self.handle, chunk)
        if code != 0:
            what = "a clip" if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO else "an image"
            raise PromptError(f"the projector could not encode {what} (libmtmd's mtmd_encode_chunk returned {code})")
        rows = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(self.handle), shape=(n_tokens, self.n_embd)).copy()
        grid = self._grid(chunk, kind, n_tokens) if self.mrope else (None, None)
        encoded = Encoded(key, rows, bool(mtmd.mtmd_decode_use_non_causal(self.handle, chunk)),
                          mtmd.mtmd_input_chunk_get_n_pos(chunk), *grid)
        self.n_encoded += 1
        self._keep(encoded)
        return encoded

    @staticmethod
    def _grid(chunk, kind: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """An M-RoPE chunk's positions at first = 0 and how each moves with first (libmtmd's own
        layout: the helper's for an image, every section counting up for a clip), section-major."""
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
            counting = np.tile(np.arange(n_tokens, dtype=np.int32), (4, 1))
            return counting, np.ones_like(counting)
        image = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
        at = []
        for first in (0, 1):
            out = (mtmd.mtmd_decoder_pos * n_tokens)()
            mtmd.mtmd_helper_image_get_decoder_pos(image, first, out)
            # llama_batch's sections: time, then y (row), x (column), and the fourth (mtmd-helper's order)
            at.append(np.array([[p.t, p.y, p.x, p.z] for p in out], dtype=np.int64).T.astype(np.int32))
        return at[0], at[1] - at[0]

    def _keep(self, encoded: Encoded) -> None:
        self._encoded[encoded.key] = encoded
        while sum(e.embeddings.nbytes for e in self._encoded.values()) > ENCODED_CACHE_BYTES and len(self._encoded) > 1:
            self._encoded.popitem(last=False)


@dataclass(frozen=True)
class Placed:
    """Rows of an image's embeddings (all of them, or the next part of one attended one way),
    the sequence they go to, the first's index among its tokens, and their positions: (1, n),
    or (4, n) under M-RoPE."""

    rows: np.ndarray
    non_causal: bool
    seq_id: int
    first: int
    positions: np.ndarray


def decode_images(ctx: Context, batch: Batch, placed: list[Placed]) -> None:
    """Decode images' rows into their sequences' positions through `batch` (of embedding rows,
    no logits). Rows attended one way share decodes of up to its capacity (an image may span
    two); an image attended both ways is decoded alone and whole (Intake checks that it fits a
    micro-batch). Raises DecodeError as Context.decode does (code 1: no room in the KV cache);
    what went in before stays."""
    staged = np.zeros((batch.n_pos_per_row, batch.capacity), dtype=np.int32)  # the batch's positions, by section
    n = 0
    for piece in placed:
        if piece.non_causal:
            n = _flush(ctx, batch, staged, n)
            _put(batch, staged, 0, piece.rows, piece.seq_id, piece.positions)
            llama_cpp.llama_set_causal_attn(ctx.handle, False)
            try:
                _flush(ctx, batch, staged, len(piece.rows))
            finally:
                llama_cpp.llama_set_causal_attn(ctx.handle, True)
            continue
        start = 0
        while start < len(piece.rows):
            k = min(len(piece.rows) - start, batch.capacity - n)
            _put(batch, staged, n, piece.rows[start : start + k], piece.seq_id, piece.positions[:, start : start + k])
            n, start = n + k, start + k
            if n == batch.capacity:
                n = _flush(ctx, batch, staged, n)
    _flush(ctx, batch, staged, n)


def _put(batch: Batch, staged: np.ndarray, at: int, rows: np.ndarray, seq_id: int, positions: np.ndarray) -> None:
    n = len(rows)
    batch.embd[at : at + n] = rows
    staged[:, at : at + n] = positions
    batch.seq_id[at : at + n] = seq_id
    batch.logits[at : at + n] = 0


def _flush(ctx: Context, batch: Batch, staged: np.ndarray, n: int) -> int:
    """Decode the batch's first n rows (none: nothing); returns 0, the rows left. Positions go in
    section-major over the n rows, as llama.cpp reads an embedding batch's."""
    if n:
        batch.pos[: staged.shape[0] * n] = staged[:, :n].ravel()
        batch.n_tokens = n
        ctx.decode(batch)
    return 0
