#!/usr/bin/env bash
# Packs the carried wheels (.whl-ray/, .whl/) for scripts/gpu_demo.sh as the unpacked files of all
# of them in one xz tarball, .site/site.tar.xz: xz on the unpacked binaries is what brings Ray and
# NIXL together under the 64 MiB a device call carries. File modes come from the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp" .whl-ray/*.whl .whl/*.whl <<'PY'
import os, sys, zipfile
dest = sys.argv[1]
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)
PY
mkdir -p .site
tar -C "$tmp" -cf - . | xz -9 -T0 > .site/site.tar.xz
du -h .site/site.tar.xz
