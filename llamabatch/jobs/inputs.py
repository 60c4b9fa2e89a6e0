"""Job inputs, read lazily line by line: OpenAI Batch API lines, llamabatch JSON Lines, or plain
text (one prompt a line). The format is told by the first non-blank line; `-` is standard
input and a `.gz` file is read through gzip. A line that cannot run becomes a BadLine that
names the problem; the lines around it are unaffected."""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from enum import Enum
from pathlib import Path
from typing import BinaryIO

from pydantic import TypeAdapter, ValidationError

from ..engine import MediaPrompt, SamplingParams
from ..errors import LlamabatchError
from ..embeddings_format import EMBEDDINGS_URL, EmbeddingRequest
from ..openai_format import ENDPOINTS, LoraEntry, SamplingFields, validation_message

STDIN = "-"
# a line chooses adapters by model/lora; a thinking budget is a chat request's (reasoning_budget),
# and the tokens an answer shows are its chat format's
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} - {"adapters", "thinking_budget", "shown_tokens"}
_LORA = TypeAdapter(list[LoraEntry])
_OPENAI_FIELDS = {"custom_id", "method", "url", "body"}
_PARAMS = TypeAdapter(SamplingParams)  # checks each field's type, then SamplingParams its range


class Format(Enum):
    OPENAI = "openai"  # {"custom_id", "method", "url", "body"}
    JSONL = "jsonl"  # {"prompt", sampling fields..., optional "id"}
    TEXT = "text"  # one prompt a line

    @property
    def id_field(self) -> str:
        """The field of an output line that holds the request's id."""
        return "custom_id" if self is Format.OPENAI else "id"


@dataclass(frozen=True)
class JobLine:
    """One line that can run: an OpenAI body for one of ENDPOINTS, or a prompt with its params."""

    id: str
    line: int  # 1-based line number in the input
    digest: str  # what the line asks (request_digest), recorded with its answer
    url: str | None = None  # OpenAI format: the endpoint the body is for
    body: SamplingFields | None = None
    prompt: str | None = None  # llamabatch formats
    params: SamplingParams | None = None
    model: str | None = None  # JSONL: the served model or an adapter's name (vLLM's way)
    lora: tuple[tuple[int, float], ...] | None = None  # JSONL: llama-server's lora field, as pairs
    embedding: EmbeddingRequest | None = None  # texts to embed (a /v1/embeddings line, an "input" line, an embed job's text)
    # JSONL: the image and audio files its prompt shows, images first (read when it is submitted)
    media: tuple[tuple[str, Path], ...] = ()  # ("image" or "audio", the file)

    def engine_prompt(self) -> str | MediaPrompt:
        """A llamabatch-format line's prompt as the engine takes it: with images or audio, their
        files read now (LlamabatchError for one that cannot be)."""
        if not self.media:
            return self.prompt
        for kind, path in self.media:
            if not path.is_file():
                raise LlamabatchError(f"{kind} file not found: {path}")
        return MediaPrompt(self.prompt, tuple(path.read_bytes() for _, path in self.media))


@dataclass(frozen=True)
class BadLine:
    """A line that cannot run. `status` is the HTTP status the server would answer for the same
    body (400), or None for a line that is not a request at all (not JSON, no body, bad url)."""

    id: str
    line: int
    digest: str
    message: str
    status: int | None = None


def line_id(n: int) -> str:
    """The stable id of a line that does not give one."""
    return f"line-{n}"


def request_digest(text: str | None) -> str:
    """16 hex digits naming what a line asks (its text, line ending aside). Every output and error
    line records its request's, and a resumed job checks that the input still asks the same."""
    content = b"\xff" if text is None else text.rstrip("\r\n").encode()  # \xff: never a UTF-8 line
    return hashlib.blake2b(content, digest_size=8).hexdigest()


