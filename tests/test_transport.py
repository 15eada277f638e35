"""The transport choice without a run: which endpoint each link gets (ipc:// on one host, tcp://
across hosts or when forced), the port layout, CURVE key files, the config checks (plain tcp://
beyond loopback is refused, at load and by `python supervisor.py`), and the client's refusal
to send to a remote endpoint without keys."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from client import AuthenticationFailed, Client
from ipc.config import ConfigError, NetworkConfig, load_config
from ipc.endpoints import Endpoints, NetworkPlan, choose_link, free_port_base, make_run_dir
from ipc.keys import KEY_NAMES, BadKeyFile, create_key_files, load_public_key, load_run_keys, load_secret_file
from ipc.ports import PORT_SPAN, PORTS_PER_KIND, link_port
from tests.conftest import REPO_ROOT
from tests.harness import node_address

pytestmark = pytest.mark.timeout(120)

TCP = NetworkConfig(transport="tcp")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory):
    return create_key_files(tmp_path_factory.mktemp("keys") / "curve")


# -- endpoint choice ------------------------------------------------------------------------------


def test_one_host_and_ipc_is_a_socket_file(keys) -> None:
    link = choose_link(
        "scheduler-0-in",
        same_host=True,
        host="10.0.0.5",
        port=7000,
        run_dir="/run/b",
        network=NetworkConfig(),
        keys=keys,
    )
    assert (link.bind, link.connect) == ("ipc:///run/b/scheduler-0-in.sock",) * 2
    assert link.server_curve is None and link.client_curve is None


def test_forced_tcp_on_one_host_uses_curve(keys) -> None:
    link = choose_link("x", same_host=True, host="127.0.0.1", port=7000, run_dir="/r", network=TCP, keys=keys)
    assert (link.bind, link.connect) == ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7000")
    assert link.server_curve is not None and link.client_curve is not None
    assert link.server_curve.client_public_keys == (keys.stage_public.encode(),)  # internal: stages only
    assert link.client_curve.server_public_key == keys.server_public.encode()
    assert link.client_curve.keys.public == keys.stage_public.encode()


def test_across_hosts_is_tcp_even_when_ipc_is_configured(keys) -> None:
    network = NetworkConfig(bind_host="0.0.0.0")
    link = choose_link(
        "x", same_host=False, host="10.0.0.5", port=7001, run_dir="/r", network=network, keys=keys
    )
    assert (link.bind, link.connect) == ("tcp://0.0.0.0:7001", "tcp://10.0.0.5:7001")
    assert link.server_curve is not None


def test_a_public_link_accepts_the_client_key_too(keys) -> None:
    link = choose_link(
        "f", same_host=True, host="127.0.0.1", port=1, run_dir="/r", network=TCP, keys=keys, is_public=True
    )
    assert link.server_curve is not None
    assert set(link.server_curve.client_public_keys) == {
        keys.stage_public.encode(),
        keys.client_public.encode(),
    }


def test_ipv6_hosts_are_bracketed(keys) -> None:
    link = choose_link(
        "x", same_host=False, host="fd00::5", port=7002, run_dir="/r", network=NetworkConfig(), keys=keys
    )
    assert link.connect == "tcp://[fd00::5]:7002"


def test_plain_tcp_beyond_loopback_or_curve_without_keys_is_refused(keys) -> None:
    plain = NetworkConfig(transport="tcp", curve=False)
    link = choose_link("x", same_host=True, host="127.0.0.1", port=1, run_dir="/r", network=plain, keys=None)
    assert link.server_curve is None and link.connect == "tcp://127.0.0.1:1"
    with pytest.raises(ValueError, match="without CURVE"):
        choose_link("x", same_host=False, host="10.0.0.5", port=1, run_dir="/r", network=plain, keys=None)
    with pytest.raises(ValueError, match="needs the run's keys"):
        choose_link("x", same_host=True, host="127.0.0.1", port=1, run_dir="/r", network=TCP, keys=None)


def test_ports_are_one_block_per_link_kind() -> None:
    assert link_port(20000, "supervisor", 0) == 20000
    assert link_port(20000, "tokenizer", 3) == 20000 + PORTS_PER_KIND + 3
    assert link_port(20000, "detokenizer_in", 0) == 20000 + 5 * PORTS_PER_KIND
    assert link_port(20000, "encoder", PORTS_PER_KIND - 1) == 20000 + PORT_SPAN - 1  # the last block
    with pytest.raises(ValueError, match="at most"):
        link_port(20000, "tokenizer", PORTS_PER_KIND)
    endpoints = Endpoints("/r", "run", TCP, NetworkPlan(30000, {}, None))
    with pytest.raises(ValueError):
        endpoints.tokenizer(0)  # tcp with CURVE and no keys


def test_every_link_of_a_tcp_run_has_its_own_port(keys) -> None:
    ports = set()
    plan = NetworkPlan(30000, {}, keys)
    endpoints = Endpoints("/r", "run", TCP, plan)
    for link in (endpoints.supervisor(), endpoints.tokenizer(0), endpoints.tokenizer_in(0), endpoints.scheduler_in(0),
                 endpoints.scheduler_workers(0), endpoints.detokenizer_in(0), endpoints.tokenizer(1)):  # fmt: skip
        ports.add(int(link.connect.rsplit(":", 1)[1]))
    assert len(ports) == 7 and all(30000 <= p < 30000 + PORT_SPAN for p in ports)


def test_a_run_over_several_hosts_keeps_the_scheduler_and_its_workers_on_ipc(keys) -> None:
    plan = NetworkPlan(30000, {"scheduler-1": "10.0.0.7", "gpu_worker-1-0": "10.0.0.7"}, keys)
    here = Endpoints("/r", "run", NetworkConfig(), plan)  # the head node, at network.host
    assert here.scheduler_in(1).connect == f"tcp://10.0.0.7:{link_port(30000, 'scheduler_in', 1)}"
    assert here.tokenizer_in(0).connect == f"tcp://127.0.0.1:{link_port(30000, 'tokenizer_in', 0)}"
    assert here.scheduler_workers(1).connect == "ipc:///r/scheduler-1-workers.sock"
    assert here.dist_host(1) == "10.0.0.7" and here.dist_host(0) == "127.0.0.1"
    single = Endpoints("/r", "run", NetworkConfig(), NetworkPlan())
    assert single.scheduler_in(1).connect == "ipc:///r/scheduler-1-in.sock"


def test_a_group_placed_back_at_the_heads_address_keeps_the_run_on_tcp(keys) -> None:
    """A stage that the cluster moved back to `network.host` keeps its entry in the plan, and
    the run its tcp:// links: its running stages connect to them."""
    plan = NetworkPlan(30000, {"scheduler-0": "127.0.0.1", "gpu_worker-0-0": "127.0.0.1"}, keys)
    endpoints = Endpoints("/r", "run", NetworkConfig(), plan)
    assert not endpoints.is_single_host
    assert endpoints.supervisor().connect == f"tcp://127.0.0.1:{link_port(30000, 'supervisor', 0)}"
    assert endpoints.scheduler_in(0).connect == f"tcp://127.0.0.1:{link_port(30000, 'scheduler_in', 0)}"
    assert endpoints.scheduler_workers(0).connect == "ipc:///r/scheduler-0-workers.sock"


