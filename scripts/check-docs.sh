#!/usr/bin/env bash
# The documents' promises a newcomer relies on: README.md stays a guide (at most 250 lines),
# nothing in the repository refers to a file outside it, and every "DESIGN §N" (or §N.M) cited
# anywhere names a section that exists in docs/DESIGN.md. Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0

lines=$(wc -l <README.md)
if [ "$lines" -gt 250 ]; then echo "check-docs: README.md has $lines lines (at most 250)"; fail=1; fi

files=$(git ls-files | grep -v '^scripts/check-docs.sh$')
if outside=$(echo "$files" | xargs grep -nE '\.\./shared/|/work/shared|shared/DESIGN' 2>/dev/null); then
  echo "check-docs: references outside the repository:"; echo "$outside"; fail=1
fi

sections=$(grep -oE '^#{2,3} [0-9]+(\.[0-9]+)?\.? ' docs/DESIGN.md | grep -oE '[0-9]+(\.[0-9]+)?' | sort -u)
cited=$(echo "$files" | xargs grep -ohE 'DESIGN(\.md)?[^A-Za-z0-9]{0,3}§ ?[0-9]+(\.[0-9]+)?' 2>/dev/null \
  | grep -oE '[0-9]+(\.[0-9]+)?$' | sort -u)
for n in $cited; do
  if ! grep -qx "$n" <<<"$sections"; then echo "check-docs: DESIGN §$n is cited but docs/DESIGN.md has no such section"; fail=1; fi
done

[ "$fail" = 0 ] && echo "check-docs: README $lines lines; $(wc -w <<<"$cited") DESIGN sections cited, all present"
exit "$fail"
