#!/usr/bin/env bash
# Bazel's workspace status command (.bazelrc): the commit the wheel's version names (tools/wheel).
echo "STABLE_GIT_COMMIT $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
