"""What a compiled kernel's main loop does, read from its SASS: instructions per iteration and per byte it streams.

Without a GPU the one measure of a streaming kernel is what each thread issues for each byte of weights it moves.
An H200 reads about 16 bytes per clock per SM at its copy bandwidth (4.3 TB/s / 132 SMs / 1.98 GHz); an SM issues
4 warp instructions per clock (7.8 thread instructions per weight byte in all), its integer pipe 64 results per clock
(3.9 per byte) and its conversion pipe (F2F, I2F) 16 (1 per byte). A loop above those budgets cannot reach the
bandwidth, whatever its tiles.

`loop_profile(sass)` finds the main loop (the longest backward branch whose body holds a matrix multiply, else the
longest; the whole kernel if it has none) in `cuobjdump -sass` text and counts its instructions by class; `describe`
prints them per weight byte; `program_length` counts the whole kernel's instructions (a tile read once, outside the
loop, as the indexer's keys, is there). Used by `scripts/check_kernels_compile.py --sass`. And `pdl_problem(ptx)`:
whether a kernel compiled for programmatic dependent launch reads or writes memory before it waits (every compile).
"""

from __future__ import annotations

import re
from collections import Counter

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
MMA = ("HMMA", "HGMMA", "QGMMA", "IMMA")
# opcode (before its first '.') -> class; IMAD.MOV and MOV are register moves (IMAD.MOV issues on the FMA pipe)
CLASSES = {
    "mma": MMA,
    "global load": ("LDG", "LDGSTS"),
    "shared": ("LDS", "LDSM", "STS"),
    "convert": ("F2F", "F2FP", "I2F", "I2FP", "F2I", "F2IP"),
    "float": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "HMUL2", "HFMA2", "HADD2", "HMNMX2", "MUFU"),
    "int": ("LOP3", "SHF", "PRMT", "IADD3", "IMAD", "LEA", "SGXT", "ISETP", "SEL", "VIADD", "PLOP3", "IABS",
            "IMNMX", "BMSK", "FLO", "POPC", "SHFL"),
}


def _class(opcode: str) -> str:
    if opcode.startswith(("IMAD.MOV", "MOV")):
        return "move"
    base = opcode.split(".")[0]
    if base.startswith("U") and base not in ("UMOV",):
        return "uniform"  # the warp-uniform datapath: scalar address and loop arithmetic, beside the vector pipes
    return next((name for name, bases in CLASSES.items() if base in bases), "other")


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_INSTRUCTION.search, sass.splitlines()) if m]


def loop_profile(sass: str) -> Counter:
    """Opcode counts of the main loop's body (one iteration, per thread); the whole kernel's for a kernel without a
    loop (what a program runs when its tile is read outside any loop, as the indexer's)."""
    instructions = _instructions(sass)
    loops = []
    for address, opcode, operands in instructions:
        target = _TARGET.search(operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            body = Counter(op for a, op, _ in instructions if int(target.group(1), 16) <= a <= address)
            loops.append((any(op.startswith(MMA) for op in body), sum(body.values()), body))
    return max(loops, key=lambda loop: loop[:2])[2] if loops else Counter(op for _, op, _ in instructions)


def program_length(sass: str) -> int:
    """Instructions in the kernel's code, each once (a thread's issue count for a program that runs no loop twice)."""
    return len(_instructions(sass))


def describe(body: Counter, weight_bytes_per_thread: float | None) -> str:
    """One line: instructions per iteration (and per weight byte), by class, with the heaviest opcodes of each."""
    per = weight_bytes_per_thread or 1.0
    unit = "/B" if weight_bytes_per_thread else "/iter"
    by_class: dict[str, Counter] = {}
    for opcode, count in body.items():
        by_class.setdefault(_class(opcode), Counter())[opcode] = count
    total = sum(body.values())
    head = f"{total} instr/iter" + (f" = {total / per:.2f}/B ({weight_bytes_per_thread:g} weight B/thread)"
                                    if weight_bytes_per_thread else "")
    parts = []
    for name in ("mma", "global load", "shared", "convert", "int", "move", "float", "uniform", "other"):
        ops = by_class.get(name)
        if not ops:
            continue
        top = ", ".join(f"{op} {n / per:.2f}" if weight_bytes_per_thread else f"{op} {n}"
                        for op, n in ops.most_common(3 if name != "mma" else 1))
        parts.append(f"{name} {sum(ops.values()) / per:.2f}{unit} [{top}]")
    return head + "; " + "; ".join(parts)


# a PTX instruction that reads or writes memory other than the kernel's parameters (a prefetch is neither)
_MEMORY_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?!(?:ld|st)\.param)(?:ld|st|atom|red|cp\.async)\.", re.MULTILINE)


def pdl_problem(ptx: str) -> str:
    """What makes a kernel compiled with PDL=True unsafe to launch with programmatic dependent launch: no
    `griddepcontrol.wait`, or memory read or written before it (the kernel before may still be writing it; an L2
    prefetch of a weight, `prefetch_weight_rows`, may come first)."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "no griddepcontrol.wait: unsafe to launch with programmatic dependent launch"
    early = _MEMORY_ACCESS.search(ptx[:wait])
    if early:
        line = ptx[early.start():ptx.find("\n", early.start())].strip()
        return f"reads or writes memory before its griddepcontrol.wait ({line})"
    return ""