@pytest.mark.timeout(60)
def test_reconnect_moved_follows_only_the_links_whose_server_moved(keys) -> None:
    """After a TopologyChanged that moves a group, the PUSH to a scheduler that moved (127.0.0.2 -> 127.0.0.1, same port,
    same CURVE keys) reaches its new address; the one to a scheduler that stayed is untouched."""
    from ipc import messages as m
    from ipc.codec import SCHEDULER_INPUT
    from ipc.sockets import PullQueue, PushQueue, close_context
    from services.stage import reconnect_moved

    base = free_port_base("127.0.0.1")
    before = NetworkPlan(base, {"scheduler-0": "127.0.0.2", "scheduler-1": "127.0.0.1"}, keys)
    after = NetworkPlan(base, {"scheduler-0": "127.0.0.1", "scheduler-1": "127.0.0.1"}, keys)
    old, new = Endpoints("/r", "run", TCP, before), Endpoints("/r", "run", TCP, after)
    ctx = zmq.Context()
    try:
        moved_server = PullQueue(ctx, new.scheduler_in(0), SCHEDULER_INPUT, bind=True)
        queues = [PushQueue(ctx, old.scheduler_in(g), SCHEDULER_INPUT) for g in range(2)]
        stayed = queues[1]
        reconnect_moved(ctx, queues, old.scheduler_in, new.scheduler_in, SCHEDULER_INPUT, logging.getLogger())
        assert queues[1] is stayed and queues[0].socket.last_endpoint.decode() == new.scheduler_in(0).connect
        assert queues[0].put(m.AbortRequest("r-1"))
        assert moved_server.get(10.0) == m.AbortRequest("r-1")  # through the CURVE handshake
    finally:
        close_context(ctx, 0)