def open_binary(source: str | Path) -> BinaryIO:
    """The input's bytes: standard input for '-', gunzipped for a .gz file."""
    if str(source) == STDIN:
        return sys.stdin.buffer
    path = Path(source)
    if not path.is_file():
        raise LlamabatchError(f"input not found: {path}")
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def numbered_lines(source: str | Path) -> Iterator[tuple[int, str | None]]:
    """(line number, text) for every non-blank line, lazily; text is None for a line that is not UTF-8."""
    stream = open_binary(source)
    try:
        for n, raw in enumerate(stream, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield n, None
                continue
            if text.strip():
                yield n, text
    except (OSError, EOFError, gzip.BadGzipFile) as e:  # a truncated or corrupt .gz
        raise LlamabatchError(f"cannot read {source}: {e}") from None
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def detect_format(first: str | None) -> Format:
    """OpenAI lines carry custom_id/url/body; other JSON objects are llamabatch's; the rest is text."""
    if first is None:
        raise LlamabatchError("the input is not text: its first line is not UTF-8")
    if not first.lstrip().startswith("{"):
        return Format.TEXT
    try:
        obj = json.loads(first)
    except json.JSONDecodeError as e:
        raise LlamabatchError(f"the input's first line looks like JSON but is not ({e.msg}): cannot tell its format") from None
    if isinstance(obj, dict) and ("body" in obj or "url" in obj or "custom_id" in obj):
        return Format.OPENAI
    return Format.JSONL


class RequestReader:
    """Reads one input lazily, yielding a JobLine or BadLine per non-blank line."""

    def __init__(self, source: str | Path, base: SamplingParams | None = None, embed: bool = False) -> None:
        self.source = source
        self.base = base or SamplingParams()
        self._lines = numbered_lines(source)
        self._first = next(self._lines, None)
        try:
            if self._first is None:
                raise LlamabatchError(f"the input {source} is empty: no requests to run")
            self.format = detect_format(self._first[1])
        except LlamabatchError:
            self.close()
            raise
        folder = None if str(source) == "-" else Path(source).parent  # image paths are relative to the input's folder
        self.parse = LineParser(self.format, self.base, embed, folder).parse

    def close(self) -> None:
        """Close the input file (safe to call twice; reading stops there)."""
        self._lines.close()

    def __iter__(self) -> Iterator[JobLine | BadLine]:
        first, self._first = self._first, None
        if first is None:
            raise LlamabatchError("a RequestReader is read once")
        for n, text in _chain(first, self._lines):
            yield self.parse(n, text)


@dataclass(frozen=True)
class LineParser:
    """Turns one line of an input in `format` into the request it asks for, or a BadLine."""

    format: Format
    base: SamplingParams
    embed: bool = False  # `llamabatch embed`: a text line is a text to embed, not a prompt
    folder: Path | None = None  # where a JSONL line's relative image paths start (None: the working folder)

    def parse(self, n: int, text: str | None) -> JobLine | BadLine:
        digest = request_digest(text)
        if text is None:
            return BadLine(line_id(n), n, digest, "not UTF-8 text")
        if self.format is Format.TEXT:
            if self.embed:
                return JobLine(line_id(n), n, digest, embedding=EmbeddingRequest(input=text.rstrip("\r\n")))
            return JobLine(line_id(n), n, digest, prompt=text.rstrip("\r\n"), params=self.base)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return BadLine(line_id(n), n, digest, f"not valid JSON ({e.msg})")
        if not isinstance(obj, dict):
            return BadLine(line_id(n), n, digest, "expected a JSON object")
        id_ = obj.get(self.format.id_field, line_id(n))
        if not isinstance(id_, str) or not id_:
            return BadLine(line_id(n), n, digest, f"{self.format.id_field} must be a non-empty string")
        parse = self._openai if self.format is Format.OPENAI else self._jsonl
        return parse(id_, n, digest, obj)

    def _openai(self, id_: str, n: int, digest: str, obj: dict) -> JobLine | BadLine:
        unknown = set(obj) - _OPENAI_FIELDS
        if unknown:
            return BadLine(id_, n, digest, f"unknown fields {sorted(unknown)} (a line has custom_id, method, url, body)")
        if obj.get("method", "POST") != "POST":
            return BadLine(id_, n, digest, f"method must be POST, got {obj.get('method')!r}")
        url = obj.get("url")
        if url not in ENDPOINTS and url != EMBEDDINGS_URL:
            return BadLine(id_, n, digest, f"unsupported url {url!r}: supported are {', '.join([*ENDPOINTS, EMBEDDINGS_URL])}")
        if not isinstance(obj.get("body"), dict):
            return BadLine(id_, n, digest, "body must be a JSON object")
        if url == EMBEDDINGS_URL:
            return self._embedding(id_, n, digest, obj["body"], url)
        if self.embed:
            return BadLine(id_, n, digest, f"an embed job runs {EMBEDDINGS_URL} lines, not {url}", status=400)
        model, _ = ENDPOINTS[url]
        try:
            body = model.model_validate(obj["body"])
            if body.stream:
                raise LlamabatchError("stream: a batch job answers whole, set it to false or leave it out")
            body.params()  # sampling values out of range fail now, not after tokenizing
        except ValidationError as e:
            return BadLine(id_, n, digest, validation_message(e), status=400)
        except LlamabatchError as e:
            return BadLine(id_, n, digest, str(e), status=400)
        return JobLine(id_, n, digest, url=url, body=body)

    def _embedding(self, id_: str, n: int, digest: str, fields_: dict, url: str | None = None) -> JobLine | BadLine:
        try:
            return JobLine(id_, n, digest, url=url, embedding=EmbeddingRequest.model_validate(fields_))
        except ValidationError as e:
            return BadLine(id_, n, digest, validation_message(e), status=400)

    def _jsonl(self, id_: str, n: int, digest: str, obj: dict) -> JobLine | BadLine:
        if "input" in obj or self.embed:  # {"input": ..., "dimensions", "truncate"}: texts to embed
            return self._embedding(id_, n, digest, {k: v for k, v in obj.items() if k != "id"})
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            return BadLine(id_, n, digest, "expected an object with a string 'prompt'")
        unknown = set(obj) - _SAMPLING_FIELDS - {"prompt", "id", "model", "lora", *_MEDIA_FIELDS}
        if unknown:
            return BadLine(id_, n, digest, f"unknown field {sorted(unknown)[0]!r}: llamabatch does not support it", status=400)
        model = obj.get("model")
        if model is not None and not isinstance(model, str):
            return BadLine(id_, n, digest, "model must be a string: the served model or an adapter's name", status=400)
        try:
            params = jsonl_params(self.base, {k: v for k, v in obj.items() if k in _SAMPLING_FIELDS})
            lora = None if obj.get("lora") is None else tuple((e.id, e.scale) for e in _LORA.validate_python(obj["lora"]))
        except ValidationError as e:
            return BadLine(id_, n, digest, f"lora: {validation_message(e)}", status=400)
        except LlamabatchError as e:
            return BadLine(id_, n, digest, str(e), status=400)
        media = []
        for field in _MEDIA_FIELDS:
            files = obj.get(field, [])
            files = [files] if isinstance(files, str) else files
            if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
                return BadLine(id_, n, digest, f"{field} must be a file's path (or file:// URL), or a list of them", status=400)
            media += [(field, self._path(f)) for f in files]
        return JobLine(id_, n, digest, prompt=prompt, params=params, model=model, lora=lora, media=tuple(media))

    def _path(self, text: str) -> Path:
        path = Path(text.removeprefix("file://")).expanduser()
        return path if path.is_absolute() or self.folder is None else self.folder / path


_MEDIA_FIELDS = ("image", "audio")  # a JSON line's files for its prompt, in this order


def jsonl_params(base: SamplingParams, fields_: dict) -> SamplingParams:
    """`base` with a JSON line's sampling fields, each type-checked ('stop' may be one string)."""
    if isinstance(fields_.get("stop"), str):
        fields_ = {**fields_, "stop": [fields_["stop"]]}
    try:
        return _PARAMS.validate_python({**asdict(base), **fields_})
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "value_error":  # the types were right; SamplingParams refused a value
            raise first["ctx"]["error"] from None
        raise LlamabatchError(f"invalid sampling parameter: {validation_message(e)}") from None


def _chain(first: tuple[int, str | None], rest: Iterator[tuple[int, str | None]]) -> Iterator[tuple[int, str | None]]:
    yield first
    yield from rest


def peek_ids(source: str | Path, fmt: Format) -> Iterator[tuple[str, int, str]]:
    """(id, line number, request digest) of every non-blank line, parsing no more than the id:
    the quick pass before a job that counts its requests, finds duplicate ids and checks that
    what an earlier run answered is still what the input asks."""
    for n, text in numbered_lines(source):
        yield peek_id(fmt, n, text), n, request_digest(text)


def peek_id(fmt: Format, n: int, text: str | None) -> str:
    """The id the request on line `n` will have (its line's id when it gives none or cannot run)."""
    if fmt is Format.TEXT or text is None:
        return line_id(n)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return line_id(n)
    id_ = obj.get(fmt.id_field, line_id(n)) if isinstance(obj, dict) else line_id(n)
    return id_ if isinstance(id_, str) and id_ else line_id(n)
