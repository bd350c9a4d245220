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