def test_an_ipc_run_refuses_to_follow_a_group_to_another_host(tmp_path: Path) -> None:
    """Every link of a one-host ipc:// run is a socket file: a group that lands at another
    address cannot be reached from there, which the move says instead of starting it."""
    from ipc.shm import new_run_id
    from supervision.preflight import Refused
    from supervision.run import Run

    run, config = Run(make_run_dir(tmp_path / "run"), new_run_id()), load_config(None)
    run.plan_network(config, {})
    with pytest.raises(Refused, match=r"links are ipc:// .* set network\.transport: tcp"):
        run.move_stages(config, ["scheduler-0", "gpu_worker-0-0"], "10.0.0.7")
    assert run.network_plan.hosts == {}


def test_a_free_port_base_has_every_port_free() -> None:
    base = free_port_base("127.0.0.1")
    for port in (base, base + PORT_SPAN - 1):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


# -- key files -----------------------------------------------------------------------------------


def test_created_keys_are_private_and_load_back(tmp_path: Path) -> None:
    made = create_key_files(tmp_path / "curve")
    assert stat.S_IMODE((tmp_path / "curve").stat().st_mode) == 0o700
    for path in (tmp_path / "curve").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert load_run_keys(tmp_path / "curve") == made
    assert len({made.server_public, made.stage_public, made.client_public}) == 3
    server = load_secret_file(tmp_path / "curve" / "server.key_secret")
    assert zmq.curve_public(server.secret) == server.public == made.server_public.encode()


def test_key_files_that_are_missing_loose_or_public_are_refused(tmp_path: Path) -> None:
    create_key_files(tmp_path / "curve")
    (tmp_path / "curve" / "stage.key_secret").chmod(0o644)
    with pytest.raises(BadKeyFile, match="chmod 600"):
        load_run_keys(tmp_path / "curve")
    (tmp_path / "curve" / "stage.key_secret").unlink()
    with pytest.raises(BadKeyFile, match="does not exist"):
        load_run_keys(tmp_path / "curve")
    with pytest.raises(BadKeyFile, match="no z85 CURVE key pair"):
        load_secret_file(tmp_path / "curve" / "server.key")  # the public half only
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    garbage.chmod(0o600)
    with pytest.raises(BadKeyFile):
        load_secret_file(garbage)


def test_a_public_key_is_z85_text_or_a_certificate(keys, tmp_path: Path) -> None:
    assert load_public_key(keys.server_public) == keys.server_public.encode()
    made = create_key_files(tmp_path / "c")
    assert load_public_key(tmp_path / "c" / "server.key") == made.server_public.encode()
    with pytest.raises(BadKeyFile):
        load_public_key("too short")


