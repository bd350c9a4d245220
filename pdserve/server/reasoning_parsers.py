"""--reasoning-parser's registry: each name's parser class (reasoning.py's think-tag parsers,
harmony.py's gpt_oss), and `build`, which makes the one a server was started with."""
from pdserve.errors import ConfigError
from pdserve.server.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser


def _harmony(tokenizer) -> ReasoningParser:
    from pdserve.server.harmony import HarmonyParser   # imports openai-harmony, an extra
    return HarmonyParser(tokenizer)


PARSERS = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)} | {"gpt_oss": _harmony}


def build(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser --reasoning-parser names, for this tokenizer; ConfigError (one line) if it cannot work."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ConfigError(f"unknown --reasoning-parser {name!r} (choose from {', '.join(sorted(PARSERS))})")
    return PARSERS[name](tokenizer)
