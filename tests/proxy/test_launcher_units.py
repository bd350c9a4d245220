"""`pdserve serve --disaggregate`'s pieces that need no model: core lists, their split, the
workers' command lines."""
import argparse

import pytest

from pdserve import cli
from pdserve.errors import ConfigError
from pdserve.proxy.cores import format_cores, parse_cores, split_cores
from pdserve.entrypoints.disaggregate import WorkerProcess, step_log_for, worker_flags
from pdserve.entrypoints.serve_args import add_arguments, resolve_model


def test_core_lists_parse_and_print_as_taskset_writes_them():
    assert parse_cores("0") == [0] and parse_cores("3,1") == [1, 3] and parse_cores("0-2,5") == [0, 1, 2, 5]
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("", "a", "2-1", "-1", "0,,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_cores(bad)


def test_the_default_split_is_half_each_and_given_lists_are_checked():
    assert split_cores(None, None, {0, 1}) == ([0], [1])
    assert split_cores(None, None, {0, 1, 2}) == ([0, 1], [2])
    assert split_cores([1], None, {0, 1, 2, 3}) == ([1], [0, 2, 3])
    assert split_cores(None, [0], {0, 1}) == ([1], [0])
    with pytest.raises(ConfigError, match=r"--decode-cores 1-2: core\(s\) 2 are not available to this process "
                                          r"\(it may use 0-1\)"):
        split_cores([0], [1, 2], {0, 1})
    with pytest.raises(ConfigError, match=r"share core\(s\) 1"):
        split_cores([0, 1], [1], {0, 1})
    with pytest.raises(ConfigError, match="needs two cores"):
        split_cores(None, None, {3})
    with pytest.raises(ConfigError, match="no cores left for the decode worker"):
        split_cores([0, 1], None, {0, 1})


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(argv)
    resolve_model(args)
    return args


def test_workers_get_every_flag_given_except_the_launchers_own():
    args = parse("/m", "--disaggregate", "--prefill-cores", "0", "--port=9000", "--host", "0.0.0.0",
                 "--max-num-seq", "8", "--no-enable-prefix-caching", "--allowed-origins", "a", "b",
                 "--allow-credentials", "--request-timeout", "2.5", "--step-log", "s.jsonl")
    flags = worker_flags(args)
    assert flags == ["--model", "/m", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--allowed-origins", "a",
                     "b", "--allow-credentials", "--request-timeout", "2.5"]
    assert worker_flags(parse()) == []
    assert step_log_for("s.jsonl", "decode") == ["--step-log", "s.decode.jsonl"] and step_log_for(None, "x") == []
    w = WorkerProcess("prefill", [2, 3], 8100, flags)
    assert w.cmd[-8:] == ["--role", "prefill", "--host", "127.0.0.1", "--port", "8100", "--threads", "2"]


@pytest.mark.parametrize("argv,message", [
    (["--disaggregate", "--threads", "2"], "--threads cannot be combined with --disaggregate"),
    (["--disaggregate", "--backend", "hf"], "not --baseline hf"),
    (["--disaggregate", "--baseline", "static"], "not --baseline static"),
    (["--prefill-cores", "0"], "--prefill-cores and --decode-cores need --disaggregate"),
    (["--disaggregate", "--prefill-cores", "0", "--decode-cores", "4096"], "are not available to this process"),
])
def test_bad_launcher_flags_are_one_line(capsys, argv, message):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
