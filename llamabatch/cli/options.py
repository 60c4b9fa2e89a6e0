"""What the commands share: option types (each defined once), the error reporting every command
gets, and parsers of option values."""

from __future__ import annotations

import functools
import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import display
from ..engine import SamplingParams
from ..engine.sizing.options import AUTO
from ..errors import LlamabatchError

DEFAULT = SamplingParams()

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Catalog name or path to a .gguf file.")]
CatalogOpt = Annotated[Optional[Path], typer.Option("--config", help="models.toml to use instead of the packaged one (or $LLAMABATCH_CATALOG).")]
ParallelOpt = Annotated[
    Optional[str],
    typer.Option("--parallel", "-np", metavar="N|auto", help="Sequences decoded together (slots), or 'auto': the batch size measured fastest here (llamabatch tune), within what fits --memory with --ctx-per-seq cells each."),
]
MaxItlOpt = Annotated[Optional[str], typer.Option("--max-itl", help="With --parallel auto: the p95 time between a sequence's tokens to stay within, e.g. 150ms (default: the fastest batch size).")]
MemoryOpt = Annotated[Optional[str], typer.Option("--memory", help="With --parallel auto: the memory to plan for, e.g. 4GiB (default: what is free now).")]
CtxOpt = Annotated[Optional[int], typer.Option("--ctx", "-c", help="KV cache cells in all, shared by the slots.")]
CtxPerSeqOpt = Annotated[Optional[int], typer.Option("--ctx-per-seq", help="KV cells per sequence: the cache is this times --parallel.")]
BatchOpt = Annotated[Optional[int], typer.Option("--batch-size", "-b", help="Most tokens per llama_decode (n_batch).")]
UbatchOpt = Annotated[Optional[int], typer.Option("--ubatch-size", "-ub", help="Physical micro-batch (n_ubatch).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (0 = all cores).")]
GpuLayersOpt = Annotated[Optional[int], typer.Option("--gpu-layers", "-ngl", help="Layers on the GPU, or with --rpc on the remotes (-1 = all).")]
RpcOpt = Annotated[Optional[str], typer.Option(
    "--rpc", metavar="HOST:PORT,...", help="rpc-servers whose devices hold the offloaded layers (llama.cpp's RPC backend).",
)]
RpcTimeoutOpt = Annotated[Optional[float], typer.Option(
    "--rpc-timeout", metavar="SECONDS", help="With --rpc: a decode unanswered this long means a remote is gone; the process exits (600).",
)]
TensorSplitOpt = Annotated[Optional[str], typer.Option(
    "--tensor-split", "-ts", metavar="N0,N1,...", help="Each device's share of the offloaded layers: the --rpc remotes in order, then local GPUs.",
)]
KvUnifiedOpt = Annotated[Optional[bool], typer.Option("--kv-unified/--no-kv-unified", help="One KV buffer shared by all sequences (default), or one each.")]
DeterministicOpt = Annotated[
    Optional[bool], typer.Option("--deterministic", help="Same output alone or in any batch (CPU; slower prefill; see the docs' Deterministic mode).")
]
SpeculativeOpt = Annotated[
    Optional[str], typer.Option("--speculative", help="'ngram': sequences draft tokens by prompt lookup, verified in the same decode; 'draft': a draft model drafts them; 'off'.")
]
DraftModelOpt = Annotated[
    Optional[str], typer.Option("--draft-model", metavar="NAME|PATH", help="A smaller model with the same vocabulary that drafts tokens (turns on --speculative draft).")
]
DraftMaxOpt = Annotated[Optional[int], typer.Option("--draft-max", help="Most draft tokens per sequence and step (15).")]
StepTargetOpt = Annotated[Optional[str], typer.Option(
    "--step-target", metavar="DURATION|auto|off", help="Keep a step that reads prompt tokens beside streamed decoding sequences near this (e.g. 200ms), the prompts sharing it, so streams do not stall while a long prompt is read; auto: six decode steps' time (serve's default; --max-itl when given); off: whole --batch-size chunks, oldest prompt first (run's and batch's default).",
)]
OverlapOpt = Annotated[Optional[str], typer.Option(
    "--overlap", metavar="auto|on|off", help="Decode the next step while this one's tokens are read (text, stop strings): auto: where layers are on a GPU.",
)]
CheckpointEveryOpt = Annotated[Optional[int], typer.Option(
    "--checkpoint-every", metavar="TOKENS", help="Recurrent, hybrid and sliding-window models: checkpoint a prompt's state every TOKENS (64; a sliding window: half the window, at least 256; 0: at its end only), so later prompts reuse its prefix.",
)]
CheckpointMemoryOpt = Annotated[Optional[str], typer.Option(
    "--checkpoint-memory", metavar="SIZE", help="Recurrent, hybrid and sliding-window models: host memory for state checkpoints, e.g. 512MiB (1GiB; 0: none).",
)]
CacheRamOpt = Annotated[Optional[str], typer.Option(
    "--cache-ram", metavar="SIZE", help="Keep the memory of prompts whose slot is taken in host RAM, up to SIZE (e.g. 4GiB; 0, the default: off); a later prompt sharing a prefix gets it back instead of prefilling it.",
)]
CacheDirOpt = Annotated[Optional[Path], typer.Option(
    "--cache-dir", metavar="DIR", help="Also keep those prompts' memory in DIR, which outlives the process (a restart finds them).",
)]
CacheDiskOpt = Annotated[Optional[str], typer.Option("--cache-disk", metavar="SIZE", help="Most bytes --cache-dir holds (8GiB).")]
EmbedPackOpt = Annotated[Optional[int], typer.Option("--embed-pack", help="Tokens packed into one embedding decode (256; 2048 gives llama-embedding's own vectors).")]
ReplicasOpt = Annotated[Optional[str], typer.Option("--replicas", metavar="N|auto", help="Engines, on Ray: a number, or 'auto' (one per GPU, else one per node).")]
SharePrefixesOpt = Annotated[
    Optional[bool], typer.Option("--share-prefixes/--no-share-prefixes", help="Copy common prompt prefixes' KV instead of decoding them again.")
]
LoraOpt = Annotated[Optional[list[str]], typer.Option(
    "--lora", metavar="PATH[:SCALE]", help="A LoRA adapter applied to every sequence that asks for none (repeatable; a catalog adapter's NAME works too).",
)]
CacheTypeKOpt = Annotated[Optional[str], typer.Option("--cache-type-k", "-ctk", help="KV cache type of K: f16 (default), q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, bf16, f32.")]
CacheTypeVOpt = Annotated[Optional[str], typer.Option("--cache-type-v", "-ctv", help="KV cache type of V (as --cache-type-k; a quantized V needs flash attention).")]
FlashAttnOpt = Annotated[Optional[str], typer.Option("--flash-attn", "-fa", metavar="auto|on|off", help="Flash attention (auto: where the backend has it).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Write JSON Lines to stdout.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log.")]

