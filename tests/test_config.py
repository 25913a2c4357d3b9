import json
import os
from pathlib import Path

import pytest
import yaml

from diffusion_debug import ConfigError, DebugConfig, DiffusionDebugError
from diffusion_debug.config import LEVELS, PRESETS

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("level", LEVELS)
def test_preset_files_equal_the_levels(level):
    assert DebugConfig.from_file(CONFIGS / f"{level}.yaml") == DebugConfig(level=level)


def test_level_fills_only_what_is_not_given():
    cfg = DebugConfig(level="extreme", probes="sentinel")
    assert cfg.probes == "sentinel"
    assert cfg.preview_vae_every == PRESETS["extreme"]["preview_vae_every"] == 5
    assert DebugConfig().level == "advanced" and DebugConfig().probes == "sentinel"


def test_stable_keys():
    cfg = DebugConfig(level="basic", output_dir="somewhere", policy="raise", strict=True)
    assert (cfg.level, cfg.output_dir, cfg.policy, cfg.strict) == ("basic", "somewhere", "raise", True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"levl": "basic"}, "Unknown config key 'levl'; did you mean 'level'?"),
        ({"output_dri": "x"}, "Unknown config key 'output_dri'; did you mean 'output_dir'?"),
        ({"debug_output_dir": "x"}, "Unknown config key 'debug_output_dir'; in code it is called 'output_dir'."),
        ({"level": "hard"}, "Config key 'level' must be one of 'basic', 'advanced', 'extreme', not 'hard'."),
        (
            {"policy": "rasie"},
            "Config key 'policy' must be one of 'record', 'warn', 'skip', 'raise', 'stop', "
            "not 'rasie' (did you mean 'raise'?).",
        ),
        (
            {"autograd_anomaly_mode": "loud"},
            "Config key 'autograd_anomaly_mode' must be one of 'detect', 'warn', 'raise', not 'loud'.",
        ),
        ({"overflow_fraction": 1.5}, "Config key 'overflow_fraction' must be in (0, 1], not 1.5."),
        ({"grad_explosion_threshold": -1}, "Config key 'grad_explosion_threshold' must be positive, not -1."),
        ({"history_size": 0}, "Config key 'history_size' must be an integer >= 1, not 0."),
        (
            {"history_size": 10**20},
            "Config key 'history_size' must be at most 10000000, not 100000000000000000000.",
        ),
        ({"loss_spike_window": 10**8}, "Config key 'loss_spike_window' must be at most 100000, not 100000000."),
        ({"timestep_buckets": 10**8}, "Config key 'timestep_buckets' must be at most 10000, not 100000000."),
        ({"step_offset": 2**63}, "Config key 'step_offset' must be at most 1000000000000, not 9223372036854775808."),
        ({"strict": "yes"}, "Config key 'strict' must be a bool, not str 'yes'."),
        ({"loss_spike_threshold": float("nan")}, "Config key 'loss_spike_threshold' must be a number, not nan."),
        ({"run_name": "a/b"}, "Config key 'run_name' must be a plain directory name, not 'a/b'."),
        ({"serve_port": -1}, "Config key 'serve_port' must be a port from 0 to 65535 or None, not -1."),
        ({"serve_port": "abc"}, "Config key 'serve_port' must be a port from 0 to 65535 or None, not 'abc'."),
        ({"serve_port": 70000}, "Config key 'serve_port' must be a port from 0 to 65535 or None, not 70000."),
        ({"serve_port": True}, "Config key 'serve_port' must be a port from 0 to 65535 or None, not True."),
    ],
)
def test_bad_config_is_one_clear_sentence(kwargs, message):
    with pytest.raises(ConfigError) as info:
        DebugConfig(**kwargs)
    assert str(info.value) == message
    assert isinstance(info.value, DiffusionDebugError) and isinstance(info.value, ValueError)


def test_the_largest_sizes_are_accepted():
    cfg = DebugConfig(history_size=10_000_000, loss_spike_window=100_000, timestep_buckets=10_000, step_offset=10**12)
    assert (cfg.history_size, cfg.loss_spike_window, cfg.timestep_buckets) == (10_000_000, 100_000, 10_000)


def test_from_file_yaml_and_json_and_file_aliases(tmp_path):
    (tmp_path / "a.yaml").write_text("level: basic\ndebug_output_dir: out\nmax_debug_iterations: 10\n")
    cfg = DebugConfig.from_file(tmp_path / "a.yaml")
    assert (cfg.level, cfg.output_dir, cfg.max_debug_iterations) == ("basic", "out", 10)
    (tmp_path / "b.json").write_text(json.dumps({"policy": "warn", "enable_autograd_anomaly": True}))
    cfg = DebugConfig.from_file(tmp_path / "b.json")
    assert cfg.policy == "warn" and cfg.enable_autograd_anomaly
    assert DebugConfig.from_file(_write(tmp_path, "empty.yaml", "")) == DebugConfig()


