"""The engine's flags are generated from EngineConfig: every field is a flag, the defaults agree,
and a value given on the command line reaches the config."""
import argparse
import dataclasses

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.args import add_engine_args, engine_kwargs


def parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_kwargs(parser.parse_args(list(argv)))


def test_every_config_field_is_a_flag_with_the_same_default():
    kwargs = parse()
    assert set(kwargs) == {f.name for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":
            assert kwargs[f.name] == f.default, f.name


def test_values_reach_the_config(capsys):
    kwargs = parse("--block-size", "32", "--no-cpu-kernels", "--dtype", "bfloat16", "--profile-steps", "0")
    cfg = EngineConfig(**kwargs)
    assert (cfg.block_size, cfg.cpu_kernels, cfg.dtype, cfg.profile_steps) == (32, False, "bfloat16", 0)
    with pytest.raises(SystemExit):
        parse("--block-size", "0")
    assert "must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--dtype", "int4")
