#!/bin/sh
# Print the path of a working Python interpreter of the version given (e.g. 3.12), or fail.
# Looks on PATH first, then in pyenv's versions (this machine image ships several there).
set -u
want="$1"
for cand in "python$want" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want"*/bin/python"$want" \
            /usr/local/bin/python"$want" /usr/bin/python"$want"; do
    path=$(command -v "$cand" 2>/dev/null) || continue
    if "$path" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
        echo "$path"
        exit 0
    fi
done
echo "find-python: no working python$want found" >&2
exit 1
