"""Error types. Each carries a message meant for the user, printed as one line by the CLI."""


class LlamabatchError(Exception):
    """A problem the user can fix: bad model, bad prompt, bad settings."""


class ModelError(LlamabatchError):
    """Unknown model name, or a GGUF file that is missing or cannot be loaded."""


class ConfigError(LlamabatchError, ValueError):
    """Engine settings that cannot work together (for example --parallel vs --ctx)."""


class PromptError(LlamabatchError, ValueError):
    """A prompt that cannot be run: empty, or longer than a sequence's context."""


class SamplingError(LlamabatchError, ValueError):
    """A sampling parameter out of range."""


class DecodeError(LlamabatchError):
    """llama_decode returned non-zero. Code 1 means no KV slot was free (recoverable)."""

    def __init__(self, code: int, meaning: str | None = None) -> None:
        self.code = code
        meaning = meaning or {1: "no free KV cache slot for the batch", 2: "aborted"}.get(code, "error")
        super().__init__(f"llama_decode failed with code {code} ({meaning})")


class EngineBroken(LlamabatchError):
    """Steps kept failing: the engine (its llama.cpp context) cannot go on and must be rebuilt."""


class ConstraintError(LlamabatchError, ValueError):
    """A JSON schema, grammar, regular expression or choice list that cannot be compiled."""


class UnknownModel(LlamabatchError, ValueError):
    """A request names a model (or LoRA adapter) this engine does not serve: OpenAI's 404."""


class ChatTemplateError(PromptError):
    """A chat template that cannot render the messages (its own raise_exception, or a Jinja error)."""
