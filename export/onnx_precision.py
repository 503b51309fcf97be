"""ONNX rewrites for TensorRT, done with onnx tooling on the exported fp32 file (the
export itself, :mod:`specrt.export.kv_model`, is untouched):

* :func:`convert_precision` - an fp16 or bf16 copy for *strongly typed* TensorRT
  networks (TensorRT 10+ prefers precision stated in the graph over builder flags). The
  I/O stays float32 (``keep-io-types``), so the runtime's KV buffers, logits and the
  manifest's ``kv_dtype`` are unchanged; casts sit at the boundary.
* :func:`add_past_pad` - the min-past workaround of :mod:`specrt.runtime.profiles`: every
  past input gets ``pad`` leading dummy rows that the graph slices off at once.

Precision assignment (per node, in graph order)::

    fp32  the numerically fragile ops (FP32_OPS: RMSNorm's Pow/ReduceMean/Sqrt/Reciprocal,
          Softmax, RoPE's Cos/Sin, Exp/Log), a Cast from an integer to float (position
          ids -> RoPE angles: fp16 cannot hold position * inv_freq for long contexts), and
          any node whose non-constant float inputs are all fp32 (so the RoPE angle and the
          RMSNorm variance chains stay fp32 until they meet the hidden state)
    low   everything else; float constants it reads are converted (a copy is kept when an
          fp32 node reads the same constant)

and a Cast is inserted wherever a tensor crosses between the two. ``precision="fp64"``
uses float64 as the "low" type: onnxruntime's CPU provider runs it, which is how the
rewrite's wiring is tested on CPU machines (fp16/bf16 kernels are scarce there).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from specrt.runtime.errors import PrecisionError  # noqa: F401  (in the SpecRTError tree)

PRECISIONS = ("fp32", "fp16", "bf16")
FP32_OPS = frozenset({"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax", "Cos", "Sin", "Exp", "Log", "LayerNormalization", "RMSNormalization"})
SHAPE_ONLY = frozenset({"Shape", "Size"})  # read only their input's shape: never cast it


def _low_type(precision: str) -> int:
    from onnx import TensorProto

    table = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16, "fp64": TensorProto.DOUBLE}
    if precision not in table:
        raise ValueError(f"precision={precision!r}; must be one of fp32, fp16, bf16 (fp64 for tests)")
    return table[precision]


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even); returns the uint16 bit patterns.

    NaN stays NaN (quiet); +-inf stays +-inf.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def _convert_tensor(t, low: int, name: str):
    """A float32 TensorProto converted to ``low`` (fp16 / bf16 / double), same shape."""
    from onnx import TensorProto, numpy_helper

    arr = numpy_helper.to_array(t).astype(np.float32)
    out = TensorProto()
    out.name = name
    out.dims.extend(arr.shape)
    out.data_type = low
    if low == TensorProto.BFLOAT16:
        out.raw_data = float32_to_bf16_bits(arr).tobytes()
    elif low == TensorProto.FLOAT16:
        out.raw_data = arr.astype(np.float16).tobytes()
    else:
        out.raw_data = arr.astype(np.float64).tobytes()
    return out


def _hoist_constants(graph) -> None:
    """Move ``Constant`` nodes holding a tensor ``value`` into initializers."""
    from onnx import helper

    keep = []
    for node in graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            t = copy.deepcopy(helper.get_attribute_value(node.attribute[0]))
            t.name = node.output[0]
            graph.initializer.append(t)
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)


def convert_precision(model, precision: str):
    """A copy of ``model`` computing in ``precision`` with float32 I/O (see module docstring).

    Args:
        model: an ``onnx.ModelProto`` (float32 weights, as exported).
        precision: ``fp32`` (returns an unchanged copy), ``fp16``, ``bf16``, or ``fp64``
            (tests).

    Returns:
        a new ``onnx.ModelProto`` that passes ``onnx.checker``.

    Raises:
        ValueError: unknown precision.
        PrecisionError: control-flow subgraphs, or a float tensor whose type shape
            inference cannot determine.
    """
    import onnx
    from onnx import TensorProto, helper

    m = copy.deepcopy(model)
    if precision == "fp32":
        return m
    low = _low_type(precision)
    g = m.graph
    for node in g.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise PrecisionError(f"node {node.name or node.op_type} has a subgraph; control flow is not supported by the precision rewrite")
    _hoist_constants(g)
    types = _tensor_types(m)
    inits = {t.name: t for t in g.initializer}
    FLOAT = TensorProto.FLOAT

    def is_float(name: str) -> bool:
        return bool(name) and types.get(name) == FLOAT

    # ---- 1. precision of every node and float tensor ---------------------------------
    prec, node_prec = _assign_precisions(g, types, inits)
    # graph outputs computed in low precision: rename the tensor, cast back at the end
    tail = []
    rename = {}
    for o in g.output:
        if is_float(o.name) and prec.get(o.name) == "low":
            rename[o.name] = o.name + "__low"
            prec[o.name + "__low"] = "low"
            types[o.name + "__low"] = FLOAT
            tail.append(helper.make_node("Cast", [o.name + "__low"], [o.name], to=FLOAT, name=f"{o.name}__to_fp32_out"))
    # ---- 2. rewrite: casts at crossings, constants per consumer precision -------------
    new_nodes, cache, low_inits, used = [], {}, {}, set()

    def operand(name: str, want: str) -> str:
        kind = prec[name]
        if kind == "const":
            if want == "fp32":
                used.add(name)
                return name
            if name not in low_inits:
                low_inits[name] = _convert_tensor(inits[name], low, name + "__low")
            return name + "__low"
        have = "low" if kind == "low" else "fp32"
        if have == want:
            return name
        key = (name, want)
        if key not in cache:
            out = f"{name}__to_{want}"
            new_nodes.append(helper.make_node("Cast", [name], [out], to=(low if want == "low" else FLOAT), name=out))
            cache[key] = out
        return cache[key]

    for node, p in zip(g.node, node_prec):
        new_nodes.append(_rewrite_node(node, p, rename, prec, is_float, operand, used, low))
    new_nodes.extend(tail)
    used.update(name for name in inits if not is_float(name))  # non-float initializers are always kept
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep + list(low_inits.values()))
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    onnx.checker.check_model(m)
    return m


def _rewrite_node(node, p: str, rename: dict, prec: dict, is_float, operand, used: set, low: int):
    """Step 2 of :func:`convert_precision` for one node computing in ``p``: a copy whose
    outputs are renamed (``rename``), whose float inputs come through ``operand`` (casts at
    precision crossings, low-precision constants), and whose float-typed attributes are
    lowered when it computes in low precision; fp32 constants it reads join ``used``."""
    from onnx import TensorProto

    FLOAT = TensorProto.FLOAT
    node = copy.deepcopy(node)
    for j, x in enumerate(node.output):
        if x in rename:
            node.output[j] = rename[x]
    if node.op_type not in SHAPE_ONLY:
        for j, x in enumerate(node.input):
            x = rename.get(x, x)
            if is_float(x) or x in prec:
                node.input[j] = operand(x, p)
    else:
        used.update(x for x in node.input if prec.get(x) == "const")
    if p == "low":
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
                a.i = low
            elif node.op_type == "ConstantOfShape" and a.name == "value" and a.t.data_type == FLOAT:
                a.t.CopyFrom(_convert_tensor(a.t, low, a.t.name))
    else:
        used.update(x for x in node.input if prec.get(x) == "const")
    return node


def _tensor_types(m) -> dict:
    """Element type of every tensor of ``m`` (shape inference; initializers included)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(m)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    return types


