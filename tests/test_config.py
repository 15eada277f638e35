"""Config: typed decoding, field-path errors, overrides, and docs/config.md covering every field."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import msgspec
import pytest

from ipc.config import Config, ConfigError, load_config
from tests.conftest import REPO_ROOT


def field_paths(struct_type: type, prefix: str = "") -> list[str]:
    paths = []
    for field in msgspec.structs.fields(struct_type):
        path = f"{prefix}{field.name}"
        if isinstance(field.default, msgspec.Struct):
            paths += field_paths(type(field.default), path + ".")
        else:
            paths.append(path)
    return paths


def test_default_config_file_loads() -> None:
    config = load_config(REPO_ROOT / "configs" / "default.yaml")
    assert config.engine.device == "cpu"
    assert config.model.path == ""


def test_gpu_example_loads() -> None:
    config = load_config(REPO_ROOT / "configs" / "gpu-8x.yaml")
    assert config.engine.data_parallel * config.engine.tensor_parallel == len(config.engine.devices)


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path) -> None:
    assert isinstance(load_config(path), Config)


def test_every_field_is_documented() -> None:
    doc = (REPO_ROOT / "docs" / "config.md").read_text()
    missing = [p for p in field_paths(Config) if f"`{p}`" not in doc]
    assert not missing, f"docs/config.md lacks {missing}"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.max_num_seqs=-3", "engine.max_num_seqs: expected int >= 1, got -3"),
        ("model.dtype=int8", "model.dtype: invalid enum value 'int8'"),
        ("engine.bogus=1", "engine.bogus: unknown field"),
        ("model.max_model_len=abc", "model.max_model_len: expected int, got str"),
        ("engine=3", "engine: expected object, got int"),
        ("supervisor.hang_timeout_s=0", "supervisor.hang_timeout_s: expected float > 0.0, got 0"),
        ("lora.max_rank=0", "lora.max_rank: expected int >= 1, got 0"),
        (
            "lora.adapters={sql: /a}",
            "lora.adapters: 1 adapters, more than lora.max_cpu_loras / lora.max_loras (0)",
        ),
        ("lora.max_loras=33", "lora.max_loras: at most 32 slots"),
        # A process count with extra zeros would fork until the host gives out.
        ("gateway.replicas=100000", "gateway.replicas: expected int <= 256, got 100000"),
        ("tokenizer.replicas=257", "tokenizer.replicas: expected int <= 256, got 257"),
        ("engine.data_parallel=1000", "engine.data_parallel: expected int <= 256, got 1000"),
        ("engine.tensor_parallel=600", "engine.tensor_parallel: expected int <= 64, got 600"),
        ("autoscale.max_groups=4096", "autoscale.max_groups: expected int <= 256, got 4096"),
    ],
)
def test_errors_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(message)


def test_lora_adapters_must_be_absolute_and_fit_the_slots() -> None:
    config = load_config(None, ["lora.max_loras=2", "lora.adapters={sql: /adapters/sql}"])
    assert (config.lora.max_loras, config.lora.max_rank, config.lora.adapters) == (
        2,
        64,
        {"sql": "/adapters/sql"},
    )
    with pytest.raises(
        ConfigError,
        match=r"^lora\.adapters\.sql: the path must be an absolute adapter directory or \.gguf file, got 'a/b'",
    ):
        load_config(None, ["lora.max_loras=1", "lora.adapters={sql: a/b}"])
    with pytest.raises(ConfigError, match=r"^lora\.adapters\.sql: the path must not contain a NUL character"):
        load_config(None, ["lora.max_loras=1", 'lora.adapters={sql: "/a/b\\0c"}'])
    with pytest.raises(ConfigError, match=r"^lora\.adapters: an adapter's name must not contain control"):
        load_config(None, ["lora.max_loras=1", 'lora.adapters={"a\\tb": /adapters/sql}'])
    with pytest.raises(ConfigError, match=r"^lora\.adapters: an adapter's name must be a name of 1 to 256"):
        load_config(None, ["lora.max_loras=1", "lora.adapters={" + "x" * 257 + ": /adapters/sql}"])
    # Adapters serve at any tensor_parallel (their A / B split like the base weights), from a
    # PEFT directory or a llama.cpp GGUF file.
    config = load_config(
        None, ["lora.max_loras=1", "engine.tensor_parallel=2", "lora.adapters={sql: /adapters/sql.gguf}"]
    )
    assert (config.engine.tensor_parallel, config.lora.adapters) == (2, {"sql": "/adapters/sql.gguf"})
    # Beyond the slots, adapters wait in host memory: up to lora.max_cpu_loras, never under max_loras.
    config = load_config(None, ["lora.max_loras=1", "lora.max_cpu_loras=2", "lora.adapters={a: /a, b: /b}"])
    assert config.lora.adapters == {"a": "/a", "b": "/b"}
    with pytest.raises(ConfigError, match=r"^lora\.max_cpu_loras \(1\) is under lora\.max_loras \(2\)"):
        load_config(None, ["lora.max_loras=2", "lora.max_cpu_loras=1"])
    # An adapter may not take the name clients send for the base model.
    for served in (["gateway.served_model_name=base"], []):
        name = "base" if served else "SmolLM2-135M-Instruct"
        with pytest.raises(ConfigError, match=rf"^lora\.adapters\.{name}: the served model's name"):
            load_config(None, ["lora.max_loras=1", f"lora.adapters={{{name}: /a}}", *served])


def test_override_applies_yaml_scalars() -> None:
    config = load_config(None, ["engine.max_num_seqs=8", "engine.devices=[0, 1]", "model.dtype=bfloat16"])
    assert (config.engine.max_num_seqs, config.engine.devices, config.model.dtype) == (8, [0, 1], "bfloat16")


def test_override_without_equals_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        load_config(None, ["engine.max_num_seqs"])


@pytest.mark.parametrize(
    "content",
    [
        b"engine:\n  max_num_seqs: -3\n",
        b"engine: [1, 2\n",
        b"- a list\n",
        b"model:\n  dtype: 7\n",
        b"engine:\n  max_num_seqs: 8 # caf\xe9\n",  # Latin-1, not UTF-8
        b"engine:\n  1: 2\n",
        b"[" * 5000,
        b"engine:\n  step_timeout_s: 300\n",
    ],
)
def test_bad_config_file_gives_a_clear_error_not_a_traceback(tmp_path, content: bytes) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", str(path), "--run-dir", str(tmp_path / "run")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("config error: ")


def test_non_utf8_file_names_the_byte(tmp_path) -> None:
    path = tmp_path / "latin1.yaml"
    content = b"engine:\n  max_num_seqs: 8 # caf\xe9\n"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"is not UTF-8 text: byte 0xe9 at offset {content.index(0xE9)}$"):
        load_config(path)


def test_non_string_field_names_are_refused(tmp_path) -> None:
    path = tmp_path / "int-keys.yaml"
    path.write_text("engine:\n  1: 2\n")
    with pytest.raises(ConfigError, match=r"^engine: field names must be strings"):
        load_config(path)


@pytest.mark.parametrize(
    "overrides",
    [
        ["engine.step_timeout_s=60", "supervisor.hang_timeout_s=60"],
        ["engine.step_timeout_s=120", "supervisor.hang_timeout_s=60"],
        ["engine.step_timeout_s=300"],
    ],
)
def test_step_timeout_must_be_below_hang_timeout(overrides: list[str]) -> None:
    """The scheduler gives up on a stuck worker after step_timeout_s; a supervisor that gave up on
    the waiting scheduler first would blame and restart the wrong stage."""
    with pytest.raises(
        ConfigError, match=r"engine.step_timeout_s \(\d+\) must be below supervisor.hang_timeout_s"
    ):
        load_config(None, overrides)


def test_heartbeat_interval_must_be_below_hang_timeout() -> None:
    with pytest.raises(ConfigError, match=r"supervisor.heartbeat_interval_s \(5\) must be below"):
        load_config(
            None,
            ["engine.step_timeout_s=1", "supervisor.hang_timeout_s=4", "supervisor.heartbeat_interval_s=5"],
        )


def test_restart_backoff_cannot_start_above_its_ceiling() -> None:
    """The wait before a restart starts at backoff_initial_s and doubles up to backoff_max_s; a
    start above the ceiling would silently wait the ceiling every time."""
    with pytest.raises(
        ConfigError,
        match=r"supervisor.backoff_initial_s \(9\) must be at most supervisor.backoff_max_s \(5\)",
    ):
        load_config(None, ["supervisor.backoff_initial_s=9"])
    assert load_config(None, ["supervisor.backoff_initial_s=5"]).supervisor.backoff_initial_s == 5


def test_int8_activations_are_off_by_default_and_only_on_the_cpu_in_float32() -> None:
    """They change the numbers, so only an explicit opt-in turns them on; where they could not
    apply (a GPU, half precision) the option is refused rather than silently ignored."""
    assert load_config(None).engine.cpu_int8_activations is False
    assert load_config(None, ["engine.cpu_int8_activations=true"]).engine.cpu_int8_activations is True
    assert load_config(
        None, ["engine.cpu_int8_activations=true", "model.dtype=float32"]
    ).engine.cpu_int8_activations
    for overrides in (["engine.device=cuda"], ["model.dtype=bfloat16"]):
        with pytest.raises(
            ConfigError, match=r"engine\.cpu_int8_activations: applies to the CPU path in float32"
        ):
            load_config(None, ["engine.cpu_int8_activations=true", *overrides])
    with pytest.raises(ConfigError, match=r"engine\.cpu_int8_activations: expected bool, got int"):
        load_config(None, ["engine.cpu_int8_activations=1"])


def test_wide_steps_are_float32_by_default_and_bf16_only_on_the_cpu_in_float32() -> None:
    """bf16 wide steps change the numbers, so only an explicit opt-in turns them on; where they
    could not apply (a GPU, half precision) the option is refused rather than silently ignored."""
    assert load_config(None).engine.cpu_wide_step_dtype == "float32"
    for overrides in ([], ["model.dtype=float32"]):
        config = load_config(None, ["engine.cpu_wide_step_dtype=bfloat16", *overrides])
        assert config.engine.cpu_wide_step_dtype == "bfloat16"
    for overrides in (["engine.device=cuda"], ["model.dtype=bfloat16"]):
        with pytest.raises(
            ConfigError, match=r"engine\.cpu_wide_step_dtype=bfloat16: applies to the CPU path in float32"
        ):
            load_config(None, ["engine.cpu_wide_step_dtype=bfloat16", *overrides])
    assert load_config(None, ["engine.cpu_wide_step_dtype=float32", "engine.device=cuda"])
    with pytest.raises(ConfigError, match=r"engine\.cpu_wide_step_dtype: invalid enum value 'float16'"):
        load_config(None, ["engine.cpu_wide_step_dtype=float16"])


def test_default_timeouts_agree() -> None:
    config = load_config(None)
    assert config.engine.step_timeout_s < config.supervisor.hang_timeout_s


def test_missing_config_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["engine.device=cuda", "engine.tensor_parallel=2"], "this host has 0 CUDA device(s)"),
        (["engine.data_parallel=2", "engine.devices=[0]"], "engine.devices lists 1 devices"),
        (["engine.data_parallel=2", "engine.devices=[1, 1]"], "engine.devices has duplicates"),
    ],
)
def test_impossible_device_layout_is_refused(tmp_path, overrides: list[str], message: str) -> None:
    argv = [sys.executable, "supervisor.py", "--run-dir", str(tmp_path / "run")]
    for override in overrides:
        argv += ["--set", override]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.backend=slurm"], "cluster.backend: invalid enum value 'slurm'"),
        (["cluster.engine_resources={GPU: 1}"], "cluster.engine_resources.GPU: GPU is Ray's own resource"),
        (["cluster.light_resources={CPU: 1}"], "cluster.light_resources.CPU: CPU is Ray's own resource"),
        (["cluster.engine_resources={engine: 0}"], "cluster.engine_resources.engine: expected an amount > 0"),
        (
            ["cluster.engine_resources={engine: many}"],
            "cluster.engine_resources[...]: expected float, got str",
        ),
        (["cluster.engine_cpus=-1"], "cluster.engine_cpus: expected float >= 0.0"),
        (
            ["cluster.backend=ray", "cluster.engine_cpus=0"],
            "cluster.engine_cpus is 0 and cluster.engine_resources",
        ),
    ],
)
def test_cluster_errors_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(message), str(info.value)


def test_ray_backend_without_ray_installed_says_how_to_install_it(monkeypatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"ray needs the ray package.*pip install '\.\[ray\]'"):
        load_config(None, ["cluster.backend=ray"])
    assert load_config(None).cluster.backend == "local"  # the default never needs it


def test_the_local_backend_never_imports_ray(tmp_path) -> None:
    """The supervisor, its stage set, every stage's shared code and the client, on the default
    backend, in a fresh interpreter (so that no other test's import of ray counts)."""
    script = (
        "import sys, pathlib\n"
        "import supervisor, client, services.stage, services.tokenizer.core, services.detokenizer.core\n"
        "from ipc.config import load_config\n"
        "from supervision.backends import make_stage_set\n"
        "run_dir = pathlib.Path(sys.argv[1])\n"
        "stages = make_stage_set(load_config('configs/default.yaml'), run_dir, 'text', 'x')\n"
        "from ipc.topology import Topology\n"
        "for spec in Topology.of(load_config(None)).stages(): stages.add(spec)\n"
        "stages.place(); stages.close()\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
        "print(type(stages).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "StageSet"


def test_deprecated_frontend_section_still_configures_the_tokenizer(tmp_path, caplog) -> None:
    """The tokenizer stage's section was `frontend`: old files and overrides keep working, with a warning."""
    path = tmp_path / "old.yaml"
    path.write_text("frontend:\n  replicas: 2\n")
    with caplog.at_level("WARNING", logger="brigade.config"):
        config = load_config(path, ["frontend.default_max_tokens=7"])
    assert (config.tokenizer.replicas, config.tokenizer.default_max_tokens) == (2, 7)
    assert "deprecated" in caplog.text
    path.write_text("frontend:\n  replicas: 2\ntokenizer:\n  replicas: 3\n")
    with pytest.raises(ConfigError, match="replicas"):
        load_config(path)


@pytest.mark.timeout(30)
def test_a_reload_reads_only_a_bounded_regular_file_and_never_blocks(tmp_path) -> None:
    """A FIFO put in the config's place would block a reload in open() until someone writes to
    it, and the supervisor's watch loop with it."""
    fifo = tmp_path / "brigade.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config(fifo, regular_file_only=True)
    huge = tmp_path / "huge.yaml"
    huge.write_text("# padding\n" * 200_000)
    with pytest.raises(ConfigError, match="too large to be a config"):
        load_config(huge, regular_file_only=True)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["gateway.tls.certfile=/c.pem"], r"^gateway\.tls: certfile and keyfile go together"),
        (["gateway.tls.keyfile=/k.pem"], r"^gateway\.tls: certfile and keyfile go together"),
        (["gateway.tls.client_ca=/ca.pem"], r"^gateway\.tls\.client_ca: client certificates need HTTPS"),
        (["gateway.access_log.max_bytes=0"], r"^gateway\.access_log\.max_bytes: expected int >= 1"),
    ],
)
def test_gateway_tls_and_access_log_settings_that_cannot_work_are_refused(
    overrides: list[str], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)


