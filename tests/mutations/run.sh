#!/bin/sh
# Plant known bugs one at a time in a scratch copy and run the tests meant to catch them: run.sh N [N ...] | all
here=$(dirname "$0")
python=${PYTHON:-$(cd "$here/../.." && pwd)/.venv/bin/python}
[ -x "$python" ] || python=python3
exec "$python" "$here/run.py" "$@"
