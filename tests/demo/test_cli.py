"""``osd demo-models`` build, path, workload and report on the tiny recipe."""

from __future__ import annotations

import json

from launcher.cli import main as osd_main
from osd.demo import load_workload
from osd.demo.cli import main


def test_build_prints_the_cached_directory(tiny_paths, tiny_cache, capsys):
    argv = ["build", "--scale", "tiny", "--cache-dir", str(tiny_cache), "--quiet", "--threads", "1"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(tiny_paths.root)


def test_path_exits_zero_when_built_and_one_when_not(tiny_paths, tiny_cache, tmp_path, capsys):
    assert osd_main(["demo-models", "path", "--scale", "tiny", "--cache-dir", str(tiny_cache)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_paths.root)
    assert main(["path", "--scale", "tiny", "--cache-dir", str(tmp_path)]) == 1
    assert "not built yet" in capsys.readouterr().err


def test_workload_writes_a_loadable_schedule(tiny_cache, tmp_path):
    out = tmp_path / "w.jsonl"
    argv = ["workload", "--scale", "tiny", "--cache-dir", str(tiny_cache), "--out", str(out)]
    assert main([*argv, "--schedule", "sql:3,json:2,mixed:5", "--max-tokens", "12"]) == 0
    items = load_workload(out)
    assert [i.domain for i in items[:5]] == ["sql"] * 3 + ["json"] * 2
    assert len(items) == 10 and all(i.max_tokens == 12 for i in items)
    assert main([*argv, "--schedule", "chat:4,sql:6", "--chat-share", "1"]) == 0
    items = load_workload(out)
    assert all(i.is_chat and i.messages[-1]["role"] == "user" for i in items)
    assert [i.domain for i in items[4:]] == ["sql"] * 6 and all(i.phase for i in items)


def test_workload_with_bad_schedule_exits_two(tiny_cache, tmp_path, capsys):
    argv = ["workload", "--scale", "tiny", "--cache-dir", str(tiny_cache), "--out", "x.jsonl"]
    assert main([*argv, "--schedule", "sql:many"]) == 2
    assert "domain:count" in capsys.readouterr().err


def test_report_measures_once_then_reads_the_saved_numbers(copy_cache, capsys):
    cache = copy_cache()
    argv = ["report", "--scale", "tiny", "--cache-dir", str(cache), "--prompts", "2"]
    assert main([*argv, "--max-tokens", "6"]) == 0
    text = capsys.readouterr().out
    assert "ppl target" in text and "sql" in text and "ratio" in text
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["domains"]) == {"prose", "code", "sql", "math", "json", "chat"}
    assert 0 <= report["domains"]["sql"]["acceptance_t0"] <= 1
    assert report["settings"]["max_tokens"] == 6  # read back, not measured again


def test_report_on_an_unbuilt_cache_exits_one(tmp_path, capsys):
    assert main(["report", "--scale", "tiny", "--cache-dir", str(tmp_path)]) == 1
    assert "not built" in capsys.readouterr().err
