"""Sums the junit XMLs of a Bazel test run into one line: "N passed, N failed, N skipped".

    python tools/pytest/junit_summary.py "$(bazel info bazel-testlogs)"

Exit status 1 when a test.xml cannot be parsed (counted as a failure) or when any test failed.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET


def summarize(testlogs: str) -> tuple[int, int, int]:
    passed = failed = skipped = 0
    for dirpath, _, files in os.walk(testlogs, followlinks=True):
        if "test.xml" not in files:
            continue
        try:
            root = ET.parse(os.path.join(dirpath, "test.xml")).getroot()
        except ET.ParseError:
            failed += 1
            continue
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            tests = int(suite.get("tests", 0))
            bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skip = int(suite.get("skipped", 0))
            passed += tests - bad - skip
            failed += bad
            skipped += skip
    return passed, failed, skipped


def main(argv: list[str]) -> int:
    passed, failed, skipped = summarize(argv[1] if len(argv) > 1 else "bazel-testlogs")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
