"""The checkpoint file format: a safetensors file whose metadata holds the state tree as JSON.

The tree is encoded here (:class:`Encoder`), decoded and matched against an engine's template
before anything is read (:func:`match`); :mod:`arraytrain.checkpoint` writes and reads files.

File format, version 1
----------------------
A safetensors file (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length, a JSON header with every tensor's dtype, shape and
byte range and a ``__metadata__`` map of strings, then the raw little-endian
tensor bytes. Every array leaf of the state tree is one tensor. ``__metadata__``:

======================  =============================================================
``format``              ``"arraytrain.checkpoint"``
``format_version``      ``"1"``
``arraytrain_version``  the writer's ``arraytrain.__version__``
``summary``             one line for people: optimizer(hyperparameters), step, sizes
``tree``                the state tree as JSON (encoding below), arrays as references
``extra``               the caller's ``extra`` dict, same encoding, no arrays
======================  =============================================================

Tree encoding
-------------
======================  =============================================================
Python value            JSON
======================  =============================================================
None, bool, int, str    null, true/false, integer, string
finite float            number, written with ``float.__repr__``: the shortest text that
                        reads back to the same 64 bits (``-0.0`` keeps its sign)
inf, -inf               ``{"$float": "inf"}``, ``{"$float": "-inf"}``
NaN                     ``{"$float": "nan"}`` for the default quiet NaN (bits
                        ``0x7ff8000000000000``), otherwise ``{"$float": "nan:0x<16 hex>"}``
                        with its IEEE-754 binary64 bits (sign and payload kept)
list                    array
tuple                   ``{"$tuple": [...]}``
mapping (str keys)      object in the mapping's order; a key that starts with ``$``
                        is written with one more ``$`` in front
NumPy array             ``{"$tensor": "<tensor key>"}``
NumPy scalar            the Python bool, int or float of the same value
======================  =============================================================

An object with a single key that starts with exactly one ``$`` is a tag; a
mapping's own keys never do because of the escape, so the encoding is
unambiguous. The reference in the tree, not the tensor key's text, says where a
tensor belongs, so parameter names may hold any character. Tensor keys are
``"<n>:<path>"``: ``n`` numbers the arrays in tree order (which makes keys
unique), ``path`` is there for people looking at the file with other tools.
Array dtypes: bool, (u)int8-64, float16/32/64, bfloat16 (``ml_dtypes``), complex64.

Reading refuses what safetensors' parser lets through: a header that declares a
key twice (a tensor, a metadata key, a field), and metadata JSON nested deeper
than ``MAX_DEPTH`` levels (writing refuses such trees, and reference cycles).
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
from collections.abc import Mapping

import numpy as np

from ..backend import is_device_array
from ..errors import CheckpointError
from ..owned import Owned
from ..parallel.communicator import PerRank

#: The metadata's ``format``: what marks a safetensors file as an arraytrain checkpoint.
FORMAT = "arraytrain.checkpoint"


#: The metadata's ``format_version``: the version of the file format this module writes and reads.
FORMAT_VERSION = 1


_TAGS = ("$tensor", "$tuple", "$float")


#: JSON containers nest at most this deep in the metadata (an engine's tree is a few levels, a
#: schedule nesting schedules.MAX_NESTING deep about 100), checked while encoding and decoding,
#: well before Python's recursion limit; the parser's own limit is caught as well.
MAX_DEPTH = 128


_QUIET_NAN_BITS = 0x7FF8000000000000


# NumPy dtype name -> safetensors dtype code, for the dtypes that round-trip
# through safetensors' NumPy API (bfloat16 comes from ml_dtypes).
_DTYPE_CODES = {
    "bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16",
    "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64",
    "float16": "F16", "float32": "F32", "float64": "F64", "bfloat16": "BF16", "complex64": "C64",
}


_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}


class Encoder:
    """Tree -> JSON-able object; arrays are collected in ``tensors`` (no copies of contiguous arrays).

    Containers nest at most ``MAX_DEPTH`` deep in the JSON written (a tuple's tag
    counts as a level); a container that contains itself is refused by name.
    """

    def __init__(self, error, tensors: bool):
        self.error = error
        self.allow_tensors = tensors
        self.tensors: dict[str, np.ndarray] = {}
        self._open: set[int] = set()  # ids of the containers on the current path

    def encode(self, node, path: tuple, depth: int = 0):
        """``node`` (at ``path`` in the tree, ``depth`` levels down) as a JSON-able object."""
        if isinstance(node, (tuple, list, Mapping)):
            depth += 2 if isinstance(node, tuple) else 1
            if id(node) in self._open:
                raise self.error(f"{_show(path)}: the {type(node).__name__} contains itself (a reference cycle)")
            if depth > MAX_DEPTH:
                raise self.error(f"{_show(path[:3])}...: nested deeper than {MAX_DEPTH} levels")
            self._open.add(id(node))
            try:
                return self._container(node, path, depth)
            finally:
                self._open.discard(id(node))
        if node is None:
            return None
        if isinstance(node, str):
            return str(node)
        if isinstance(node, (bool, np.bool_)):
            return bool(node)
        if isinstance(node, (int, np.integer)):
            return int(node)
        if isinstance(node, (float, np.floating)):
            x = float(node)  # float16/32 widen exactly
            return x if math.isfinite(x) else {"$float": _float_text(x)}
        if isinstance(node, np.ndarray):
            return {"$tensor": self._tensor(node, path)}
        if is_device_array(node):  # a CUDA engine's state: saving is the explicit move to the host
            return {"$tensor": self._tensor(node.get(), path)}
        raise self.error(f"{_show(path)}: cannot store a {type(node).__name__} (expected an array, None, bool, "
                         "int, float, str, list, tuple or str-keyed mapping)")

    def _container(self, node, path: tuple, depth: int):
        if isinstance(node, tuple):
            return {"$tuple": [self.encode(v, path + (i,), depth) for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [self.encode(v, path + (i,), depth) for i, v in enumerate(node)]
        out = {}
        for k, v in node.items():
            if not isinstance(k, str):
                raise self.error(f"{_show(path)}: keys must be str, got {type(k).__name__} {k!r}")
            out["$" + k if k.startswith("$") else k] = self.encode(v, path + (k,), depth)
        return out

    def _tensor(self, a: np.ndarray, path: tuple) -> str:
        if not self.allow_tensors:
            raise self.error(f"{_show(path)}: arrays cannot be stored here (only JSON-like values)")
        if a.dtype.name not in _DTYPE_CODES:
            raise self.error(f"{_show(path)}: dtype {a.dtype} cannot be stored; supported: {sorted(_DTYPE_CODES)}")
        key = f"{len(self.tensors)}:{_show(path)}"
        # safetensors reads the memory behind data_ptr: it must be one dense block
        self.tensors[key] = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        return key


def _float_text(x: float) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    return "nan" if bits == _QUIET_NAN_BITS else f"nan:0x{bits:016x}"


def dumps(obj) -> str:
    """Compact JSON text of an encoded tree (no NaN literals: the encoding tags them)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def summary(tree, tensors: dict) -> str:
    """One line for people, from the tree: ``Adam(lr=..., ...), step 5; 3 parameters, ...``."""
    parts = []
    opt = tree.get("optimizer") if isinstance(tree, Mapping) else None
    if isinstance(opt, Mapping) and "type" in opt:
        hp = opt.get("hyperparameters")
        args = ", ".join(f"{k}={v!r}" for k, v in hp.items()) if isinstance(hp, Mapping) else ""
        parts.append(f"{opt['type']}({args})" + (f", step {opt['step']}" if "step" in opt else ""))
    params = tree.get("params") if isinstance(tree, Mapping) else None
    if isinstance(params, Mapping):
        arrays = [a for a in params.values() if isinstance(a, np.ndarray) or is_device_array(a)]
        dtypes = ", ".join(sorted({str(a.dtype) for a in arrays}))
        size = f"{len(params)} parameters, {sum(a.size for a in arrays)} elements"
        parts.append(size + (f", {dtypes}" if dtypes else ""))
    parts.append(f"{len(tensors)} tensors, {sum(a.nbytes for a in tensors.values())} bytes")
    return "; ".join(parts)


