"""tools/device/gtest_summary.py, the reader of the GPU machine's gtest JSON reports.

Run on a saved report of every outcome (tests/fixtures/gtest/sample.json) and on a report the CPU
unit test binary writes here (build/tansy_unit_tests, or $TANSY_UNIT_TESTS; skipped when absent)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "device" / "gtest_summary.py"
SAMPLE = REPO / "tests" / "fixtures" / "gtest" / "sample.json"
UNIT = Path(os.environ.get("TANSY_UNIT_TESTS", REPO / "build" / "tansy_unit_tests"))


def summary(*paths):
    return subprocess.run([sys.executable, str(TOOL), *map(str, paths)], capture_output=True, text=True,
                          timeout=60)


def test_counts_and_failed_names_from_every_outcome():
    r = summary(SAMPLE)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{SAMPLE}: 2 passed, 2 failed, 1 skipped, 1 disabled (6 tests, 0s)"
    failed = [line.strip() for line in lines if line.strip().startswith("FAILED ")]
    assert failed == ["FAILED Sample.Fails", "FAILED Other.FailsTwice"]
    # The failure messages follow their test: location first, then the assertion's text.
    assert "sample_test.cpp:8" in r.stdout
    assert "first" in r.stdout and "second" in r.stdout
    assert "more lines in the log" in r.stdout  # the long message is cut, the log keeps it all


def test_all_passing_report_exits_zero(tmp_path):
    doc = json.loads(SAMPLE.read_text())
    for suite in doc["testsuites"]:
        suite["testsuite"] = [t for t in suite["testsuite"] if not t.get("failures")]
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(doc))
    r = summary(path)
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith(f"{path}: 2 passed, 0 failed, 1 skipped, 1 disabled (4 tests")


def test_missing_unreadable_and_empty_reports_fail(tmp_path):
    missing = tmp_path / "missing.json"
    r = summary(missing)
    assert r.returncode == 1 and "no result file" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"testsuites": [')  # a run killed while writing
    r = summary(bad)
    assert r.returncode == 1 and "unreadable gtest JSON" in r.stdout
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"tests": 0, "testsuites": []}))  # a --gtest_filter that matched nothing
    r = summary(empty)
    assert r.returncode == 1 and "no test ran" in r.stdout


def test_one_failing_file_among_several_fails_the_whole(tmp_path):
    doc = json.loads(SAMPLE.read_text())
    doc["testsuites"] = [s for s in doc["testsuites"] if s["name"] == "Other"]
    doc["testsuites"][0]["testsuite"] = [t for t in doc["testsuites"][0]["testsuite"] if not t.get("failures")]
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(doc))
    assert summary(ok).returncode == 0
    r = summary(ok, SAMPLE)
    assert r.returncode == 1
    assert r.stdout.splitlines()[0].startswith(f"{ok}: 1 passed, 0 failed")


@pytest.mark.skipif(not UNIT.exists(), reason=f"{UNIT} not built")
def test_report_of_the_unit_test_binary(tmp_path):
    out = tmp_path / "unit.json"
    run = subprocess.run([str(UNIT), "--gtest_filter=BenchWorkload.*:Safetensors*", f"--gtest_output=json:{out}"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TANSY_SOURCE_DIR": str(REPO)})
    assert run.returncode == 0, run.stdout[-2000:]
    doc = json.loads(out.read_text())
    assert doc["tests"] > 2 and doc["failures"] == 0
    r = summary(out)
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines()[0].startswith(f"{out}: {doc['tests']} passed, 0 failed, 0 skipped")