def test_serve_port_from_yaml_off_by_default():
    assert DebugConfig().serve_port is None
    assert DebugConfig.from_dict(yaml.safe_load("serve_port: 0\n")).serve_port == 0
    assert DebugConfig.from_dict(yaml.safe_load("serve_port: 8766\n")).serve_port == 8766
    assert DebugConfig.from_dict(yaml.safe_load("serve_port: null\n")).serve_port is None
    with pytest.raises(ConfigError, match="'serve_port'"):
        DebugConfig.from_dict(yaml.safe_load("serve_port: '8766'\n"))


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_from_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^Config file '.*missing.yaml' does not exist\.$"):
        DebugConfig.from_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"is not valid YAML"):
        DebugConfig.from_file(_write(tmp_path, "bad.yaml", "level: [basic\n"))
    with pytest.raises(ConfigError, match=r"is not valid JSON"):
        DebugConfig.from_file(_write(tmp_path, "bad.json", "{level: 1"))
    with pytest.raises(ConfigError, match=r"must hold a mapping of keys to values, not list"):
        DebugConfig.from_file(_write(tmp_path, "list.yaml", "- level\n"))
    with pytest.raises(ConfigError, match="Unknown config key 'polcy'; did you mean 'policy'"):
        DebugConfig.from_file(_write(tmp_path, "typo.yaml", "polcy: raise\n"))
    with pytest.raises(ConfigError, match="given twice"):
        DebugConfig.from_dict({"output_dir": "a", "debug_output_dir": "b"})


def test_to_dict_round_trips():
    cfg = DebugConfig(level="extreme", policy="stop", output_dir="x")
    assert DebugConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(policy="warn").policy == "warn"
    with pytest.raises(ConfigError):
        cfg.replace(policy="nope")


def test_replace_rederives_what_came_from_the_level_and_keeps_what_was_set():
    assert DebugConfig(level="basic").replace(level="extreme").probes == "full"
    assert DebugConfig(level="basic", probes="off").replace(level="extreme").probes == "off"
    assert DebugConfig(level="extreme").replace(policy="warn") == DebugConfig(level="extreme", policy="warn")


def test_assignment_is_validated_and_a_bad_value_changes_nothing():
    cfg = DebugConfig(level="basic")
    with pytest.raises(ConfigError, match=r"^Config key 'policy' must be one of .* not 'explode'\.$"):
        cfg.policy = "explode"
    assert cfg.policy == "record"
    with pytest.raises(ConfigError, match="Unknown config key 'polcy'; did you mean 'policy'"):
        cfg.polcy = "raise"
    cfg.policy = "raise"  # a valid change is kept, and survives replace(level=...)
    assert cfg.replace(level="extreme").policy == "raise"


def test_assignment_is_replace_in_place():
    cfg = DebugConfig(level="basic", previews=False)
    cfg.level = "extreme"  # what came from the level follows it; what was set stays
    assert cfg == DebugConfig(level="basic", previews=False).replace(level="extreme")
    assert (cfg.probes, cfg.preview_vae_every, cfg.previews) == ("full", 5, False)
    with pytest.warns(DeprecationWarning, match="'debug_level' is now called 'log_level'"):
        cfg.debug_level = "error"
    assert cfg.log_level == "error"


def test_options_are_keywords_and_a_path_output_dir_becomes_a_string(tmp_path):
    with pytest.raises(TypeError):
        DebugConfig("basic")
    assert DebugConfig(output_dir=tmp_path).output_dir == str(tmp_path)


def test_a_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    # only valid keys, so the message has to show the value: 9**9 strings once expanded
    bomb = "\n".join(["level: basic", "policy:"] + [f"  {line}" for line in lines]) + "\n"
    path.write_text(bomb)
    with pytest.raises(ConfigError) as caught:
        DebugConfig.from_file(path)
    assert len(str(caught.value)) < 400 and "policy" in str(caught.value)


def test_config_files_are_size_limited_and_keys_must_be_names(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("level: basic\n" + "#" * 70_000 + "\n")
    with pytest.raises(ConfigError, match="is over 64 KB"):
        DebugConfig.from_file(big)
    if os.path.exists("/dev/zero"):  # a device has no size to stat: the read itself stops at the cap
        with pytest.raises(ConfigError, match="^Config file '/dev/zero' is over 64 KB; a config is a few lines.$"):
            DebugConfig.from_file("/dev/zero")
    numbered = tmp_path / "n.yaml"
    numbered.write_text("1: basic\n")
    with pytest.raises(ConfigError, match="^Config keys are names, not int 1.$"):
        DebugConfig.from_file(numbered)


def test_old_option_names_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="'debug_level' is now called 'log_level'"):
        cfg = DebugConfig(debug_level="error")
    assert cfg.log_level == "error"
    assert DebugConfig.from_dict({"save_debug_info": False}).stream_events is False
    with pytest.raises(ConfigError, match="given twice"):
        DebugConfig(log_level="info", debug_level="error")
