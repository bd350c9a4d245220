"""ServerConfig: how one pdserve HTTP server listens and what it admits. Each field is declared
once, with its flag (arg_types.option): `pdserve serve`, its --ray and --disaggregate launchers
and (for the `listen` fields) `pdserve proxy` generate their flags from these fields."""
import argparse
from dataclasses import dataclass

from pdserve.arg_types import add_config_args, config_from_args, number_at_least, option, seconds
from pdserve.server.reasoning_parsers import PARSERS as REASONING_PARSERS
from pdserve.server.tool_parsers import PARSERS as TOOL_PARSERS

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Names that always reach a server bound to loopback, whatever --host says.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


@dataclass
class ServerConfig:
    served_model_name: str | None = option(
        None, "the model name clients send and /v1/models lists (default: the checkpoint directory's basename)")
    host: str = option("127.0.0.1", "address to bind (default: %(default)s, loopback only; 0.0.0.0 for every "
                       "interface)", listen=True)
    port: int = option(8000, "TCP port, bound before the model loads (default: %(default)s)", min=0, max=65535,
                       listen=True)
    # the flag's names; the config holds them resolved by allowed_hosts() (None: any Host)
    allowed_hosts: list[str] | None = option(
        None, "Host header names accepted; others get 400, so a web page that points its own DNS name at this "
        "server cannot use it ('*' = any; default: the --host address and localhost names, or any when --host "
        "is 0.0.0.0 or ::)", nargs="+", metavar="HOST", listen=True)
    allowed_origins: list[str] = option(
        [], "web origins allowed to call the API from a browser (CORS), e.g. https://app.example.com or '*' "
        "(default: none, no CORS headers)", nargs="+", metavar="ORIGIN")
    allowed_methods: list[str] = option(["GET", "POST"], "CORS: methods allowed (default: GET POST)", nargs="+",
                                        metavar="METHOD")
    allowed_headers: list[str] = option(["Authorization", "Content-Type"],
                                        "CORS: request headers allowed (default: Authorization Content-Type)",
                                        nargs="+", metavar="HEADER")
    allow_credentials: bool = option(False, "CORS: allow cookies and HTTP authentication (default: off)",
                                     action="store_true")
    api_key: str | None = option(
        None, "require `Authorization: Bearer KEY` on every endpoint except /health, /metrics, /version, the web "
        "page / and the API docs; the proxy also sends it to its workers (default: the PDSERVE_API_KEY environment "
        "variable; unset = no key, and the proxy passes the client's header on)", env="PDSERVE_API_KEY",
        repr=False, listen=True)
    max_waiting: int = option(256, "most requests admitted beyond the free seats (--max-num-seqs); beyond it "
                              "requests get 503 with Retry-After (default: %(default)s)", min=0)
    max_connections: int = option(1000, "most open connections; a new one beyond gets 503 and is closed (the "
                                  "proxy: also most connections to its workers; default: %(default)s)", min=1,
                                  listen=True)
    header_timeout: float = option(10.0, "a request's headers must arrive within this, or the connection is "
                                   "closed (slow clients; default: %(default)s)", type=seconds, metavar="SECONDS",
                                   listen=True)
    body_timeout: float = option(30.0, "a request's body must arrive within this after its headers, or the "
                                 "connection is closed (default: %(default)s)", type=seconds, metavar="SECONDS",
                                 listen=True)
    max_body_bytes: int = option(1 << 20, "largest request body; larger ones get 413 (default: %(default)s = "
                                 "1 MiB)", min=1, listen=True)
    max_stop_strings: int = option(16, "most stop strings one request may give (default: %(default)s)", min=0)
    max_stop_length: int = option(256, "longest stop string, in characters (default: %(default)s)", min=1)
    max_stop_token_ids: int = option(256, "most stop_token_ids one request may give (default: %(default)s)", min=0)
    max_prompt_tokens: int | None = option(None, "longest prompt, in tokens; longer ones get 400 (default: the "
                                           "model's context length)", min=1)
    max_tokens_cap: int | None = option(
        None, "largest max_tokens a request may ask for; larger ones get 400, and defaults (chat: the rest of the "
        "context) are lowered to it (default: no cap beyond the context)", min=1)
    max_n: int = option(64, "most choices (n) per request (default: %(default)s)", min=1)
    max_logprobs: int = option(20, "most logprobs / top_logprobs per token, at most 20 (default: %(default)s)",
                               min=0, max=20)
    max_request_cost: int = option(
        1 << 17, "most token entries one request may make the server generate and send: prompts x n x max_tokens "
        "x (1 + logprobs); over it a request gets 400, and defaults are lowered to fit (default: %(default)s)", min=1)
    tool_call_parser: str | None = option(
        None, "how answers become tool_calls with tool_choice \"auto\": hermes (= qwen2.5: <tool_call> blocks) or "
        "llama3_json (default: none; \"auto\" is then refused, \"required\" and named functions work without one)",
        choices=sorted(TOOL_PARSERS))
    reasoning_parser: str | None = option(
        None, "split a thinking model's output, as vLLM does: the thinking goes to the message's reasoning_content "
        "(and reasoning), the answer to content; tool calls and structured outputs apply to the answer. qwen3 "
        "(<think>...</think>; chat_template_kwargs {\"enable_thinking\": false} turns thinking off), deepseek_r1 "
        "(the output starts inside <think>); the tags must be tokens of the checkpoint; or gpt_oss (harmony's "
        "channels and tool calls, by openai-harmony; the vocabulary must be o200k_harmony) (default: none)",
        choices=sorted(REASONING_PARSERS))
    max_stored_responses: int = option(
        1000, "/v1/responses kept in memory for previous_response_id: the last N (older ones, and those made with "
        "store: false, are refused by name; default: %(default)s)", min=0, metavar="N")
    request_timeout: float | None = option(
        None, "abort a request still unfinished this long after it arrived and free its KV blocks; the client "
        "gets 504 request_timeout, or an error event in a stream (default: none)", type=seconds, metavar="SECONDS")
    shutdown_timeout: float = option(
        30.0, "seconds running requests get to finish after SIGTERM before they are aborted; the proxy's calls "
        "still waiting on a worker then get 503 shutdown_timeout (default: %(default)s)", type=number_at_least(0),
        listen=True)
    step_log: str | None = option(
        None, "append one JSON line per engine step (time, duration, prefill and decode tokens, sequences, "
        "preemptions, forward time) to FILE, for `pdserve report` (default: off)", metavar="FILE")
    log_level: str = option("info", "log level of the server and its access log (default: %(default)s)",
                            choices=LOG_LEVELS, listen=True)

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_name: str) -> "ServerConfig":
        """From `pdserve serve`'s parsed flags; model_name names the model when --served-model-name does not."""
        return config_from_args(cls, args, served_model_name=args.served_model_name or model_name,
                                api_key=args.api_key or None, allowed_hosts=allowed_hosts(args.host, args.allowed_hosts))


def add_server_args(parser: argparse.ArgumentParser, listen_only: bool = False) -> None:
    """The server's flags (only those every pdserve HTTP server takes, for the proxy)."""
    add_config_args(parser.add_argument_group("server"), ServerConfig, listen_only)


def allowed_hosts(host: str, given: list[str] | None) -> list[str] | None:
    """--allowed-hosts, or its default; None means any Host."""
    if given is not None:
        return None if "*" in given else given
    if host in WILDCARD_HOSTS:   # every interface: names this machine goes by are not known here
        return None
    return list(dict.fromkeys([host, *LOCAL_HOSTS]))