def _assign_precisions(g, types: dict, inits: dict) -> tuple[dict, list]:
    """Step 1 of :func:`convert_precision`: ``(prec, node_prec)``, the precision of every
    float tensor (``"in"`` fp32 graph input, ``"fp32"``, ``"low"``, ``"const"``) and of
    every node (``"fp32"`` or ``"low"``), in graph order.

    Raises:
        PrecisionError: a node output whose type shape inference cannot determine.
    """
    from onnx import TensorProto

    FLOAT = TensorProto.FLOAT

    def is_float(name: str) -> bool:
        return bool(name) and types.get(name) == FLOAT

    prec: dict[str, str] = {i.name: "in" for i in g.input if is_float(i.name)}
    prec.update({name: "const" for name in inits if is_float(name)})
    node_prec = []
    for node in g.node:
        for out in node.output:
            if out and out not in types:
                raise PrecisionError(f"shape inference gave no type for {out!r} (node {node.name or node.op_type}); cannot assign a precision")
        dyn = [x for x in node.input if is_float(x) and prec.get(x) != "const"]
        cast_to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        if node.op_type in FP32_OPS:
            p = "fp32"
        elif node.op_type == "Cast" and cast_to == FLOAT and not is_float(node.input[0]):
            p = "fp32"  # integer -> float (RoPE positions)
        elif dyn and all(prec[x] == "fp32" for x in dyn):
            p = "fp32"
        else:
            p = "low"
        node_prec.append(p)
        for out in node.output:
            if is_float(out):
                prec[out] = p
    return prec, node_prec