# -- reading --------------------------------------------------------------------------------------
class _Ref:
    """A tensor reference in a decoded tree, replaced by the array once everything is validated."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_pairs(items: list) -> dict:
    """``object_pairs_hook`` that refuses an object declaring a key twice."""
    obj = dict(items)
    if len(obj) != len(items):
        seen: set = set()
        for k, _ in items:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return obj


def check_header_keys(where: str, size: int) -> None:
    """Refuse a safetensors header that declares any key twice, at any level.

    safetensors' own parser keeps the last of two equal keys (a tensor entry,
    a metadata key, a field of an entry); the format forbids duplicates and a
    reader that keeps the first would see another checkpoint. Runs after
    ``safe_open`` accepted the file, so the header is JSON of a sane length.
    """
    with open(where, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if n > size - 8:
            raise CheckpointError(f"{where}: not a valid safetensors file: the header length {n} exceeds the file")
        text = fh.read(n)
    try:
        json.loads(text, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{where}: the safetensors header declares {exc.key!r} twice (the format forbids "
                              "duplicate keys: readers disagree on which one counts)") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: not a valid safetensors file: the header does not parse: {exc}") from None


def guard(where: str, fn, *args):
    """``fn(*args)``, safetensors' errors as a :class:`CheckpointError` naming the file."""
    import safetensors

    try:
        return fn(*args)
    except safetensors.SafetensorError as exc:
        raise CheckpointError(f"{where}: cannot read the file: {exc}") from None


