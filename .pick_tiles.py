"""Reads gemv_bench output; prints RLT_GEMV_TILES entries for the best qkv / down tiles where they beat the default."""
import re, sys
dims = {"ouro qkv": "6144x2048", "ouro down": "2048x5632", "ouro o": "2048x2048"}
out = {}
for line in open(sys.argv[1]):
    m = re.match(r"(ouro \w+)\s+1\s+([\d.]+)\s+\d+\s+([\d.]+)\s+\d+\s+[\d.]+\s+([\d.]+)\s+\d+\s+[\d.]+\s+\((.*)\)", line)
    if not m or m.group(1) not in dims:
        continue
    name, default_us, best_us, tile = m.group(1), float(m.group(3)), float(m.group(4)), m.group(5)
    t = [int(v) for v in tile.split(",")]
    if name == "ouro qkv" and t[3] != 0 and t[0] < 32:
        continue  # the epilogue needs 16 pairs a tile
    if best_us < default_us * 0.97:
        out[name] = f"{dims[name]}=" + ",".join(map(str, t))
print(" ".join(f'"RLT_GEMV_TILES={v}"' for v in out.values()), end=" ")
if len(out) > 1:
    print('"RLT_GEMV_TILES=' + ";".join(out.values()) + '"')