# Sampling: `run` gives them SamplingParams' defaults, `batch` None (= not given: defaults apply).
MaxTokensOpt = Annotated[Optional[int], typer.Option("--max-tokens", help="Tokens to generate per prompt.")]
TemperatureOpt = Annotated[Optional[float], typer.Option("--temperature", "--temp", help="0 = greedy.")]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="0 = off.")]
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", help="1 = off.")]
MinPOpt = Annotated[Optional[float], typer.Option("--min-p", help="0 = off.")]
RepeatPenaltyOpt = Annotated[Optional[float], typer.Option("--repeat-penalty", help="1 = off.")]
PresencePenaltyOpt = Annotated[Optional[float], typer.Option("--presence-penalty")]
FrequencyPenaltyOpt = Annotated[Optional[float], typer.Option("--frequency-penalty")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Same seed + same batch = same output.")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable); not included in the text.")]
IgnoreEosOpt = Annotated[Optional[bool], typer.Option("--ignore-eos", help="Generate past end-of-generation tokens.")]
SamplesOpt = Annotated[Optional[int], typer.Option("-n", "--n", help="Samples per prompt; they share its KV (sample k: seed + k).")]
ChatOpt = Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the model's chat template.")]
ChatTemplateOpt = Annotated[Optional[str], typer.Option(
    "--chat-template", help="Chat template: a Jinja file, or a llama.cpp built-in's name (chatml, gemma, llama3...). Default: the GGUF's.")]
