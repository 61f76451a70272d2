"""Copy a wheel without some of its top-level packages (RECORD rewritten to match).

    python recipes/slim_wheel.py IN.whl OUT_DIR --drop nixl_ep_cu13

The nixl-cu13 wheel carries `nixl_ep_cu13` (expert-parallel kernels, three ~30 MB builds, one per
torch minor) that rlt-serve never imports; without it the wheel fits the device machine's carry
limit together with the server's other wheels (recipes/pd_h200.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile


def slim(src: str, out_dir: str, drop: list[str]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, os.path.basename(src))
    prefixes = tuple(p.rstrip("/") + "/" for p in drop)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(prefixes):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(prefixes)).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return dst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheel")
    p.add_argument("out_dir")
    p.add_argument("--drop", action="append", required=True, help="a top-level package to leave out")
    args = p.parse_args()
    if os.path.abspath(os.path.dirname(args.wheel)) == os.path.abspath(args.out_dir):
        print("slim_wheel: OUT_DIR must differ from the input wheel's directory", file=sys.stderr)
        return 2
    dst = slim(args.wheel, args.out_dir, args.drop)
    print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
