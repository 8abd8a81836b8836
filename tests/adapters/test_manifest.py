"""The adapter manifest: JSON round trip and validation that names the bad value."""

from __future__ import annotations

import json

import pytest

from osd.adapters.manifest import AdapterManifest, AdapterSpec

_SPEC = AdapterSpec(
    base_model_id="org/draft-160m",
    base_model_hash="ab" * 32,
    rank=8,
    lora_alpha=16,
    target_modules=["v_proj", "q_proj"],
)


def _manifest(**overrides) -> AdapterManifest:
    fields = {
        "name": "code",
        "version": 3,
        "spec": _SPEC,
        "weights_sha256": "cd" * 32,
        "num_weight_bytes": 1234,
        "created_at": 1.7e9,
        "acceptance_estimate": 0.71,
        "parent_version": 2,
    } | overrides
    return AdapterManifest.create(**fields)


def test_manifest_round_trips_through_json():
    manifest = _manifest()
    assert AdapterManifest.from_json(manifest.to_json()) == manifest
    assert manifest.target_modules == ("q_proj", "v_proj")
    assert manifest.spec == _SPEC
    assert json.loads(manifest.to_json())["target_modules"] == ["q_proj", "v_proj"]


def test_regex_target_modules_are_kept_as_a_string():
    manifest = _manifest(spec=AdapterSpec("m", "ab" * 32, 4, 8, r".*\.(q|v)_proj"))
    assert AdapterManifest.from_json(manifest.to_json()).target_modules == r".*\.(q|v)_proj"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"version": 0}, "version must be an int >= 1, got 0"),
        ({"weights_sha256": "XYZ"}, "weights_sha256 must be 64 lowercase hex digits, got 'XYZ'"),
        ({"acceptance_estimate": 1.5}, "acceptance_estimate must be finite and in"),
        ({"parent_version": -1}, "parent_version must be an int >= 1, got -1"),
        ({"rank": 0}, "rank must be an int >= 1, got 0"),
        ({"target_modules": []}, "target_modules must be module names or a regex"),
        ({"name": "a:b"}, "adapter name must be"),
        ({"format_version": 2}, "format_version 2 is not supported"),
        ({"base_model_hash": "00"}, "base_model_hash must be 64"),
    ],
)
def test_bad_fields_are_refused_naming_the_value(change, match):
    data = json.loads(_manifest().to_json()) | change
    with pytest.raises(ValueError, match=match):
        AdapterManifest.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\x80\x04not json", "not JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({"name": "code"}).encode(), "lacks keys"),
    ],
)
def test_malformed_manifests_are_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        AdapterManifest.from_json(raw)


def test_unknown_keys_are_refused():
    data = json.loads(_manifest().to_json()) | {"pickle_path": "x.pt"}
    with pytest.raises(ValueError, match="unknown keys \\['pickle_path'\\]"):
        AdapterManifest.from_json(json.dumps(data))