MmprojOpt = Annotated[Optional[str], typer.Option(
    "--mmproj", help="The model's multimodal projector (an mmproj GGUF): prompts may show images or play audio, as it reads them.")]
MmprojOffloadOpt = Annotated[Optional[bool], typer.Option(
    "--mmproj-offload/--no-mmproj-offload", help="Run the projector on the GPU (default) or on the CPU.")]
# llama.cpp's further samplers, named as llama-server's request fields (min_tokens and bad words: vLLM's)
SAMPLERS = "llama.cpp's further samplers"
DryMultiplierOpt = Annotated[Optional[float], typer.Option("--dry-multiplier", help="DRY: penalise repeating a sequence the text holds (0 = off).", rich_help_panel=SAMPLERS)]
DryBaseOpt = Annotated[Optional[float], typer.Option("--dry-base", help="DRY's base (1.75).", rich_help_panel=SAMPLERS)]
DryAllowedLengthOpt = Annotated[Optional[int], typer.Option("--dry-allowed-length", help="DRY: repeats this long go free (2).", rich_help_panel=SAMPLERS)]
DryPenaltyLastNOpt = Annotated[Optional[int], typer.Option("--dry-penalty-last-n", help="DRY looks back this far (-1: the whole context).", rich_help_panel=SAMPLERS)]
DrySequenceBreakersOpt = Annotated[Optional[list[str]], typer.Option("--dry-sequence-breaker", help="DRY: a sequence breaker (repeatable; default \\n : \" *).", rich_help_panel=SAMPLERS)]
XtcProbabilityOpt = Annotated[Optional[float], typer.Option("--xtc-probability", help="XTC: how often the top choices are cut (0 = off).", rich_help_panel=SAMPLERS)]
XtcThresholdOpt = Annotated[Optional[float], typer.Option("--xtc-threshold", help="XTC: the probability above which a choice is cut (0.1).", rich_help_panel=SAMPLERS)]
MirostatOpt = Annotated[Optional[int], typer.Option("--mirostat", help="Mirostat 1 or 2 in place of the truncations (0 = off).", rich_help_panel=SAMPLERS)]
MirostatTauOpt = Annotated[Optional[float], typer.Option("--mirostat-tau", help="Mirostat's target surprise (5).", rich_help_panel=SAMPLERS)]
MirostatEtaOpt = Annotated[Optional[float], typer.Option("--mirostat-eta", help="Mirostat's learning rate (0.1).", rich_help_panel=SAMPLERS)]
TypicalPOpt = Annotated[Optional[float], typer.Option("--typical-p", help="Locally typical sampling (1 = off).", rich_help_panel=SAMPLERS)]
TopNSigmaOpt = Annotated[Optional[float], typer.Option("--top-n-sigma", help="Keep logits within n standard deviations of the top (-1 = off).", rich_help_panel=SAMPLERS)]
DynatempRangeOpt = Annotated[Optional[float], typer.Option("--dynatemp-range", help="Dynamic temperature: ± this, by entropy (0 = off).", rich_help_panel=SAMPLERS)]
DynatempExponentOpt = Annotated[Optional[float], typer.Option("--dynatemp-exponent", help="Dynamic temperature's exponent (1).", rich_help_panel=SAMPLERS)]
MinTokensOpt = Annotated[Optional[int], typer.Option("--min-tokens", help="No end of generation before this many tokens.", rich_help_panel=SAMPLERS)]
BadWordsOpt = Annotated[Optional[list[str]], typer.Option("--bad-word", help="Never write this word (repeatable).", rich_help_panel=SAMPLERS)]
# the options above, by SamplingParams field (repeatable ones give tuples)
FURTHER_SAMPLERS = {
    "dry_multiplier": "dry_multiplier", "dry_base": "dry_base", "dry_allowed_length": "dry_allowed_length",
    "dry_penalty_last_n": "dry_penalty_last_n", "dry_sequence_breaker": "dry_sequence_breakers",
    "xtc_probability": "xtc_probability", "xtc_threshold": "xtc_threshold", "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta", "typical_p": "typical_p", "top_n_sigma": "top_n_sigma",
    "dynatemp_range": "dynatemp_range", "dynatemp_exponent": "dynatemp_exponent", "min_tokens": "min_tokens", "bad_word": "bad_words",
}


