#!/bin/sh
# The dashboard's browser tests (tests/serving/test_dashboard_browser.py) drive Debian's chromium
# through Playwright; no browser is downloaded. Installs it when missing, if this user can.
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }
    exit $?
fi
echo "install_chromium.sh: chromium is missing and cannot be installed here (needs root and apt-get)." >&2
echo "  The browser tests will fail until it is: apt-get install chromium (or set CHROMIUM=/path/to/chromium)." >&2
