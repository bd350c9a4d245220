"""The proxy refuses to start, in one line, over workers that cannot work together."""
import pytest

from pdserve import cli
from pdserve.errors import ConfigError
from pdserve.entrypoints import proxy as launch
from tests.proxy.conftest import Served, proxy_args
from tests.proxy.fake_worker import FakeWorker


@pytest.fixture
def workers():
    """workers(FakeWorker, ...) -> their URLs, served until the end of the test."""
    served = []

    def start(*fakes):
        served.extend(Served(f.app) for f in fakes)
        return [s.url for s in served[-len(fakes):]]
    yield start
    for s in served:
        s.stop()


@pytest.mark.parametrize("decode,message", [
    (FakeWorker("decode", block_size=32), "disagree on block_size: prefill worker http://127.0.0.1:P has 16, "
                                          "decode worker http://127.0.0.1:P has 32"),
    (FakeWorker("decode", dtype="bfloat16"), "disagree on dtype"),
    (FakeWorker("decode", model="other"), "disagree on model"),
    (FakeWorker("prefill"), "--decode http://127.0.0.1:P is a worker with role 'prefill', not 'decode'"),
    (FakeWorker("both"), "role 'both'"),
])
def test_workers_that_do_not_fit_are_refused(workers, decode, message):
    p, d = workers(FakeWorker("prefill"), decode)
    with pytest.raises(ConfigError) as e:
        launch.build(proxy_args([p], [d]))
    shown = str(e.value).replace(p.rsplit(":", 1)[1], "P").replace(d.rsplit(":", 1)[1], "P")
    assert message in shown and "\n" not in shown


def test_a_worker_without_the_endpoint_or_unreachable_is_refused(workers):
    from fastapi import FastAPI
    from pdserve.bench.servers import free_port
    (p,) = workers(FakeWorker("prefill"))
    (plain,) = workers(type("Plain", (), {"app": FastAPI()})())   # a server without /v1/kv_transfer
    with pytest.raises(ConfigError, match="answered HTTP 404 .is it a `pdserve serve --role decode` worker"):
        launch.build(proxy_args([p], [plain]))
    with pytest.raises(ConfigError, match="cannot reach GET /v1/kv_transfer"):
        launch.build(proxy_args([p], [f"127.0.0.1:{free_port()}"]))
    with pytest.raises(ConfigError, match="given more than once"):
        launch.build(proxy_args([p], [p]))


def test_the_command_says_it_in_one_line(workers, capsys):
    p, d = workers(FakeWorker("prefill"), FakeWorker("decode", block_size=8))
    assert cli.main(["proxy", "--prefill", p, "--decode", d, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve proxy: error: the workers disagree on block_size") and err.count("\n") == 1
    assert cli.main(["proxy", "--prefill", "ftp://x", "--decode", d]) == 2
    assert "--prefill/--decode: not an http(s) URL" in capsys.readouterr().err