def test_python_m_ipc_keys_makes_a_key_set_and_replaces_one_only_when_told(tmp_path: Path) -> None:
    def keys(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ipc.keys", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )  # fmt: skip

    done = keys(str(tmp_path / "set"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "set").iterdir()) == sorted(
        f"{name}{suffix}" for name in KEY_NAMES for suffix in (".key", ".key_secret")
    )
    server = load_run_keys(tmp_path / "set").server_public
    assert server in done.stdout
    # A set already there is kept (its holders would be cut off) unless --force.
    again = keys(str(tmp_path / "set"))
    assert again.returncode == 2 and "holds a key set already" in again.stderr and "--force" in again.stderr
    assert load_run_keys(tmp_path / "set").server_public == server
    forced = keys(str(tmp_path / "set"), "--force")
    assert forced.returncode == 0 and load_run_keys(tmp_path / "set").server_public != server
    # --help is help, not a directory named --help.
    helped = keys("--help")
    assert helped.returncode == 0 and "usage" in helped.stdout and not (tmp_path / "--help").exists()


# -- config --------------------------------------------------------------------------------------


def test_plain_tcp_beyond_loopback_is_a_config_error() -> None:
    load_config(None, ["network.transport=tcp", "network.curve=false"])  # loopback: allowed
    for overrides in (
        ["network.transport=tcp", "network.curve=false", "network.host=10.0.0.5"],
        ["network.transport=tcp", "network.curve=false", "network.bind_host=0.0.0.0"],
    ):
        with pytest.raises(ConfigError, match=r"network\.curve: plain tcp:// without CURVE"):
            load_config(None, overrides)


def test_network_layout_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"network\.port_base"):
        load_config(None, ["network.transport=tcp", "network.port_base=65500"])
    with pytest.raises(ConfigError, match=r"tokenizer\.replicas: at most 64"):
        load_config(None, ["network.transport=tcp", "tokenizer.replicas=65"])
    with pytest.raises(ConfigError, match=r"network\.keys_dir"):
        load_config(None, ["network.transport=tcp", f"network.keys_dir={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match=r"network\.transport"):
        load_config(None, ["network.transport=udp"])


def test_the_supervisor_refuses_plain_tcp_on_every_interface(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--run-dir", str(tmp_path / "run"),
         "--set", "network.transport=tcp", "--set", "network.curve=false", "--set", "network.bind_host=0.0.0.0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "config error: network.curve: plain tcp:// without CURVE listening on '0.0.0.0'" in done.stderr


def test_the_supervisor_refuses_a_keys_dir_with_a_loose_secret(tmp_path: Path) -> None:
    create_key_files(tmp_path / "keys")
    (tmp_path / "keys" / "client.key_secret").chmod(0o640)
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--run-dir", str(tmp_path / "run"), "--set", "network.transport=tcp",
         "--set", f"network.keys_dir={tmp_path / 'keys'}", "--set", "supervisor.metrics_port=0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "network: key file" in done.stderr and "chmod 600" in done.stderr


# -- client --------------------------------------------------------------------------------------


def test_a_remote_endpoint_without_keys_is_refused_at_once() -> None:
    with pytest.raises(AuthenticationFailed, match="beyond this host"):
        Client("tcp://10.1.2.3:7000")
    with pytest.raises(AuthenticationFailed, match="got only server_key"):
        Client("tcp://10.1.2.3:7000", server_key=zmq.curve_keypair()[0])
    with pytest.raises(AuthenticationFailed, match="40-character"):
        Client("tcp://10.1.2.3:7000", server_key=zmq.curve_keypair()[0], keys=(b"short", b"keys"))


def test_the_interface_of_an_address_is_found() -> None:
    from services.gpu_worker.parallel import interface_of  # torch: only in this test

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface of this host


def test_stages_placed_on_other_hosts_get_tcp_links_with_keys(tmp_path: Path) -> None:
    """What a run makes of `StageSet.place()`'s answer (stage name -> address): a plan with
    those hosts and a key set, or a clear refusal when the others could not reach it."""
    from ipc.shm import new_run_id
    from supervision.preflight import Refused
    from supervision.run import Run

    placed = {"scheduler-0": "10.0.0.7", "gpu_worker-0-0": "10.0.0.7"}
    run_dir = make_run_dir(tmp_path / "run")
    with pytest.raises(Refused, match=r"network\.host is 127\.0\.0\.1, but stages run on other hosts"):
        Run(run_dir, new_run_id()).plan_network(load_config(None), placed)
    here = node_address()
    if here is None:
        pytest.skip("no non-loopback IPv4 address")
    head = Run(run_dir, new_run_id())
    head.plan_network(load_config(None, [f"network.host={here}"]), placed)
    assert head.network_plan.hosts == placed and head.network_plan.keys is not None
    assert head.endpoints.scheduler_in(0).connect.startswith("tcp://10.0.0.7:")
    assert head.endpoints.tokenizer(0).connect.startswith(f"tcp://{here}:")
    assert head.endpoints.scheduler_workers(0).connect.startswith("ipc://")
    assert stat.S_IMODE((run_dir / "curve" / "stage.key_secret").stat().st_mode) == 0o600


@pytest.mark.timeout(180)
def test_the_link_round_trip_benchmark_measures_every_kind_of_link(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from benchmarks import ipc_bench

    monkeypatch.setattr(ipc_bench, "RTT_WARMUP", 5)
    monkeypatch.setattr(ipc_bench, "RTT_SAMPLES", 20)
    rtt = ipc_bench.bench_link_rtt(tmp_path)
    assert set(rtt) == {"ipc", "tcp", "tcp_curve"} and all(us > 0 for us in rtt.values())


def test_the_cli_refuses_a_remote_endpoint_without_keys_and_reads_key_files(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "client", *args, "generate", "hi", "--max-tokens", "1"]
        return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)

    done = cli("--endpoint", "tcp://10.1.2.3:7000")
    assert done.returncode == 1 and "beyond this host: pass server_key= and keys=" in done.stderr
    create_key_files(tmp_path / "k")
    (tmp_path / "k" / "client.key_secret").chmod(0o644)
    done = cli("--endpoint", "tcp://10.1.2.3:7000", "--server-key", str(tmp_path / "k" / "server.key"),
               "--keys", str(tmp_path / "k" / "client.key_secret"))  # fmt: skip
    assert done.returncode == 1 and "chmod 600" in done.stderr
