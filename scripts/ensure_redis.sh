#!/usr/bin/env bash
# Make sure redis-server and redis-cli are installed (Debian package). The tests start their
# own private servers on free ports; nothing is left running here.
set -euo pipefail
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
  exit 0
fi
echo "installing redis-server (Debian package)..." >&2
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
# The package may start a system service; the tests do not use it.
command -v redis-server >/dev/null
