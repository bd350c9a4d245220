"""The server's settings are declared once (ServerConfig's option() fields) and every launcher
takes them from there: `pdserve serve` (one engine, --ray, --disaggregate's workers and proxy) and
`pdserve proxy` (the `listen` fields). Each test walks every field, so a field added once is
checked against every launcher without touching this file."""
import argparse
import dataclasses

import pytest

from pdserve.arg_types import default_of, option_fields
from pdserve.entrypoints import proxy, serve_args
from pdserve.entrypoints.disaggregate import OWN, WorkerProcess, proxy_args, worker_flags
from pdserve.kv_transfer import auth
from pdserve.server.config import ServerConfig

FIELDS = option_fields(ServerConfig)
LISTEN = {f.name for f in option_fields(ServerConfig, listen_only=True)}


def parser_of(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add(p)
    return p


SERVE = parser_of(serve_args.add_arguments)
ACTIONS = {a.dest: a for a in SERVE._actions}


def other_value(f) -> tuple[list[str], object]:
    """(argv words after the flag, the value they parse to): valid, and not the field's default."""
    action, default = ACTIONS[f.name], default_of(f)
    if action.nargs == 0:
        return [], True
    if action.choices:
        choice = next(c for c in action.choices if c != default)
        return [choice], choice
    if action.nargs == "+":
        return ["a.example"], ["a.example"]
    for text in ("7", "2.5", "x.example"):
        try:
            value = action.type(text) if action.type else text
        except argparse.ArgumentTypeError:
            continue
        if value != default:
            return [text], value
    raise AssertionError(f"no value for {f.name}")


def flag(f) -> str:
    return ACTIONS[f.name].option_strings[0]


VALUES = {f.name: other_value(f) for f in FIELDS}
ARGV = [w for f in FIELDS for w in [flag(f), *VALUES[f.name][0]]]


def test_the_declaration_is_complete():
    assert len(FIELDS) == len(dataclasses.fields(ServerConfig)), "a ServerConfig field without a flag"
    assert {"host", "port", "api_key", "max_body_bytes", "max_connections", "header_timeout", "body_timeout",
            "shutdown_timeout", "allowed_hosts", "log_level"} == LISTEN


def test_serve_passes_every_field_to_the_server_config():
    config = ServerConfig.from_args(SERVE.parse_args(ARGV), "m")
    for f in FIELDS:
        assert getattr(config, f.name) == VALUES[f.name][1], f.name
    assert ServerConfig.from_args(SERVE.parse_args([]), "m") == \
        ServerConfig("m", allowed_hosts=["127.0.0.1", "localhost", "::1"])   # the flags' defaults are the fields'


# serve's fields the proxy has a flag of its own for: how its workers render prompts (prefix-aware routing)
PROXY_ROUTING = {"reasoning_parser"}


def test_the_proxy_takes_the_listen_fields_and_no_other():
    p = parser_of(proxy.add_arguments)
    workers = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    args = p.parse_args(workers + [w for f in FIELDS if f.name in LISTEN for w in [flag(f), *VALUES[f.name][0]]])
    for name in LISTEN:
        assert getattr(args, name) == VALUES[name][1], name
    defaults = p.parse_args(workers)
    for f in FIELDS:
        if f.name in LISTEN:
            assert getattr(defaults, f.name) == default_of(f) or f.name == "api_key", f.name
        elif f.name in PROXY_ROUTING:
            assert getattr(p.parse_args(workers + [flag(f), *VALUES[f.name][0]]), f.name) == VALUES[f.name][1]
            assert getattr(defaults, f.name) == default_of(f), f.name
        else:
            given = [flag(f), *VALUES[f.name][0]]
            assert p.parse_known_args(workers + given)[1] == given, f.name   # not a flag of the proxy


def test_disaggregate_gives_the_workers_and_its_proxy_every_field():
    args = SERVE.parse_args(["--disaggregate", *ARGV])
    flags = worker_flags(args)
    for f in FIELDS:
        if f.name not in OWN:
            assert flag(f) in flags, f.name
    secret = {auth.ENV: "s"}
    to_proxy = proxy_args(args, WorkerProcess("prefill", [0], 1, [], secret), WorkerProcess("decode", [1], 2, []))
    for name in LISTEN | PROXY_ROUTING:
        assert getattr(to_proxy, name) == VALUES[name][1], name
    # the proxy's own settings at its own defaults, its workers the two started
    own = parser_of(proxy.add_arguments).parse_args(["--prefill", "u", "--decode", "u"])
    assert (to_proxy.routing, to_proxy.connect_timeout, to_proxy.read_timeout, to_proxy.prefill, to_proxy.decode,
            to_proxy.kv_transfer_secret) == (own.routing, own.connect_timeout, own.read_timeout,
                                             ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], "s")


def test_ray_replicas_get_every_field():
    pytest.importorskip("ray")
    from pdserve.entrypoints.ray_serve import build_application
    args = SERVE.parse_args(["--ray", *ARGV])
    serve_args.check_ray_flags(args)
    engines = build_application(args)._bound_deployment.init_args[0]   # Ingress(engines, ...)
    config = engines._bound_deployment.init_args[1]                    # EngineReplica(engine_kwargs, config)
    assert config == ServerConfig.from_args(args, "default-model")
    for f in FIELDS:
        assert getattr(config, f.name) == VALUES[f.name][1], f.name
