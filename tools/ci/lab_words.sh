#!/usr/bin/env bash
# Fails when the repository speaks of how it was made instead of the product: words of a lab notebook in the
# tracked files under README.md, CONTRIBUTING.md, docs/, kda/, tools/ and .ci/ (case-insensitive, whole words).
# Measurements are described by date, GPU and command (CONTRIBUTING.md, "Words"). Prints file:line:text for
# every hit and exits 1; exits 0 when there is none. The pattern below is spelled in pieces, so that this script
# does not match itself.
#
#   tools/ci/lab_words.sh            (from anywhere inside the repository)
set -euo pipefail
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.."

words=("sess""ion" "sess""ions" "lea""se" "lea""ses" "this work""place" "the te""am" "device ca""ll" "ca""ll [0-9]{2,}")
pattern="\\b($(IFS='|'; echo "${words[*]}"))\\b|\\.\\./sha""red"

if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- README.md CONTRIBUTING.md docs kda tools .ci)
else
  mapfile -t files < <(find README.md CONTRIBUTING.md docs kda tools .ci -type f 2> /dev/null)
fi

hits=""
if (( ${#files[@]} )); then
  # -I: binary files (charts) are skipped; grep exits 1 when nothing matches.
  hits=$(grep -nIiE -- "${pattern}" "${files[@]}" || true)
fi
if [[ -n "${hits}" ]]; then
  echo "${hits}"
  echo "lab_words: $(wc -l <<< "${hits}") line(s) above speak of the lab, not the product; reword them" >&2
  exit 1
fi
echo "lab_words: ${#files[@]} files clean"
