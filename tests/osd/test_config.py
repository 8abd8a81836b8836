"""The config loader: every file under configs/ loads; bad keys and values are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from osd.config import BUILTIN_CONFIGS, ConfigError, OSDConfig, load_config, resolve_dtype

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_loads(path):
    data = yaml.safe_load(path.read_text())
    if "applications" in data:  # a Ray Serve config: its app args name an osd config
        for app in data["applications"]:
            module, _, attr = app["import_path"].partition(":")
            assert attr and (CONFIGS.parent / (module.replace(".", "/") + ".py")).exists()
            named = app["args"]["config"]  # a path in the checkout, or a built-in config
            path = named if named in BUILTIN_CONFIGS else CONFIGS.parent / named
            load_config(path, app["args"]["overrides"])
    else:
        assert isinstance(load_config(path), OSDConfig)


def test_overrides_are_typed_and_applied():
    config = load_config(
        None,
        [
            "serve.port=9001",
            "spec.method=spectr",
            "model.adapters=[general, code]",
            "trainer.learning_rate=1e-4",
        ],
    )
    assert config.serve.port == 9001 and config.spec.method == "spectr"
    assert config.model.adapters == ("general", "code")
    assert config.trainer.learning_rate == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("serve.nope=1", "unknown key"),
        ("nope.port=1", "unknown key"),
        ("serve.port=abc", "serve.port must be int"),
        ("spec.method=beam", "spec.method must be one of"),
        ("spec.num_spec_tokens=0", 'spec.num_spec_tokens must be "auto" or in 1..64'),
        ("spec.num_spec_tokens=65", 'spec.num_spec_tokens must be "auto" or in 1..64'),
        ("spec.num_drafts=65", "spec.num_drafts must be in 1..64"),
        ("spec.proposer=eagle", "spec.proposer must be one of"),
        ("spec.suffix_budget_tokens=-1", "spec.suffix_budget_tokens must be >= 0"),
        ("spec.suffix_scope=tenant", "spec.suffix_scope must be"),
        ("spec.max_lookup_tokens=0", "spec.max_lookup_tokens must be in 1..64"),
        ("spec.num_spec_tokens=many", "spec.num_spec_tokens must be int or one of"),
        ("serve.gpu_memory_utilization=1.5", "serve.gpu_memory_utilization must be in"),
        ("serve.kv_cache_memory_bytes=-1", "serve.kv_cache_memory_bytes must be >= 0"),
        ("model.merged_drafts=-1", "model.merged_drafts must be >= 0"),
        ("serve.port", "a.b=value"),
    ],
)
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_environment_variables_expand_in_files(tmp_path, monkeypatch):
    monkeypatch.setenv("OSD_TEST_PASSWORD", "s3cret")
    path = tmp_path / "c.yaml"
    path.write_text("log:\n  redis_url: redis://:${OSD_TEST_PASSWORD}@host:6379/0\n")
    assert load_config(path).log.redis_url == "redis://:s3cret@host:6379/0"


def test_compiling_is_on_by_default_unless_the_environment_or_the_config_says_off(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("OSD_MODEL_COMPILE", raising=False)  # the suite sets it off
    assert load_config().model.compile is True
    monkeypatch.setenv("OSD_MODEL_COMPILE", "0")
    assert load_config().model.compile is False
    assert load_config(overrides=["model.compile=true"]).model.compile is True
    monkeypatch.setenv("OSD_MODEL_COMPILE", "Off")
    assert OSDConfig().model.compile is False
    file = tmp_path / "c.yaml"
    file.write_text("model:\n  compile: true\n")
    assert load_config(file).model.compile is True  # a config's own value wins
    monkeypatch.setenv("OSD_MODEL_COMPILE", "maybe")
    with pytest.raises(ConfigError, match="OSD_MODEL_COMPILE='maybe'"):
        load_config()


def test_auto_dtype_follows_the_device():
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cuda") == "float16"
