"""A custom node's signature as data (OpDef), from which its ONNX schema and its one-node model are made.

A port's type is "T" (the node's float type: float32, float16 or bfloat16), "C" (a cache's float type: T's, or
float16 under a float32 T, the contract's cache_dtype) or a fixed element type; its rank sizes the one-node model's
dynamic shape. An op module declares one OpDef with its function body and float64 reference;
kernels, tests and benchmarks build models of a single node from it (``model``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .spec import DOMAIN, ONNX, OPSET, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION, PROJECTION

FLOATS = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
CACHES = FLOATS + ("tensor(int8)",)  # an int8 cache: rows with their scale's code (ops.spec)
ELEMENT = {"int64": 7, "float": 1, "int8": 3, "uint8": 2}  # onnx.TensorProto.INT64 / FLOAT / INT8 / UINT8
ANY = None  # in an op's shape rule: a dimension shape inference cannot know (a slot count, total_length's L)


@dataclass(frozen=True)
class Port:
    name: str
    type: str = "T"  # "T", "C" (a cache), or a fixed element type of ELEMENT
    rank: int = 4
    doc: str = ""


@dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "int" | "float" | "floats" | "string"
    doc: str
    required: bool = True
    default: object = None  # of an optional attribute: what a node without it means (function bodies read it)


PLUGIN_ATTRS = (Attr("plugin_namespace", "string", "TensorRT plugin namespace"),
                Attr("plugin_version", "string", "TensorRT plugin version"))
PROJECTION_PORT = Port(PROJECTION, "T", 3, "P [Hkv, d, r]: input 0 is then q [B,Hkv,g,T,d], q^ = q P")


@dataclass(frozen=True)
class OpDef:
    """name: the op type in DOMAIN; projectable: takes P as an optional last input (PROJECTION_PORT);
    body(opset, projected, **form) -> its ONNX FunctionProto; reference(*inputs, **attributes) -> its float64
    answer."""

    name: str
    doc: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: tuple[Attr, ...] = ()
    body: Callable = field(default=None, repr=False)
    reference: Callable = field(default=None, repr=False)
    projectable: bool = False
    forms: tuple = ()  # other forms of its body: (keyword of body(), the attributes whose presence on a node asks
    # for it) pairs; ("tokens", TOKEN_ATTRS' names): token selection
    shape: Callable | None = field(default=None, repr=False)  # {input: dims} -> {output: dims}: ONNX shape inference
    # of the node (dims: the inputs' dimension protos, ANY where unknown), so a consumer that registers the schemas
    # (which hides the function bodies from inference) still knows every output's shape

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.outputs)

    @property
    def attribute_names(self) -> list[str]:
        return [a.name for a in self.attributes]

    def register(self) -> None:
        """Its schema in ONNX's registry (once), so that checkers and shape inference know the node."""
        import onnx
        from onnx.defs import OpSchema

        if onnx.defs.has(self.name, DOMAIN):
            return
        kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "string": OpSchema.AttrType.STRING,
                 "floats": OpSchema.AttrType.FLOATS}

        def formal(p: Port, optional: bool = False):
            t = p.type if p.type in ("T", "C") else f"tensor({p.type})"
            if optional:
                return OpSchema.FormalParameter(p.name, t, p.doc, param_option=OpSchema.FormalParameterOption.Optional)
            return OpSchema.FormalParameter(p.name, t, p.doc)

        schema = OpSchema(
            self.name, DOMAIN, OPSET_VERSION, doc=self.doc,
            inputs=[formal(p) for p in self.inputs] + [formal(PROJECTION_PORT, True)] * self.projectable,
            outputs=[formal(p) for p in self.outputs],
            type_constraints=[("T", list(FLOATS), "float types")] * any(p.type == "T" for p in self.inputs) +
            [("C", list(CACHES), "the caches' types")] * any(p.type == "C" for p in self.inputs),
            attributes=[OpSchema.Attribute(a.name, kinds[a.kind], a.doc, required=a.required)
                        for a in self.attributes])
        if self.shape is not None:
            schema.set_type_and_shape_inference_function(self._infer)
        onnx.defs.register_schema(schema)

    def _infer(self, ctx) -> None:
        """Each output's element type (its port's: T as input 0's, C as the first cache port's, or fixed) and, where
        the inputs' shapes are known, its shape by ``shape``."""
        from onnx import TypeProto

        dims, types = {}, {}
        for i, p in enumerate(self.inputs):
            if i < ctx.get_num_inputs() and ctx.has_input(i):
                t = ctx.get_input_type(i).tensor_type
                types.setdefault(p.type, t.elem_type)
                dims[p.name] = list(t.shape.dim) if t.HasField("shape") else None
        try:
            shapes = self.shape(dims)
        except TypeError:  # an input of unknown rank: the types alone
            shapes = {}
        for i, p in enumerate(self.outputs):
            out = TypeProto()
            out.tensor_type.elem_type = types.get(p.type) or ELEMENT.get(p.type) or types["T"]
            if shapes.get(p.name) is not None:
                shape = out.tensor_type.shape
                for d in shapes[p.name]:
                    new = shape.dim.add()  # ANY: a dimension with neither a value nor a name
                    if d is not ANY:
                        new.CopyFrom(d)
            ctx.set_output_type(i, out)

    def bodied(self, opset: int, projected: bool = False, **form):
        """Its function body of that form (the forms it does not have are ignored)."""
        return self.body(opset, projected, **{k: v for k, v in form.items() if k in dict(self.forms)})

    def model(self, dtype: str = "float32", opset: int = OPSET, projected: bool = False, cache_dtype: str | None = None,
              **attributes):
        """A one-node model of this op with its function body (kernel tests and benchmarks): inputs and outputs
        named as the node's ports (projected: P as the last input, and input 0 the unprojected query; "C" ports of
        cache_dtype, default dtype); optional
        attributes at their defaults and the plugin attributes filled in; the body of the form (forms) whose
        attributes are given."""
        form = {f: True for f, names in self.forms if any(n in attributes for n in names)}
        from onnx import helper as H

        self.register()
        kinds = {a.name: a.kind for a in self.attributes}
        attributes = {**{a.name: a.default for a in self.attributes if a.default is not None}, **attributes}
        attributes = {n: float(v) if kinds.get(n) == "float" else v for n, v in attributes.items()}
        if any(a.name.startswith("plugin_") for a in self.attributes):
            attributes = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION, **attributes}
        ports = list(self.inputs) + [PROJECTION_PORT] * projected
        node = H.make_node(self.name, [p.name for p in ports], list(self.output_names), domain=DOMAIN,
                           name=f"/op/{self.name}", **attributes)
        types = {"T": ONNX[dtype], "C": ONNX[cache_dtype or dtype]}

        def info(p: Port):
            return H.make_tensor_value_info(p.name, types.get(p.type) or ELEMENT[p.type], [None] * p.rank)

        graph = H.make_graph([node], self.name, [info(p) for p in ports], [info(p) for p in self.outputs])
        return H.make_model(graph, opset_imports=[H.make_opsetid("", opset), H.make_opsetid(DOMAIN, OPSET_VERSION)],
                            functions=[self.bodied(opset, projected, **form)], ir_version=10)
