"""pytest entry point for Bazel py_test targets (see defs.bzl).

    runner.py <test file>... [pytest args...]

Bazel integration:
  * sharding: TEST_TOTAL_SHARDS / TEST_SHARD_INDEX pick a deterministic round-robin share of the collected test
    ids (after -k / marker filtering; see kda_plugin.py); TEST_SHARD_STATUS_FILE is touched; an empty shard or
    an empty collection (pytest exit 5) counts as success;
  * XML_OUTPUT_FILE receives the junit XML; TESTBRIDGE_TEST_ONLY (`bazel test --test_filter=EXPR`) becomes
    `-k EXPR`; extra args (`--test_arg=-x`) are passed through to pytest;
  * runfiles are read only: no cache provider, no .pyc files; site-packages plugins are not auto-loaded
    (PYTEST_DISABLE_PLUGIN_AUTOLOAD=1); rootdir is the workspace root of the runfiles tree, so conftest.py files
    next to the test files (e.g. kda/tests/conftest.py) are picked up.
"""

import os
import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # Bazel runs one test process per core; a torch in each using every core oversubscribes the machine many
    # times over (seen on the 16-core H200 machine: CPU-path tests slowed ~20x and timed out; two 2-thread shards on
    # a 2-core machine still ran 10x slower than one at a time). One intra-op thread per test process unless the
    # caller says otherwise.
    threads = os.environ.get("KDA_TEST_THREADS", "1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)

    status_file = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status_file:
        # Tells Bazel this runner understands sharding (a sharded test that does not touch it fails).
        with open(status_file, "a"):
            pass

    # Our plugin lives next to this file.
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)

    import pytest  # after the environment is set up

    args = [
        "-p", "no:cacheprovider",
        "-p", "kda_plugin",
        "--rootdir", os.getcwd(),
        "-o", "console_output_style=classic",
        "-ra",
    ]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args += ["--junitxml", xml, "-o", "junit_suite_name=" + os.environ.get("TEST_TARGET", "pytest")]
        # xunit1: the family in which record_property (the matrix's measured errors) reaches the XML.
        args += ["-o", "junit_family=xunit1"]
    test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
    if test_filter:
        args += ["-k", test_filter]
    args += argv

    print("tools/pytest/runner.py: pytest " + " ".join(args), flush=True)
    code = pytest.main(args)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("tools/pytest/runner.py: no tests in this shard / selection -- counted as success", flush=True)
        code = 0
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
