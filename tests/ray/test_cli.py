"""`pdserve serve --ray` from the command line, without starting Ray."""
import sys

import pytest


def test_without_ray_the_flag_says_which_extra_to_install(monkeypatch, capsys, tiny_llama):
    from pdserve.cli import main as cli_main
    for name in [m for m in sys.modules if m == "ray" or m.startswith(("ray.", "pdserve.ray"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)   # importing it now raises ModuleNotFoundError
    assert cli_main(["serve", tiny_llama, "--ray", "--num-replicas", "2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pdserve[ray]" in err


def test_a_bad_ray_flag_is_one_line(capsys, tiny_llama):
    from pdserve.cli import main as cli_main
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", tiny_llama, "--ray", "--num-replicas", "0"])
    assert e.value.code == 2 and "--num-replicas" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "--prefill-replicas"),
    (["--prefill-replicas", "1", "--decode-replicas", "0"], "--decode-replicas"),
])
def test_pools_of_no_replica_are_refused_by_argparse(capsys, tiny_llama, flags, says):
    from pdserve.cli import main as cli_main
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", tiny_llama, "--ray", *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--ray", "--prefill-replicas", "1"], "go together"),
    (["--ray", "--decode-replicas", "2"], "go together"),
    (["--ray", "--num-replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"], "one or the other"),
    (["--ray", "--disaggregate"], "--prefill-replicas X --decode-replicas Y"),
    (["--ray", "--disaggregate", "--prefill-replicas", "1", "--decode-replicas", "1"], "--disaggregate"),
    (["--prefill-replicas", "1", "--decode-replicas", "1"], "need --ray"),
    (["--ray", "--prefill-replicas", "1", "--decode-replicas", "1", "--role", "decode"], "--role decode"),
    (["--ray", "--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transport", "shm"], "use tcp"),
    (["--ray", "--prefill-replicas", "1", "--decode-replicas", "1", "--ray-scale", "3"], "--ray-scale"),
])
def test_a_bad_combination_of_pool_flags_is_one_line_before_ray_starts(monkeypatch, capsys, tiny_llama, flags,
                                                                        says):
    from pdserve.cli import main as cli_main
    monkeypatch.setitem(sys.modules, "ray", None)   # the check comes first: Ray is never imported
    assert cli_main(["serve", tiny_llama, "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("flags, env, expected", [
    ([], None, "local"),                                  # serving: a Ray instance of its own
    (["--ray-address", "10.0.0.1:6379"], None, "10.0.0.1:6379"),
    ([], "10.0.0.2:6379", "10.0.0.2:6379"),
    (["--ray-scale", "3"], None, None),                   # scaling: the running app's cluster
])
def test_serve_starts_its_own_ray_instance_unless_given_a_cluster(monkeypatch, tiny_llama, flags, env, expected):
    pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
    from pdserve.cli import Parser
    from pdserve.entrypoints import ray_serve as app
    from pdserve.entrypoints import serve_args
    seen = {}

    class Stop(Exception):
        pass

    def init(address=None, **kwargs):
        seen["address"] = address
        raise Stop

    monkeypatch.setattr(app.ray, "init", init)
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    p = Parser(prog="pdserve serve")
    serve_args.add_arguments(p)
    with pytest.raises(Stop):
        app.run(p.parse_args(["--model", tiny_llama, "--ray", *flags]))
    assert seen["address"] == expected