def test_run_as_must_name_a_user_of_this_host() -> None:
    with pytest.raises(ConfigError, match=r"^supervisor\.run_as: there is no user 'no-such-user-here'"):
        load_config(None, ["supervisor.run_as=no-such-user-here"])
    assert load_config(None, ["supervisor.run_as=root"]).supervisor.run_as == "root"


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["encoder.in_worker=true", "encoder.replicas=1"],
         r"^encoder\.in_worker: the worker of engine group 0 runs the encoder, .*set encoder\.replicas to 0 \(got 1\)"),
        (["encoder.in_worker=true", "cluster.backend=ray"],
         r"^encoder\.in_worker runs on one host .*with cluster\.backend: ray use encoder\.replicas"),
    ],
)  # fmt: skip
def test_the_encoder_in_the_worker_is_refused_beside_an_encoder_stage_or_on_ray(
    overrides: list[str], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)
    config = load_config(None, ["encoder.in_worker=true"])
    assert config.encoder.num_encoders == 1 and config.encoder.replicas == 0


@pytest.mark.timeout(30)
def test_yaml_aliases_that_expand_without_bound_are_refused(tmp_path) -> None:
    """A few hundred bytes of aliases of aliases ("billion laughs") in the one free-form field
    took seconds and hundreds of MB to put into an error message; one level more, all the memory."""
    levels = ["&a0 [t, t, t, t, t, t, t, t, t]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 8)]
    path = tmp_path / "laughs.yaml"
    path.write_text(f"model:\n  override_generation_config:\n    temperature: [{', '.join(levels)}]\n")
    with pytest.raises(
        ConfigError, match=r"^model\.override_generation_config\.temperature\[.*expands to more"
    ):
        load_config(path)
    path.write_text("model:\n  override_generation_config:\n    temperature: &x [*x]\n")
    with pytest.raises(
        ConfigError, match=r"^model\.override_generation_config\.temperature\[0\]: contains itself"
    ):
        load_config(path)
    # An alias used twice, not around itself, is ordinary YAML.
    path.write_text("gateway:\n  api_keys: &keys [k1, k2]\n  cors_origins: *keys\n")
    assert load_config(path).gateway.cors_origins == ["k1", "k2"]


@pytest.mark.parametrize(
    "override",
    [
        "autoscale.scale_down_window_s=.inf",
        "autoscale.target_running=.inf",
        "cluster.engine_cpus=.inf",
        "cluster.engine_resources.accel=.inf",
    ],
)
def test_infinite_numbers_are_refused_since_run_json_cannot_carry_them(override: str) -> None:
    """Every stage reads the config from run.json, JSON, where inf is written as null: a run
    started with one failed at its stages' first start, on a float that was null."""
    path = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: expected a finite number, got inf$"):
        load_config(None, [override])
    config = load_config(None, [override.replace(".inf", "1.0e+9")])
    assert msgspec.json.decode(msgspec.json.encode(config), type=Config) == config


@pytest.mark.parametrize(
    "overrides",
    [
        ["gateway.port=8001"],
        ["supervisor.metrics_port=8000"],
        ["supervisor.metrics_port=8000", "supervisor.metrics_host=0.0.0.0"],
        ["supervisor.metrics_port=8000", "gateway.host=0.0.0.0", "supervisor.metrics_host=127.0.0.1"],
    ],
)
def test_metrics_on_the_gateways_port_and_address_is_refused(overrides: list[str]) -> None:
    """The supervisor binds /metrics before the gateways start: on their port and address it
    took the port, and every gateway failed to start with 'address in use'."""
    with pytest.raises(ConfigError, match=r"^supervisor\.metrics_port: 800[01] is gateway\.port too"):
        load_config(None, overrides)
    # Apart: no gateways, no /metrics, or two addresses of this host.
    load_config(None, [*overrides, "gateway.replicas=0"])
    load_config(None, [*overrides, "supervisor.metrics_port=0"])
    load_config(None, ["supervisor.metrics_port=8000", "supervisor.metrics_host=10.0.0.5"])


@pytest.mark.parametrize(
    ("content", "key"),
    [
        ("engine:\n  max_num_seqs: 8\ntokenizer:\n  replicas: 2\nengine:\n  block_size: 32\n", "engine"),
        ("engine:\n  max_num_seqs: 8\n  max_num_seqs: 16\n", "max_num_seqs"),
    ],
)
def test_a_key_given_twice_is_refused_with_its_line(tmp_path, content: str, key: str) -> None:
    """YAML keeps the last of two equal keys: a second `engine:` section silently dropped all of
    the first one's settings."""
    path = tmp_path / "twice.yaml"
    path.write_text(content)
    with pytest.raises(
        ConfigError, match=rf"(?s)is not valid YAML: .*found duplicate key '{key}'.*line [35]"
    ):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^--set lora.adapters: found duplicate key 'a'"):
        load_config(None, ["lora.max_loras=2", "lora.adapters={a: /x, a: /y}"])
    # A merge key's values may be overridden: that is what it is for.
    path.write_text("tokenizer: &base {replicas: 2}\ndetokenizer:\n  <<: *base\n  replicas: 3\n")
    assert load_config(path).detokenizer.replicas == 3
    # A merged mapping that overrides a merge of its own: merging it elsewhere first copies its
    # base's keys into it, which is no key given twice.
    path.write_text(
        "tokenizer: &one {replicas: 1}\ndetokenizer:\n  <<: &two\n    <<: *one\n    replicas: 2\nencoder: *two\n"
    )
    assert load_config(path).encoder.replicas == load_config(path).detokenizer.replicas == 2


@pytest.mark.parametrize(
    ("value", "read_as"), [("010", "8"), ("-010", "-8"), ("0_10", "8"), ("1:30", "90"), ("1:30.5", "90.5")]
)
def test_numbers_yaml_1_1_reads_as_octal_or_base_60_are_refused(tmp_path, value: str, read_as: str) -> None:
    """PyYAML reads YAML 1.1: `max_num_seqs: 010` was 8 and `drain_timeout_s: 1:30` 90, silently."""
    path = tmp_path / "numbers.yaml"
    field = "max_num_seqs" if "." not in value else "step_timeout_s"
    path.write_text(f"engine:\n  {field}: {value}\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: line 2: '{value}' reads in YAML 1.1 as {read_as} "
    ):
        load_config(path)
    with pytest.raises(
        ConfigError, match=rf"^--set engine.{field}: '{value}' reads in YAML 1.1 as {read_as} "
    ):
        load_config(None, [f"engine.{field}={value}"])


def test_numbers_that_read_the_same_either_way_load_as_ever(tmp_path) -> None:
    path = tmp_path / "numbers.yaml"
    path.write_text("engine:\n  max_num_seqs: 10\n  step_timeout_s: 0.5\n  tensor_parallel: 01\n")
    config = load_config(
        path, ["gateway.port=0x1f4a", "engine.block_size=1_6", "engine.max_num_batched_tokens=07"]
    )
    engine = config.engine
    assert (engine.max_num_seqs, engine.step_timeout_s, engine.tensor_parallel) == (10, 0.5, 1)
    assert (config.gateway.port, engine.block_size, engine.max_num_batched_tokens) == (8010, 16, 7)
    # A tag that says number over what is none is a config error too, not a ValueError's traceback.
    with pytest.raises(ConfigError, match=r"^--set engine.max_num_seqs: '08' is not the number its tag says"):
        load_config(None, ["engine.max_num_seqs=!!int 08"])


@pytest.mark.parametrize("content", ["[]\n", "false\n", "0\n", "''\n"])
def test_an_empty_value_at_the_top_is_no_mapping_either(tmp_path, content: str) -> None:
    """Only an empty file (or one of comments) is all defaults: `[]` or `false` read as one, so
    that a reload of a config file truncated to such a value put every live setting back to its
    default."""
    path = tmp_path / "top.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"the top level must be a mapping of sections$"):
        load_config(path)
    path.write_text("# all defaults\n")
    assert load_config(path) == Config()


def test_a_set_value_nested_too_deeply_is_a_config_error() -> None:
    """A file nested too deeply was refused, but the same value after --set ended the start with
    a RecursionError traceback."""
    with pytest.raises(ConfigError, match=r"^--set value '\[\[\[.*is nested too deeply"):
        load_config(None, ["engine.devices=" + "[" * 2000 + "]" * 2000])


@pytest.mark.parametrize("override", [" =5", ".engine=5", "engine.=5", "engine..max_num_seqs=5"])
def test_a_set_key_with_an_empty_field_name_is_refused_as_such(override: str) -> None:
    """These were refused as `: unknown field` or `engine.: unknown field`, naming no field."""
    with pytest.raises(
        ConfigError, match=r"^--set expects key\.path=value with a field name between every two dots"
    ):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override",
    [
        "observability.mlflow.interval_s=1.0e+10",
        "encoder.remote_image_timeout_s=1.0e+10",
        "supervisor.hang_timeout_s=.inf",
        "gateway.body_timeout_s=.inf",
    ],
)
def test_timeouts_beyond_what_a_wait_takes_are_refused(override: str) -> None:
    """threading.Event.wait and socket timeouts raise OverflowError past ~292 years: the MLflow
    sink's thread died on such an interval, an image fetch on such a timeout."""
    path = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: expected float <= 1000000000\.0, got "):
        load_config(None, [override])
    assert load_config(None, [f"{path}=1.0e+8"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "engine.step_timeout_s=1e2",
            "engine.step_timeout_s: expected float, got str '1e2' (YAML reads it as text: write 1.0e-3 or 1.0e+3",
        ),
        ("engine.max_num_seqs=abc", "engine.max_num_seqs: expected int, got str 'abc'"),
        ("engine.max_num_seqs=", "engine.max_num_seqs: expected int, got str ''"),
    ],
)
def test_a_string_where_a_number_goes_is_shown(override: str, message: str) -> None:
    """`expected float, got str` for a value written 1e2 did not say what was read, nor that YAML
    1.1 reads an exponent without a dot and a sign as text."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(message)
