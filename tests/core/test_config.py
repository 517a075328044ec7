import os

import pytest

from tandem.core.config import RunConfig, dump_config, load_config
from tandem.core.errors import ConfigError


def test_defaults_validate_and_every_field_is_documented():
    cfg = RunConfig()
    for section_name, section in cfg:
        for name, field in type(section).model_fields.items():
            assert field.description, f"{section_name}.{name} has no docstring"


def test_overrides_parse_toml_values(tmp_path):
    cfg = load_config(overrides=["train.lr=1e-4", "orchestrator.mode=sync", "tasks.levels=[1]", "train.lr=1"])
    assert cfg.train.lr == 1.0 and cfg.orchestrator.mode == "sync" and cfg.tasks.levels == [1]
    path = tmp_path / "c.toml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lrr=1", "train.lrr"),
        ("orchestrator.mode=fast", "orchestrator.mode"),
        ("rollout.group_size=1", "group_size"),
        ("train.lr=abc", "train.lr"),
        ("rollout.top_p=0", "top_p"),
        ("noequals", "key=value"),
        ("train.micro_batch_tokens=0", "train.micro_batch_tokens must be > 0"),
        ("engine.max_batch=-3", "engine.max_batch must be > 0"),
        ("tasks.levels=[4]", "tasks.levels"),
        ("weights.transport=carrier_pigeon", "weights.transport"),
        ("weights.relays=-1", "weights.relays"),
        ("orchestrator.engine_restarts=-1", "orchestrator.engine_restarts"),
        ("orchestrator.worker_restarts=1.5", "orchestrator.worker_restarts"),
        ("orchestrator.worker_restarts=5000", "orchestrator.worker_restarts"),
        ("weights.snapshot_every=0", "weights.snapshot_every must be > 0"),
        ("weights.connections=0", "weights.connections must be > 0"),
        ("engine.threads=100000", "engine.threads must be <= 1024"),
        ("train.threads=2000", "train.threads must be <= 1024"),
        ("weights.codec_threads=5000", "weights.codec_threads must be <= 1024"),
        ("train.epochs=0", "train.epochs must be > 0"),
        ("train.mini_batches=9", "train.mini_batches"),
        ("train.loss=ppo2", "train.loss"),
        ("train.is_correction=magic", "train.is_correction"),
        ("tasks.source=mbpp", "tasks.source"),
        ("engine.double_buffer_weights=maybe", "engine.double_buffer_weights"),
        ("weights.host_share=sometimes", "weights.host_share"),
        ("weights.host_leader=perhaps", "weights.host_leader"),
        ("sandbox.scratch=ram", "sandbox.scratch"),
        ("engine.gather_idle_ms=-1", "engine.gather_idle_ms"),
        ("engine.gather_idle_max_ms=1e9", "engine.gather_idle_max_ms"),
        ("weights.lead_yield_ms=-5", "weights.lead_yield_ms"),
        ("train.lr=nan", "train.lr`: Input should be a finite number"),
        ("train.lr=inf", "train.lr`: Input should be a finite number"),
        ("tasks.wall_time_s=-inf", "tasks.wall_time_s`: Input should be a finite number"),
        ("tasks.wall_time_s=1e9", "tasks.wall_time_s"),  # an external harness's exec overflowed its wait
        ("tasks.wall_time_s=0", "tasks.wall_time_s"),
        ("train.betas=[0.9,1.0]", "train.betas must each be in"),
        ("train.grad_clip=-1", "train.grad_clip must be >= 0"),
        ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
        ("train.kl_coef=-1", "train.kl_coef must be >= 0"),
        ("eval.temperature=0", "eval.temperature must be >= 0.001"),
        ("rollout.temperature=1e-40", "rollout.temperature must be >= 0.001"),
        ("orchestrator.time_budget_s=-1", "orchestrator.time_budget_s must be >= 0"),
        ("rollout.harness_max_concurrent=0", "rollout.harness_max_concurrent"),
        ("rollout.harness_max_sessions=100000", "rollout.harness_max_sessions"),
        ("rollout.harness_sampling=greedy", "rollout.harness_sampling"),
        ("train.seed=18446744073709551616", "train.seed"),  # had failed in torch after Ray started
        ("train.seed=-1", "train.seed"),
        ("tasks.seed=-1", "tasks.seed"),
        ("reward.tool_error_penalty=-5", "reward.tool_error_penalty"),  # had paid for malformed calls
        ("reward.test_edit_penalty=1e308", "reward.test_edit_penalty"),
        ("reward.terms=['1e308 * pass_fraction', '1e308 * all_passed']", "weight"),  # had made the reward inf
        ("reward.judge_timeout_s=1e300", "reward.judge_timeout_s"),  # every judge call had failed
        ("reward.judge_backoff_s=1e300", "reward.judge_backoff_s"),
        ("reward.terms=['1 * f3p_fraction']", "unknown component 'f3p_fraction'"),
        ("tasks.max_turns=true", "tasks.max_turns`: expected a number, not true or false"),  # had run 1 turn
        ("tasks.max_turns='6'", "tasks.max_turns`: expected a number, not a string"),
        ("train.betas=[true, 0.9]", "train.betas`: expected a number, not true or false"),
        ("train.clip_eps_low=false", "train.clip_eps_low`: expected a number"),
        ("tasks.levels=[true]", "tasks.levels`: expected a number"),
    ],
)
def test_invalid_config_names_the_field(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=[override])