def add_past_pad(model, pad: int = 1):
    """A copy of ``model`` whose past inputs carry ``pad`` leading dummy rows.

    Each ``past_*`` input keeps its name (axis 1 becomes ``past_plus_pad``); a ``Slice``
    on axis 1 from ``pad`` feeds the original consumers, so the model attends to exactly
    the rows after the dummies.

    Args:
        model: an ``onnx.ModelProto`` with the IO-bound KV interface.
        pad: dummy rows (>= 1; 0 returns an unchanged copy).

    Raises:
        ValueError: pad < 0, or no past input.
    """
    import onnx
    from onnx import helper, numpy_helper

    if pad < 0:
        raise ValueError(f"pad={pad}; must be >= 0")
    m = copy.deepcopy(model)
    if pad == 0:
        return m
    g = m.graph
    pasts = [i for i in g.input if i.name.startswith(("past_key_", "past_value_"))]
    if not pasts:
        raise ValueError("the model has no past_key_i / past_value_i inputs")
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array([pad], np.int64), "past_pad__start"),
            numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "past_pad__end"),
            numpy_helper.from_array(np.array([1], np.int64), "past_pad__axis"),
        ]
    )
    names = {p.name: p.name + "__unpadded" for p in pasts}
    for node in g.node:
        for j, x in enumerate(node.input):
            if x in names:
                node.input[j] = names[x]
    slices = [helper.make_node("Slice", [p, "past_pad__start", "past_pad__end", "past_pad__axis"], [s], name=s) for p, s in names.items()]
    nodes = slices + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    for p in pasts:
        dim = p.type.tensor_type.shape.dim[1]
        dim.Clear()
        dim.dim_param = "past_plus_pad"
    del g.value_info[:]
    onnx.checker.check_model(m)
    return m


def write_variant(src: Path, dst: Path, precision: str, pad: int) -> Path:
    """Write ``src`` rewritten for (precision, pad) to ``dst`` (weights inline).

    Returns ``dst``; ``src`` itself when nothing changes (fp32, pad 0).

    Raises:
        ValueError, PrecisionError: see :func:`convert_precision`, :func:`add_past_pad`.
    """
    import onnx

    if precision == "fp32" and pad == 0:
        return Path(src)
    m = onnx.load(str(src))
    m = add_past_pad(convert_precision(m, precision), pad)
    from specrt.runtime.fileio import replaced

    with replaced(dst) as tmp:
        onnx.save(m, str(tmp))
    return Path(dst)