def sniff(where: str) -> str:
    """A hint at what a non-safetensors file is."""
    try:
        with open(where, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return ""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return " (it looks like a pickle file, which is never loaded)"
    if head == b"PK\x03\x04":
        return " (it looks like a zip archive, e.g. from torch.save)"
    return ""


def decode_metadata(where: str, meta) -> tuple:
    """``(tree, tensor references, extra)`` of the file's metadata, its format and version checked."""
    if not meta or meta.get("format") != FORMAT:
        got = None if not meta else meta.get("format")
        raise CheckpointError(f"{where}: not an arraytrain checkpoint (safetensors metadata format={got!r}, "
                              f"expected {FORMAT!r})")
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        newer = isinstance(version, str) and version.isdigit() and int(version) > FORMAT_VERSION
        raise CheckpointError(f"{where}: format_version {version!r} is "
                              + (f"newer than this arraytrain reads ({FORMAT_VERSION}); written by arraytrain "
                                 f"{meta.get('arraytrain_version')!r}" if newer else f"not {FORMAT_VERSION!r}"))
    refs: list = []
    tree = _decode(where, _loads(where, meta, "tree"), (), refs)
    extra = _decode(where, _loads(where, meta, "extra"), ("extra",), None)
    if not isinstance(extra, dict):
        raise CheckpointError(f"{where}: metadata 'extra' is a {type(extra).__name__}, expected a mapping")
    return tree, refs, extra


def _loads(where: str, meta: dict, field: str):
    if field not in meta:
        raise CheckpointError(f"{where}: metadata lacks {field!r}")

    def constant(name):  # the writer never emits NaN/Infinity literals
        raise ValueError(f"non-standard JSON constant {name}")

    def pairs(items):
        obj = dict(items)
        if len(obj) != len(items):
            raise ValueError("duplicate key in an object")
        return obj

    try:
        return json.loads(meta[field], parse_constant=constant, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: metadata {field!r} is not valid JSON: {exc}") from None


def _decode(where: str, obj, path: tuple, refs: list | None, depth: int = 0):
    """JSON object -> tree with :class:`_Ref` leaves (``refs is None``: no tensors allowed)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj

    def deeper(levels):  # counted as the writer counts: lists, mappings, a tuple as two
        if depth + levels > MAX_DEPTH:
            raise CheckpointError(f"{where}: {_show(path[:3])}...: nested deeper than {MAX_DEPTH} levels")
        return depth + levels

    if isinstance(obj, list):
        inner = deeper(1)
        return [_decode(where, v, path + (i,), refs, inner) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: {_show(path)}: unexpected JSON value {_brief(obj)}")
    tags = [k for k in obj if k.startswith("$") and not k.startswith("$$")]
    if not tags:
        inner = deeper(1)
        out = {}
        for k, v in obj.items():
            name = k[1:] if k.startswith("$") else k  # "$$x" -> "$x"
            out[name] = _decode(where, v, path + (name,), refs, inner)
        return out
    tag = tags[0]
    if len(obj) != 1 or tag not in _TAGS:
        raise CheckpointError(f"{where}: {_show(path)}: malformed tagged value {_brief(obj)} (tags: {', '.join(_TAGS)})")
    value = obj[tag]
    if tag == "$tuple" and isinstance(value, list):
        inner = deeper(2)
        return tuple(_decode(where, v, path + (i,), refs, inner) for i, v in enumerate(value))
    if tag == "$float" and isinstance(value, str):
        x = _parse_float(value)
        if x is not None:
            return x
    if tag == "$tensor" and isinstance(value, str):
        if refs is None:
            raise CheckpointError(f"{where}: {_show(path)}: a tensor reference where only JSON values may be")
        ref = _Ref(value)
        refs.append(ref)
        return ref
    raise CheckpointError(f"{where}: {_show(path)}: malformed tagged value {_brief(obj)}")


def _parse_float(text: str) -> float | None:
    if text == "inf":
        return math.inf
    if text == "-inf":
        return -math.inf
    if text == "nan":
        bits = _QUIET_NAN_BITS
    elif len(text) == 22 and text.startswith("nan:0x") and all(c in "0123456789abcdef" for c in text[6:]):
        bits = int(text[6:], 16)
    else:
        return None
    x = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return x if math.isnan(x) else None


def tensor_specs(where: str, f, refs: list) -> dict:
    """``key -> (shape, safetensors dtype code)`` from the header; every tensor referenced exactly once."""
    keys = guard(where, f.keys)
    present = set(keys)
    seen = set()
    for ref in refs:
        if ref.key not in present:
            raise CheckpointError(f"{where}: the tree references tensor {ref.key!r}, which the file lacks")
        if ref.key in seen:
            raise CheckpointError(f"{where}: tensor {ref.key!r} is referenced twice")
        seen.add(ref.key)
    stray = [k for k in keys if k not in seen]
    if stray:
        raise CheckpointError(f"{where}: the file holds tensors the tree does not reference: {stray[:5]}")
    specs = {}
    for key in keys:
        view = guard(where, f.get_slice, key)
        specs[key] = (tuple(guard(where, view.get_shape)), guard(where, view.get_dtype))
    return specs


def check_optimizer_type(where: str, tree, template) -> None:
    """A checkpoint of another optimizer says so, rather than which slot key differs first."""

    def kind(t):
        opt = t.get("optimizer") if isinstance(t, Mapping) else None
        return opt.get("type") if isinstance(opt, Mapping) else None

    got, want = kind(tree), kind(template)
    if got is not None and want is not None and got != want:
        raise CheckpointError(f"{where}: optimizer: the checkpoint is for {got!r}, the engine has {want!r}")


def _what(x) -> str:
    if isinstance(x, (_Ref, np.ndarray)):
        return "an array"
    if isinstance(x, Mapping):
        return "a mapping"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"the scalar {x!r}"


def _has_arrays(node) -> bool:
    if isinstance(node, (np.ndarray, _Ref, Owned)) or is_device_array(node):
        return True
    if isinstance(node, Mapping):
        return any(_has_arrays(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_arrays(v) for v in node)
    return False


#: Keys of a mapping that holds arrays which a state has or lacks by its history, not by the engine's
#: configuration (per-parameter step counts, an open window's parameters without a gradient, a scalar
#: state's per-parameter values: see :mod:`arraytrain.param_steps`): values, matched by the engine's
#: ``load_state_dict``.
VALUE_KEYS = frozenset({"param_steps", "absent", "param_scalars"})


def match(where: str, path: tuple, got, want, specs: dict, checks: list) -> None:
    """Check the decoded tree ``got`` against the engine's ``want``; collect (key, template array).

    Structure is compared wherever the engine's tree holds arrays: mapping keys,
    sequence lengths (a list matches a tuple), array shapes and dtypes. A subtree
    without arrays (hyperparameters, counters, schedule values) is a value: the
    engine's ``load_state_dict`` checks it and keeps its own hyperparameters.
    """

    def fail(msg):
        raise CheckpointError(f"{where}: {_show(path)}: {msg}")

    if not _has_arrays(want):
        if _has_arrays(got):
            fail(f"the checkpoint holds arrays where the engine holds {_what(want)}")
    elif _q8_conversion(got, want):  # quantized optimizer state into float slots or another codec's, or floats into it
        match(where, path, got, _q8_template(got, want, specs), specs, checks)
    elif isinstance(want, (np.ndarray, Owned)) or is_device_array(want):
        if not isinstance(got, _Ref):
            fail(f"the engine holds an array, the checkpoint {_what(got)}")
        shape, code = specs[got.key]
        if shape != want.shape:
            fail(f"shape {shape} != engine shape {want.shape}")
        if code != _DTYPE_CODES.get(want.dtype.name):
            fail(f"dtype {_DTYPE_NAMES.get(code, code)} != engine dtype {want.dtype}")
        checks.append((got.key, want))
    elif isinstance(want, PerRank):  # saved by one process, or per rank: each share like this engine's
        plain = dict(want)
        if isinstance(got, dict) and set(got) == {"ranks"} and "ranks" not in plain:
            shares = got["ranks"]
            if not isinstance(shares, (list, tuple)) or not shares:
                fail(f"expected a non-empty list of per-rank states, the checkpoint holds {_what(shares)}")
            for i, g in enumerate(shares):
                match(where, path + ("ranks", i), g, plain, specs, checks)
        else:
            match(where, path, got, plain, specs, checks)
    elif isinstance(want, Mapping):
        if not isinstance(got, dict):
            fail(f"the engine holds a mapping, the checkpoint {_what(got)}")
        missing = [k for k in want if k not in got and k not in VALUE_KEYS]
        unexpected = [k for k in got if k not in want and not (k in VALUE_KEYS and not _has_arrays(got[k]))]
        if missing or unexpected:
            fail("; ".join(([f"the checkpoint lacks {missing}"] if missing else [])
                           + ([f"the checkpoint has unexpected {unexpected}"] if unexpected else [])))
        for k, v in want.items():
            if k in got:
                match(where, path + (k,), got[k], v, specs, checks)
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            fail(f"the engine holds {_what(want)}, the checkpoint {_what(got)}")
        if len(got) != len(want):
            fail(f"{len(got)} items != engine's {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            match(where, path + (i,), g, w, specs, checks)
    else:
        fail(f"the engine's state holds a {type(want).__name__}, which checkpoints do not store")


def _q8_conversion(got, want) -> bool:
    """A slot saved in 8 bits where the engine keeps floats (or the other way, or in the other
    codec's map: 8-bit and float8): the engine's ``load_state_dict`` converts (arraytrain.optim.state8);
    the file's own form is matched here."""
    from ..lowbit import is_q8_entry

    if (isinstance(want, (np.ndarray, Owned)) or is_device_array(want)) and isinstance(got, dict) and is_q8_entry(got):
        return True  # read whole: the engine decodes it
    if isinstance(got, dict) and is_q8_entry(got) and isinstance(want, Mapping) and is_q8_entry(want):
        return got["map"] != want["map"]  # re-encoded by the engine
    return isinstance(got, _Ref) and isinstance(want, Mapping) and is_q8_entry(want)


def _q8_template(got, want, specs: dict):
    """The form the file holds, as a template: an 8-bit entry for a float parameter's shape, or
    the float array (its own float dtype) for an 8-bit entry's, or the other codec's entry."""
    from ..lowbit import BLOCK, scale_key

    if isinstance(want, Mapping) and isinstance(got, dict):  # an entry of another map: the same arrays
        key = scale_key(got["map"]) if isinstance(got["map"], str) else "absmax"
        return {"codes": want["codes"], key: want[scale_key(want["map"])], "map": got["map"]}
    if not isinstance(want, Mapping):  # a float slot's array (of this rank's range, or on the device)
        n = int(np.prod(want.shape, dtype=np.int64))
        key = scale_key(got["map"]) if isinstance(got.get("map"), str) else "absmax"
        return {"codes": np.broadcast_to(np.zeros((), np.uint8), want.shape),
                key: np.broadcast_to(np.zeros((), np.float32), (-(-n // BLOCK),)), "map": got.get("map")}
    code = specs[got.key][1]
    name = _DTYPE_NAMES.get(code, code)
    if name == "bfloat16":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(name)
    if dtype.kind != "f" and name != "bfloat16":
        return want  # not a float array: the mismatch is reported as such
    return np.broadcast_to(np.zeros((), dtype), want["codes"].shape)


def fill(node, arrays: dict):
    """The decoded tree with every tensor reference replaced by its array from ``arrays``."""
    if isinstance(node, _Ref):
        return arrays[node.key]
    if isinstance(node, dict):
        return {k: fill(v, arrays) for k, v in node.items()}
    if isinstance(node, list):
        return [fill(v, arrays) for v in node]
    if isinstance(node, tuple):
        return tuple(fill(v, arrays) for v in node)
    return node


# -- helpers --------------------------------------------------------------------------------------
_REPR = reprlib.Repr()


_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _brief(obj) -> str:
    """A bounded repr for messages (a hostile value may be deep or long)."""
    return _REPR.repr(obj)


def _show(path: tuple) -> str:
    """``params['fc.weight']``, ``optimizer['hyperparameters']['betas'][0]``; the root is ``state``."""
    if not path:
        return "state"
    head, *rest = path
    return (head if isinstance(head, str) else f"[{head}]") + "".join(f"[{p!r}]" for p in rest)
