"""Reading PTX text: instructions, the loops of an entry, and the properties the tests assert.

Each ``*_problems`` function returns what is wrong (empty when the property holds), so a test
can assert both that real kernels pass and that a deliberately wrong kernel (the negative
control) does not.
"""

from __future__ import annotations

import re
from typing import NamedTuple

FLOAT_TYPES = frozenset({"f16", "f32", "f64", "bf16", "f16x2", "bf16x2", "tf32"})
_INT_TYPE = re.compile(r"^[usb](8|16|32|64)$")
_LABEL = re.compile(r"^(\$?[\w$]+):$")
_ROUNDING = frozenset({"rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi"})


class Instruction(NamedTuple):
    opcode: str  # e.g. "cvt.rn.f16.f32"
    operands: tuple[str, ...]

    @property
    def parts(self) -> list[str]:
        return self.opcode.split(".")


class Cvt(NamedTuple):
    rounding: str  # "" when exact (e.g. widening f16 -> f32)
    dst: str
    src: str


def _lines(ptx: str) -> list[str]:
    out = []
    for raw in ptx.splitlines():
        line = raw.split("//", 1)[0].strip()
        if line:
            out.append(line)
    return out


def _parse(line: str) -> Instruction | None:
    if line.startswith((".", "{", "}", ")")) or _LABEL.match(line):
        return None
    line = re.sub(r"^@!?%\w+\s+", "", line).rstrip(";").strip()
    opcode, _, rest = line.partition(" ")
    if not re.match(r"^[a-z]", opcode):
        return None
    operands = tuple(o.strip() for o in rest.split(",")) if rest.strip() else ()
    return Instruction(opcode, operands)


def instructions(ptx: str) -> list[Instruction]:
    """Every instruction of the module, in order."""
    return [i for i in (_parse(line) for line in _lines(ptx)) if i is not None]


def loop_instructions(ptx: str) -> list[Instruction]:
    """The instructions inside any loop: between a label and a later branch back to it.

    The grid-stride loop is the hot loop of every kernel here; NVVM may unroll it into a
    remainder loop and an unrolled one, and both count.
    """
    lines = _lines(ptx)
    labels = {m.group(1): n for n, line in enumerate(lines) if (m := _LABEL.match(line))}
    inside = [False] * len(lines)
    for n, line in enumerate(lines):
        parsed = _parse(line)
        if parsed is None or not parsed.opcode.startswith("bra") or not parsed.operands:
            continue
        start = labels.get(parsed.operands[-1])
        if start is not None and start < n:
            for k in range(start, n + 1):
                inside[k] = True
    return [i for n, line in enumerate(lines)
            if inside[n] and (i := _parse(line)) is not None]


def conversions(body: list[Instruction]) -> list[Cvt]:
    """The ``cvt`` instructions (not ``cvta``) as (rounding, destination type, source type)."""
    out = []
    for ins in body:
        parts = ins.parts
        if parts[0] != "cvt":
            continue
        rounding = next((p for p in parts[1:-2] if p in _ROUNDING), "")
        out.append(Cvt(rounding, parts[-2], parts[-1]))
    return out


def _is_int(t: str) -> bool:
    return bool(_INT_TYPE.match(t))


def f16_store_problems(ptx: str) -> list[str]:
    """A float16 store must be one round-to-nearest-even conversion from float32."""
    to_f16 = [c for c in conversions(loop_instructions(ptx)) if c.dst == "f16"]
    if not to_f16:
        return ["no conversion to f16 in the loop"]
    return [f"cvt.{c.rounding}.f16.{c.src}" for c in to_f16
            if c != Cvt("rn", "f16", "f32")]


def f16_load_problems(ptx: str) -> list[str]:
    """A float16 load must widen exactly (cvt.f32.f16, no rounding)."""
    from_f16 = [c for c in conversions(loop_instructions(ptx)) if c.src == "f16"]
    if not from_f16:
        return ["no conversion from f16 in the loop"]
    return [f"cvt.{c.rounding}.{c.dst}.f16" for c in from_f16 if c != Cvt("", "f32", "f16")]


