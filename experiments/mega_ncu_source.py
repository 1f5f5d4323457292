# History: the megakernel left the product. This script imports its code (metainfer.kernels.mega), whose last
# commit is b4eb65f: run it from that tree (git worktree add /tmp/mega b4eb65f). Kept as the record of
# KB-0075..0091.
# ruff: noqa: I001  (metainfer.kernels.mega is not in this tree: isort would take it for a third-party module)
"""Where the megakernel's warps stall, per op: ncu's per-instruction source counters mapped to mega.cu's ops.

An ncu run of one step (`ncu --page source --csv --print-source sass`; the `megasrc` phase in the git
history of benchmarks/gpu_pending.sh) writes `mega_source.csv`. This script rebuilds the same cubin here
with -lineinfo (the code is identical: the flag adds only debug sections), reads each SASS address's
source line from nvdisasm, and sums the warp-stall samples and executed instructions by the kernel's call
site of each op (mega.cu's switch), with the stall reasons of each. Run it on the commit that made the CSV.

  python experiments/mega_ncu_source.py mega_source.csv [-D...] [--cubin a -lineinfo build of those sources]
      [--lines 30 [--op gemv]]   (also the source lines, inlining undone, with the most samples)
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metainfer.kernels.mega import launch  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
OPS = ("op_gemv", "op_gate_up", "op_down", "op_delta", "op_attend", "op_combine", "producer")


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import triton  # its NVIDIA backend ships one

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def op_lines() -> dict[int, str]:
    """mega.cu's line -> the op called there (the consumers' switch, the producer's call)."""
    out = {}
    for n, line in enumerate((launch.HERE / "mega.cu").read_text().splitlines(), 1):
        for op in OPS:
            if re.search(rf"\b{op}\(", line) and "__device__" not in line:
                out[n] = op.removeprefix("op_")
    return out


def address_owners(defines: tuple[str, ...], tmp: Path, cubin: Path | None = None
                   ) -> tuple[dict[int, str], dict[int, str], dict[int, str]]:
    """mega_step's SASS offset -> the op whose call site in mega.cu the line info names (or file:line),
    -> the instruction's opcode (to check the build against the profiled one), and -> its innermost
    source line (file:line: the first of the line-info comments before it)."""
    if cubin is None:
        cubin = tmp / "mega_lineinfo.cubin"
        cmd = launch.nvcc_command(cubin, defines=defines)
        subprocess.run([*cmd[:1], "-lineinfo", *cmd[1:]], check=True, capture_output=True, timeout=600)
    sass = subprocess.run([nvdisasm(), "-gi", str(cubin)], check=True, capture_output=True, text=True).stdout
    ops, owners, opcodes, inner = op_lines(), {}, {}, {}
    cur, here, inside, in_block = "?", "?", False, False
    for line in sass.splitlines():
        if line.startswith(".text."):
            inside = line.startswith(".text.mega_step:")
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?', line)
        if inside and m:
            f, n = (m.group(3), m.group(4)) if m.group(3) else (m.group(1), m.group(2))
            name = Path(f).name
            cur = ops.get(int(n), f"mega.cu:{n}") if name == "mega.cu" else f"{name}:{n}"
            if not in_block:  # (the first comment of a run names the innermost line)
                here = f"{Path(m.group(1)).name}:{m.group(2)}"
            in_block = True
            continue
        in_block = False
        a = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(\S+)", line)
        if inside and a:
            owners[int(a.group(1), 16)] = cur
            opcodes[int(a.group(1), 16)] = a.group(2)
            inner[int(a.group(1), 16)] = here
    return owners, opcodes, inner


def source_text(where: str) -> str:
    """The source line `file:line` names (a header of this tree, or a CUDA header's line number alone)."""
    name, _, n = where.rpartition(":")
    path = launch.HERE / name
    if not path.is_file():
        return ""
    lines = path.read_text().splitlines()
    return lines[int(n) - 1].strip()[:80] if 0 < int(n) <= len(lines) else ""


def top_reasons(c: collections.Counter, reasons: list[str], k: int) -> str:
    """The k stall reasons with the most of c's samples, each as its share of them."""
    return ", ".join(f"{h[6:]} {c[h] / max(c[SAMPLES], 1) * 100:.0f}%"
                     for h in sorted(reasons, key=lambda h: -c[h])[:k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output of one mega_step")
    ap.add_argument("defines", nargs="*", help="the build's -D flags, as MegaKernel(defines=...) had them")
    ap.add_argument("--cubin", type=Path, default=None,
                    help="a -lineinfo build of the profiled sources made earlier (default: build the tree's)")
    ap.add_argument("--lines", type=int, default=0,
                    help="also the N source lines (innermost, inlining undone) with the most samples")
    ap.add_argument("--op", default=None,
                    help="with --lines: only the addresses of this op (gemv, gate_up, ...)")
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    head = rows.index(next(r for r in rows if r and r[0] == "Address"))
    hdr, data = rows[head], rows[head + 1 :]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    owners, opcodes, inner = address_owners(tuple(args.defines), Path("/tmp"), args.cubin)
    base = int(data[0][0], 16)
    same = sum(opcodes.get(int(r[0], 16) - base) == (r[1].split() or ["?"])[0] for r in data)
    if same < 0.99 * len(data):
        raise SystemExit(f"this build is not the profiled one: {same} of {len(data)} opcodes agree "
                         "(check out the commit, and pass its -D flags)")
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_line: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total: collections.Counter = collections.Counter()
    for r in data:
        op = owners.get(int(r[0], 16) - base, "?")
        for h in (*reasons, SAMPLES, EXECUTED):
            v = float(r[ix[h]] or 0)
            by_op[op][h] += v
            total[h] += v
            if args.op is None or op == args.op:
                by_line[inner.get(int(r[0], 16) - base, "?")][h] += v
    print(f"{total[SAMPLES]:.0f} warp-stall samples, {total[EXECUTED]:.0f} warp instructions executed")
    print("stall reasons: " + ", ".join(f"{h[6:]} {total[h] / total[SAMPLES] * 100:.1f}%"
                                         for h in sorted(reasons, key=lambda h: -total[h])
                                         if total[h] > 0.005 * total[SAMPLES]))
    print("| where | samples % | instructions % | top stall reasons |")
    print("|---|---|---|---|")
    for op, c in sorted(by_op.items(), key=lambda kv: -kv[1][SAMPLES])[:16]:
        top = top_reasons(c, reasons, 4)
        print(f"| {op} | {c[SAMPLES] / total[SAMPLES] * 100:.1f} | {c[EXECUTED] / total[EXECUTED] * 100:.1f} "
              f"| {top} |")
    if args.lines:
        scope = sum(c[SAMPLES] for c in by_line.values())
        print(f"\n{args.op or 'all ops'}: {scope:.0f} samples, by source line (% of these samples)")
        print("| line | samples % | top stall reasons | source |")
        print("|---|---|---|---|")
        for where, c in sorted(by_line.items(), key=lambda kv: -kv[1][SAMPLES])[: args.lines]:
            top = top_reasons(c, reasons, 3)
            print(f"| {where} | {c[SAMPLES] / max(scope, 1) * 100:.1f} | {top} | `{source_text(where)}` |")


if __name__ == "__main__":
    main()