def further_samplers(params: Mapping[str, object]) -> dict:
    """The further samplers a command was given (Typer's context.params), as SamplingParams fields."""
    return {field: tuple(value) if isinstance(value, list) else value
            for option, field in FURTHER_SAMPLERS.items() if (value := params.get(option)) not in (None, [], ())}


# Constrained output (at most one): every completion matches it.
JsonSchemaOpt = Annotated[Optional[Path], typer.Option("--json-schema", help="Constrain outputs to this JSON schema (a file).")]
GrammarOpt = Annotated[Optional[Path], typer.Option("--grammar", help="Constrain outputs to this GBNF grammar (a file).")]
RegexOpt = Annotated[Optional[str], typer.Option("--regex", help="Constrain outputs to this regular expression.")]
ChoiceOpt = Annotated[Optional[list[str]], typer.Option("--choice", help="Outputs are one of these strings (repeatable).")]


def reports_errors(fn):
    """A command whose LlamabatchErrors become one red line and exit code 1."""

    @functools.wraps(fn)
    def run_reporting_errors(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LlamabatchError as e:
            display.error_line(str(e))
            raise typer.Exit(1) from None

    return run_reporting_errors


def constraint(json_schema: Path | None, grammar: Path | None, regex: str | None, choice: list[str] | None) -> dict:
    """The SamplingParams fields for the constraint flags; files are read here."""
    fields: dict = {}
    if json_schema is not None:
        try:
            fields["json_schema"] = json.loads(read_file(json_schema, "--json-schema"))
        except json.JSONDecodeError as e:
            raise LlamabatchError(f"--json-schema {json_schema}: not valid JSON ({e.msg})") from None
    if grammar is not None:
        fields["grammar"] = read_file(grammar, "--grammar")
    if regex is not None:
        fields["regex"] = regex
    if choice:
        fields["choice"] = tuple(choice)
    return fields


def read_file(path: Path, option: str) -> str:
    if not path.is_file():
        raise LlamabatchError(f"{option}: file not found: {path}")
    return path.read_text()


def int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise LlamabatchError(f"{option} must be comma-separated integers, got {text!r}") from None


def parse_pooling(text: str | None, per_token: bool = False):
    """--pooling: mean, cls or last, and where a line may hold a vector per token (`embed`) none;
    None leaves the GGUF's choice (a reranker's rank is only its GGUF's)."""
    from ..engine.embedding import Pooling

    allowed = ("mean", "cls", "last", "none") if per_token else ("mean", "cls", "last")
    if text is not None and text not in allowed:
        hint = "" if per_token or text != "none" else "; per-token vectors: llamabatch embed --pooling none"
        raise LlamabatchError(f"--pooling must be {', '.join(allowed)}, got {text!r} (rerankers score pairs: serve /v1/rerank){hint}")
    return Pooling(text) if text else None


def parse_replicas(text: str | None) -> int | str:
    """--replicas N (at least 1) or 'auto' (decided once Ray shows the cluster)."""
    if text is None:
        return 1
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise LlamabatchError(f"--replicas must be a number >= 1 or 'auto', got {text!r}")
    return value


def command_line(context: typer.Context, drop: set[str]) -> str:
    """The command being run, as typed (the options given on the command line), without `drop`."""
    words = ["llamabatch", context.info_name]
    for param in context.command.params:
        if param.name in drop or context.get_parameter_source(param.name).name != "COMMANDLINE":
            continue
        value = context.params[param.name]
        if param.param_type_name == "argument":
            words.append(str(value))
        elif param.is_flag:
            words.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            for v in value if param.multiple else [value]:
                words += [param.opts[0], str(v)]
    return shlex.join(words)