def test_a_config_error_never_shows_the_judges_api_key():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["reward.judge_api_key='sk-LEAKME-999'", "reward.judge_api_key_env='X'"])
    assert "judge_api_key" in str(info.value) and "sk-LEAKME-999" not in str(info.value)
    for url in ("http://:99999/x", "http://[::1", "http://host:0/v1"):  # passed a pattern, failed every call
        with pytest.raises(ConfigError, match="judge_url") as info:
            load_config(overrides=[
                "reward.criteria=['style: is it tidy']", "reward.terms=['1 * judge.style']",
                f"reward.judge_url='{url}'", "reward.judge_model='m'", "reward.judge_api_key='sk-LEAKME-999'",
            ])  # fmt: skip
        assert "sk-LEAKME-999" not in str(info.value)


def test_strings_with_control_characters_survive_the_run_config_round_trip(tmp_path):
    """``judge_model = "fake\u0001model"`` was written raw into config.toml, which ``--resume`` then could
    not read ("Illegal character")."""
    cfg = load_config(base={"reward": {"judge_model": 'fake\x01model \t\r\n\x7f\x1b\\ " end'}})
    assert "\x01" in cfg.reward.judge_model
    path = tmp_path / "config.toml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_a_cross_field_error_names_the_field_without_dumping_the_config():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["orchestrator.steps=-1"])
    assert "orchestrator.steps must be > 0, got -1" in str(info.value)
    assert "'model'" not in str(info.value) and "Value error" not in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_unreadable_files_and_values_are_config_errors(tmp_path):
    """Not UTF-8, a directory, a number past Python's 4300-digit limit (file or --set): a ConfigError naming
    the source, never a UnicodeDecodeError or ValueError traceback."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[train]")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(binary)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    big = tmp_path / "big.toml"  # a comment: valid TOML, but no run config is 16 MiB
    big.write_text("#" * (16 * 2**20 + 1))
    with pytest.raises(ConfigError, match="big.toml is over 16 MiB"):
        load_config(big)
    # /proc/self/mem was an OSError (EIO) traceback, /proc/kmsg blocked for ever (and took the kernel's log)
    for kernel_file in ("/proc/self/mem", "/proc/kmsg", "/sys/kernel/mm/transparent_hugepage/enabled"):
        if os.path.exists(kernel_file):
            with pytest.raises(ConfigError, match=f"config file {kernel_file} is on a (proc|sysfs) file"):
                load_config(kernel_file)
    huge = tmp_path / "huge.toml"
    huge.write_text("[train]\nlr = " + "1" * 5000 + "\n")
    with pytest.raises(ConfigError, match="huge.toml: a value is too long to read"):
        load_config(huge)
    with pytest.raises(ConfigError, match="--set value .* too long to read"):
        load_config(overrides=["train.lr=" + "1" * 5000])


@pytest.mark.parametrize(
    "override",
    ["sandbox.file_mb=0", "sandbox.cpu_s=-1", "sandbox.max_output_bytes=-5", "sandbox.timeout_s=1e9",
     "sandbox.disk_mb=99999999999", "sandbox.pids=99999999", "sandbox.memory_mb=99999999999",
     "sandbox.memory_mb=8", "sandbox.pids=0", "sandbox.timeout_s=0",
     "sandbox.pids=2"],  # bwrap (the default backend) and its init count too: "Cannot fork" in every call
)  # fmt: skip
def test_sandbox_limits_outside_what_the_kernel_takes_name_the_field(override):
    with pytest.raises(ConfigError, match=f"config field `{override.split('=')[0]}`"):
        load_config(overrides=[override])
