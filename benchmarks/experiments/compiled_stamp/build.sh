#!/usr/bin/env bash
# Builds stamp312.c for the python3 on PATH (CPython 3.12 only: it reads 3.12's frames).
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
"$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else "needs CPython 3.12")'
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -O2 -shared -fPIC -I"$inc" -I"$inc/internal" stamp312.c -o "stamp312$suffix"
echo "built stamp312$suffix"