def bit_cast_problems(ptx: str) -> list[str]:
    """bfloat16 <-> float32 must reinterpret bits (``mov.b32`` between a float and an integer
    register), never convert numerically between an integer and a floating type."""
    body = loop_instructions(ptx)
    problems = [f"numeric conversion cvt.{c.rounding + '.' if c.rounding else ''}{c.dst}.{c.src}"
                for c in conversions(body)
                if (c.dst in FLOAT_TYPES and _is_int(c.src))
                or (c.src in FLOAT_TYPES and _is_int(c.dst))]
    moves = [i for i in body if i.opcode == "mov.b32" and len(i.operands) == 2
             and {i.operands[0][:2], i.operands[1][:2]} == {"%f", "%r"}]
    if not moves:
        problems.append("no mov.b32 between float and integer registers in the loop")
    return problems


def _register_widths(ptx: str) -> dict[str, int]:
    """Register prefix -> bits, from declarations such as ``.reg .b64 %rd<38>;``."""
    return {m.group(2): int(m.group(1))
            for m in re.finditer(r"\.reg\s+\.[a-z]+?(\d+)\s+(%[a-z]+)<\d+>", ptx)}


def _registers(operand: str) -> list[str]:
    return re.findall(r"%[a-z]+\d+", operand)


def _width(register: str, widths: dict[str, int]) -> int:
    return widths.get(re.sub(r"\d+$", "", register), 0)


def loaded_values(body: list[Instruction]) -> set[str]:
    """Registers holding data loaded from global memory in the loop, or computed from it
    (index and address registers never are: no kernel here indexes by loaded data)."""
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ins in body:
            if not ins.operands or ins.opcode.startswith(("st.", "bra")):
                continue
            dst = ins.operands[0]
            sources = [r for o in ins.operands[1:] for r in _registers(o)]
            if dst not in tainted and (ins.opcode.startswith("ld.global")
                                       or any(r in tainted for r in sources)):
                tainted.add(dst)
                changed = True
    return tainted


def wide_arithmetic_problems(ptx: str) -> list[str]:
    """A kernel computing in float32 must not compute on its data in 64 bits in its loop: no
    ``.f64`` instruction, and no loaded value (or value computed from one) in a 64-bit
    register.  The 64-bit integer instructions that remain are index and address arithmetic,
    which is 64-bit from the start."""
    body = loop_instructions(ptx)
    widths = _register_widths(ptx)
    problems = [f"f64 instruction {i.opcode}" for i in body if "f64" in i.parts]
    problems += [f"64-bit data {i.opcode} {', '.join(i.operands)}" for i in body
                 if i.operands and i.operands[0] in loaded_values(body)
                 and _width(i.operands[0], widths) == 64]
    return problems


def _defined_in(body: list[Instruction]) -> set[str]:
    return {i.operands[0] for i in body
            if i.operands and i.operands[0].startswith("%")
            and not i.opcode.startswith(("st.", "bra"))}


def fmas(ptx: str) -> list[Instruction]:
    """The fused multiply-adds in the loop."""
    return [i for i in loop_instructions(ptx) if i.parts[0] == "fma"]


def fma_problems(ptx: str) -> list[str]:
    """Every fused multiply-add must multiply by a loop-invariant value (a scale), so it can
    only fuse ``a * scale + b``: exact when the scale is 1, one rounding otherwise."""
    body = loop_instructions(ptx)
    variant = _defined_in(body)
    return [f"{i.opcode} {', '.join(i.operands)} multiplies two loop-variant values"
            for i in body if i.parts[0] == "fma" and len(i.operands) == 4
            and i.operands[1] in variant and i.operands[2] in variant]


def vector_accesses(ptx: str) -> set[str]:
    """The global load/store opcodes in the loops (e.g. ``ld.global.v4.u32``)."""
    return {i.opcode for i in loop_instructions(ptx)
            if i.opcode.startswith(("ld.global", "st.global"))}


def nan_dropping_problems(ptx: str) -> list[str]:
    """Min/Max must let a NaN through from either input, as numpy.minimum/maximum do: no
    ``min.f32``/``max.f32`` (they return the other operand), and a NaN test in the loop."""
    body = loop_instructions(ptx)
    problems = [f"{i.opcode} drops NaN" for i in body
                if i.parts[0] in ("min", "max") and i.parts[-1] in FLOAT_TYPES
                and "NaN" not in i.parts]
    if not any(i.opcode.startswith("setp.nan") for i in body):
        problems.append("no NaN test (setp.nan) in the loop")
    return problems
