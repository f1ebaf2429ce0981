#!/usr/bin/env bash
# DeepSpeed's async_io op (NVMe offload) needs libaio headers. Install them when we can (root with
# apt-get); otherwise NVMe tests skip and say why. Never fails the build.
set -u
if [ -e /usr/include/libaio.h ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q libaio-dev >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libaio-dev >/dev/null 2>&1)) \
   && echo "installed libaio-dev (DeepSpeed NVMe offload)" \
   || echo "note: could not install libaio-dev; NVMe offload tests will skip"
else
  echo "note: libaio-dev missing and no root apt-get; NVMe offload tests will skip"
fi
exit 0
