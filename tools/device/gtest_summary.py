#!/usr/bin/env python3
"""Summarises gtest results from the JSON a test binary writes with --gtest_output=json:FILE.

    python3 tools/device/gtest_summary.py FILE [FILE ...]

For each file prints one line of counts (passed, failed, skipped, disabled) and then every failed
test by name with the first lines of its failure message. Exits 1 when any test failed, when a
file is missing or unreadable (gtest writes it only at the end of the run, so a crash or a
timeout leaves none) or when a file records no test at all (a filter that matched nothing);
exits 0 otherwise. Standard library only: it runs on the GPU machine's own python3.
"""
import json
import sys

MESSAGE_LINES = 6  # of each failure message


def summarise(path):
    """Returns (ok, lines to print) for one gtest JSON file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return False, [f"{path}: no result file (the run crashed, timed out or never started; see its log)"]
    except (OSError, ValueError) as e:
        return False, [f"{path}: unreadable gtest JSON: {e}"]
    if not isinstance(doc, dict) or not isinstance(doc.get("testsuites"), list):
        return False, [f"{path}: not a gtest JSON report (no 'testsuites' list)"]

    passed, skipped, disabled, failed = 0, 0, 0, []
    for suite in doc["testsuites"]:
        for test in suite.get("testsuite", []):
            name = f"{suite.get('name', '?')}.{test.get('name', '?')}"
            failures = test.get("failures") or []
            if test.get("status") == "NOTRUN":
                disabled += 1
            elif failures:
                failed.append((name, failures))
            elif test.get("result") == "SKIPPED":
                skipped += 1
            else:
                passed += 1
    total = passed + skipped + disabled + len(failed)
    lines = [f"{path}: {passed} passed, {len(failed)} failed, {skipped} skipped, {disabled} disabled "
             f"({total} tests, {doc.get('time', '?')})"]
    for name, failures in failed:
        lines.append(f"  FAILED {name}")
        for failure in failures:
            message = str(failure.get("failure", "")).strip().splitlines()
            lines.extend(f"      {m}" for m in message[:MESSAGE_LINES])
            if len(message) > MESSAGE_LINES:
                lines.append(f"      ... ({len(message) - MESSAGE_LINES} more lines in the log)")
    if total == 0:
        lines.append(f"{path}: no test ran (does the --gtest_filter match any test?)")
        return False, lines
    return not failed, lines


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    ok = True
    for path in argv[1:]:
        file_ok, lines = summarise(path)
        print("\n".join(lines))
        ok = ok and file_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
