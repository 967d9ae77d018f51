#!/usr/bin/env python3
"""Instruction counts of a kernel's loops from `cuobjdump -sass` output (no GPU needed).

    cargo run --release -p lily-cuda --example cubins -- /tmp/cubin sm_90a decode
    cuobjdump -sass /tmp/cubin/decode-bf16.cubin > /tmp/dec.sass
    python3 scripts/sass_loops.py /tmp/dec.sass dec_glu4_rows [MIN [MAX]]

Prints the kernel's instruction count, then every loop (a backward branch and the code it jumps
back over) of MIN (default 50) to MAX (default 2000) instructions: its lines, its length and its
opcodes by count. The counts are static: an inner loop inside a listed loop runs its trips, and
predicated or branched-over code counts whether it runs or not. (Past MAX are mostly the
compiler's retry branches around warp-collective code, which jump back over most of a kernel.)
"""
import collections
import re
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    text = open(sys.argv[1]).read()
    kernel = sys.argv[2]
    least = int(sys.argv[3]) if len(sys.argv) > 3 else 50
    most = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
    m = re.search(r'Function : ' + re.escape(kernel) + r'\n(.*?)(?=\n\s*Function : |\Z)', text, re.S)
    if not m:
        sys.exit(f'sass_loops.py: no function {kernel} in {sys.argv[1]}')
    code = []  # (address, instruction)
    for line in m.group(1).splitlines():
        mm = re.match(r'\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;', line)
        if mm:
            code.append((int(mm.group(1), 16), mm.group(2)))
    at = {a: i for i, (a, _) in enumerate(code)}
    print(f'{kernel}: {len(code)} instructions')
    for i, (a, ins) in enumerate(code):
        b = re.search(r'BRA (0x[0-9a-f]+)', ins)
        if not b or int(b.group(1), 16) >= a or int(b.group(1), 16) not in at:
            continue
        start = at[int(b.group(1), 16)]
        if not least <= i - start + 1 <= most:
            continue
        ops = collections.Counter(
            re.sub(r'^@!?U?P\w+\s+', '', op).split()[0].split('.')[0] for _, op in code[start:i + 1])
        print(f'  loop {start}-{i} ({i - start + 1}):', ' '.join(f'{o} {n}' for o, n in ops.most_common(16)))


if __name__ == '__main__':
    main()
