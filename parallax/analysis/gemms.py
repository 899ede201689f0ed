"""The matmuls of a compiled step and the element types they run in: are the FP8 matmuls FP8 GEMMs?

The FP8 `dot_general` (model/fp8.py) quantises both operands of every matmul it wraps: E4M3 x
E4M3 in the forward pass, E5M2 gradient x E4M3 in both backward matmuls (input gradient and
weight gradient). Whether the compiled program keeps them FP8 is the compiler's choice: XLA:CPU
upcasts (it has no FP8 matmul), XLA:GPU keeps f8 operands inside its gemm fusions on Hopper and
later, the TPU compiler keeps them on chips with FP8 matrix units (tpu7x). This module reads every
dot and convolution (the TPU compiler's form of dot_general), with its operands' element types
and the op name JAX gave it, so the audit can count the FP8 GEMMs against the matmuls that went
through the FP8 dot_general and name each matmul that is not FP8 and why.

Counts are executions per step (a matmul in the scanned layer stack runs once per layer), so they
do not change when the compiler peels or pipelines a loop iteration (XLA:GPU's pipelined
collectives copy the loop body once).

The attention kernel (`attention_kernels`) is read here too: the other kernel whose choice
decides a step's FLOPs and memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parallax.analysis.hlo import computations, runs_per_step

_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = \(?(\S+?)(?:\{[^}]*\})?(?:, [^)]*\))? ([a-z][a-z0-9\-]*)\((.*)$")
_CUBLAS = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"')  # XLA:GPU's other GEMM form
FP8_OP = "Fp8DotGeneral"  # in the op name of every matmul the FP8 dot_general wraps (flax fp8_ops' module name)


@dataclass(frozen=True)
class Matmul:
    operands: tuple[str, ...]  # element types, e.g. ('f8e5m2', 'f8e4m3fn')
    op_name: str
    executions: int = 1  # per step, through the enclosing loops' trip counts (hlo.py)

    @property
    def fp8(self) -> bool:
        return all(t.startswith("f8") for t in self.operands)

    @property
    def through_fp8_dot(self) -> bool:
        return FP8_OP in self.op_name

    @property
    def backward(self) -> bool:
        return "transpose(" in self.op_name  # JAX names the backward pass's ops transpose(jvp(...))


def matmuls(hlo: str) -> list[Matmul]:
    """Every dot, convolution and cuBLAS GEMM call with its operands' element types (read from the operands'
    definitions: instruction names are unique in a module; a gemm fusion's operands are its
    parameters) and JAX's op name."""
    comps = computations(hlo)
    runs = runs_per_step(comps)
    defs = []
    for comp, lines in comps.items():
        for line in lines:
            m = _DEF.match(line)
            if m:
                defs.append((comp, m.group(1), m.group(2).split("[")[0], m.group(3), m.group(4)))
    types = {name: typ for _, name, typ, _, _ in defs}
    out = []
    for comp, _, _, op, rest in defs:
        if op in ("dot", "convolution") or (op == "custom-call" and _CUBLAS.search(rest)):
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            name = re.search(r'op_name="([^"]*)"', rest)
            out.append(Matmul(tuple(types.get(o, "?") for o in operands), name.group(1) if name else "",
                              runs.get(comp, 1)))
    return out


def _why_not(m: Matmul) -> str:
    """Why a matmul of the step is not an FP8 GEMM, from its op name."""
    if m.through_fp8_dot:
        return "through the FP8 dot_general, but the compiler runs it in " + " x ".join(m.operands)
    name = m.op_name
    if "dot_product_attention" in name or re.search(r"attn/(?:.*/)?vmap\(", name):
        return "attention scores and values (the attention kernel has no FP8 dot_general)"
    if "head_loss" in name or "logits" in name:
        return "output head (FP8 only with fp8.logits)"
    if "router" in name:
        return "MoE router (kept in float32: routing decisions)"
    return "not through an FP8 dot_general"


def fp8_report(hlo: str) -> dict:
    """Counts of the FP8 dot_general's matmuls kept FP8 (forward; backward: input and weight
    gradients), and every other matmul with why it is not FP8, grouped by reason."""
    found = matmuls(hlo)
    wrapped = [m for m in found if m.through_fp8_dot]
    fp8 = [m for m in wrapped if m.fp8]
    runs = lambda ms: sum(m.executions for m in ms)  # noqa: E731
    not_fp8: dict[str, int] = {}
    for m in found:
        if not m.fp8:
            why = _why_not(m)
            not_fp8[why] = not_fp8.get(why, 0) + m.executions
    return {
        "matmuls": runs(found),
        "fp8_dot_general": runs(wrapped),
        "fp8_dot_general_forward": runs(m for m in wrapped if not m.backward),
        "fp8_dot_general_backward": runs(m for m in wrapped if m.backward),
        "fp8_gemms": runs(fp8),
        "fp8_gemms_forward": runs(m for m in fp8 if not m.backward),
        "fp8_gemms_backward": runs(m for m in fp8 if m.backward),
        "operand_types": sorted({" x ".join(m.operands) for m in fp8}),
        "not_fp8": not_fp8,
    }


_CUDNN_FMHA = re.compile(r'custom_call_target="(__cudnn\$fmha\w*)"')
_CUSTOM_NAME = re.compile(r"^\s*(?:ROOT )?%([A-Za-z_][\w\-]*?)(?:\.\d+)* = ")
ATTENTION_KERNEL_NAMES = {"cudnn": "cuDNN flash attention (__cudnn$fmha* custom calls)",
                          "splash": "Pallas splash attention (tpu_custom_call splash_mha_*)",
                          "xla": "XLA's attention (dot_product_attention's XLA path: [B, N, T, T] scores)"}


def attention_kernels(hlo: str) -> dict:
    """The attention kernel a compiled program runs, read from its custom calls: 'cudnn' (XLA:GPU's
    `__cudnn$fmha*` calls, forward and backward), 'splash' (the TPU's `tpu_custom_call`s named
    after the Pallas kernel, splash_mha_fwd*, _dq*, _dkv*), else 'xla' (the scores are plain
    dots). `calls`: each call target or kernel name and how often it appears in the program."""
    calls: dict[str, int] = {}
    for line in hlo.splitlines():
        if "custom-call(" not in line:
            continue
        m = _CUDNN_FMHA.search(line)
        if m:
            calls[m.group(1)] = calls.get(m.group(1), 0) + 1
        elif 'custom_call_target="tpu_custom_call"' in line and (n := _CUSTOM_NAME.match(line)) \
                and n.group(1).startswith("splash"):
            calls[n.group(1)] = calls.get(n.group(1), 0) + 1
    kernel = "cudnn" if any(k.startswith("__cudnn") for k in calls) else "splash" if calls else "xla"
    return {"kernel": kernel, "calls": calls}
