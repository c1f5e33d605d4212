#!/usr/bin/env python3
"""The built kernels keep their software prefetches.

The decode walk and the flash tasks prefetch K and V rows toward L2 (docs/kernels.md, "Software
prefetch"); they are worth 1.1-1.6x on decoding, and nothing else notices when they go: the
results stay the same bits. GCC 12 once deleted every prefetch of bf16dot::narrow_scores (a
helper made only of _mm_prefetch calls taken for an unused const call; decode ran 0.55x), so
this disassembles the binary (objdump, from binutils) and counts the prefetch instructions of
each function that must have them.

    check_prefetches.py BINARY      exit 0: all there; 1: some function has too few (listed)
"""

import re
import subprocess
import sys
from collections import Counter

# (pattern over the demangled function names, at least this many prefetch instructions, in at
# least this many of the functions that match; optionally only one mnemonic counted). Minimums
# are at or below today's counts (GCC 12 -O2: 5, 2, 7-11, 6-10, 2, 1, 1): a site may be merged
# or unrolled, none may vanish.
REQUIRED = [
    (r"^qkv::bf16dot::narrow_scores\(", 3, 1),  # K ahead and V rows (prefetch_line)
    (r"^qkv::bf16dot::narrow_values\(", 2, 1),  # the next tile's K (PrefetchSpan, 4 and 1 rows)
    # The f32 / widened decode walk on each x86 target: K and V rows WalkAhead keys on.
    (r"^qkv::N_AVX(2|3)::tiles::NarrowScoresWide<float>\(.*lambda", 1, 2),
    # The f32 value walk's V rows, on each x86 target, in whichever of its functions GCC kept
    # apart: NarrowValueKeys (until 2026-12-06 always), the chunk loop it is inlined into
    # (release builds since the row groups became one ForEachRowGroup), or the row groups'
    # lambdas (the ASan build).
    *[(rf"^[a-z ]*qkv::N_{t}::tiles::(NarrowValue(Keys|Columns|Rows)<[^<>]*\bfloat>|"
       rf"ForEachChunk<qkv::N_{t}::tiles::NarrowValuesWide<float>)", 1, 1)
      for t in ("AVX2", "AVX3")],
    # V's next rows, asked for while a tile of V is transposed for the wide blocks of a decode
    # step (StageColumns with Staging::read_ahead, which only AVX2 sets), in StageColumns, the
    # TransposeRows<T, true> it calls (kept apart in the ASan build) or the Values it is
    # inlined into.
    (r"^[a-z ]*qkv::N_AVX2::tiles::(TileRows qkv::N_AVX2::tiles::StageColumns<|"
     r"TransposeRows<[^<>]*, true>\(|WideProducts<[^<>]*>::Values\()", 1, 1),
    # A flash task (one of Flash's lambdas): the next tile's K and V rows (PrefetchRows), on each
    # x86 target.
    (r"^qkv::N_AVX(2|3)::Flash<qkv::N_AVX(2|3)::tiles::WideProducts<float> >.*lambda", 2, 2),
    # The backward's dk and dv rows, which a widened task asks for toward L2 when it starts
    # (PrefetchGradientRows), on each x86 target; and the next rows StoreTransposed asks for
    # toward L1 while it stores dk and dv.
    (r"^[a-z ]*qkv::N_AVX(2|3)::\(anonymous namespace\)::(BackwardTask<[^<>]*WideBackward<float> >|"
     r"PrefetchGradientRows)", 2, 2, "prefetcht1"),
    (r"^qkv::N_AVX(2|3)::\(anonymous namespace\)::StoreTransposed\(", 1, 2, "prefetcht0"),
    # The out rows a flash task and a chunked task ask for before the finish (PrefetchOutRows,
    # prefetcht0; GCC 12 deleted them as a const call before PrefetchL1 became a volatile asm).
    (r"^qkv::N_AVX(2|3)::Flash<qkv::N_AVX(2|3)::tiles::WideProducts<float> >.*lambda", 1, 2,
     "prefetcht0"),
    (r"^qkv::N_AVX(2|3)::.*Chunked<qkv::N_AVX(2|3)::tiles::WideProducts<float> >.*lambda", 1, 2,
     "prefetcht0"),
]


def prefetch_counts(listing, mnemonic="prefetch"):
    counts, name = Counter(), None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            name = header.group(1)
            counts[name] += 0
        elif name is not None and "\t" + mnemonic in line:
            counts[name] += 1
    return counts


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", sys.argv[1]],
                             check=True, capture_output=True, text=True).stdout
    problems = []
    for pattern, at_least, functions, *mnemonic in REQUIRED:
        mnemonic = mnemonic[0] if mnemonic else "prefetch"
        counts = prefetch_counts(listing, mnemonic)
        found = [n for name, n in counts.items() if re.search(pattern, name)]
        enough = sum(n >= at_least for n in found)
        print(f"{pattern}: {mnemonic} per matching function: {found}")
        if enough < functions:
            problems.append(f"{pattern}: {enough} function(s) with >= {at_least} {mnemonic} "
                            f"instruction(s), expected {functions} (counts: {found})")
    if problems:
        print("software prefetches missing from " + sys.argv[1] + ":\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
