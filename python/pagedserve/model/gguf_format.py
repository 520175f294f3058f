"""What PagedServe knows of the GGUF format (llama.cpp's model file), in one
place: the file's tensor index and raw blocks (GGUFBlocks, read by gguf-py),
the mapping from a transformers layer name to the GGUF tensor that stores it,
llama.cpp's rotary row order of the q/k projections, the block types our
kernels read (NATIVE_QTYPES, FLOAT_QTYPES), and gguf-py's quantiser / de-quantiser (the
reference our C++ kernels are held to). The block layouts themselves are the
C++ kernels' (csrc/backends/cpu/gemm/gguf_types.cc); converting a file to a
transformers model is transformers' GGUF reader (loader.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# GGUF block types whose blocks the C++ kernel (QuantizedWeight) reads, with int8 activations too
NATIVE_QTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
# GGUF's unquantised types, which the exact float32 GEMM (QuantizedWeight.linear_f32) reads from dense tiles
FLOAT_QTYPES = ("f32", "f16", "bf16")
# every type linear_f32 reads (the gguf path)
F32_KERNEL_QTYPES = NATIVE_QTYPES + FLOAT_QTYPES

# GGUF tensor names of a Llama layer's linear layers (llama.cpp's convention)
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_types():
    from gguf import GGMLQuantizationType

    return {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def quantize_rows(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """weight [N, K] float (K a multiple of 32) -> GGUF blocks [N, K/32 * block bytes]
    uint8 of ``qtype`` ("q4_1" or "q8_0"), quantised by gguf-py (llama.cpp's
    rounding). Raises ValueError if K is not a multiple of 32."""
    from gguf.quants import quantize

    if weight.shape[-1] % 32:
        raise ValueError(f"{qtype} needs in_features to be a multiple of 32, got {weight.shape[-1]}")
    return torch.from_numpy(np.ascontiguousarray(quantize(weight.detach().float().numpy(), _gguf_types()[qtype])))


def dequantize_rows(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks [N, bytes] uint8 -> float32 [N, K], by gguf-py (the reference
    the tests hold the C++ kernel's dequantize to)."""
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks.numpy(), _gguf_types()[qtype])))


def raw_bytes(data: np.ndarray) -> torch.Tensor:
    """A GGUF tensor's data as gguf-py gives it (quantised and BF16: uint8
    [N, bytes]; F16, F32: float16 / float32 [N, K]) -> a copy of its bytes,
    uint8 [N, bytes per row] (what QuantizedWeight takes)."""
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1).copy())


def unpermute_rows(blocks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores the q and k projections' rows of each head in
    interleaved rotary order; Hugging Face Llama wants them half-split. Undoes
    that on whole rows (blocks run along in_features, so rows move intact):
    [N, bytes] -> [N, bytes], N = num_heads * head_dim."""
    n = blocks.shape[0]
    return blocks.reshape(num_heads, n // num_heads // 2, 2, -1).transpose(1, 2).reshape(n, -1).contiguous()


# the layout of read_tensor_index's dict; a cache file of another layout is read again
INDEX_FORMAT = 2


def index_cache_path(path: Path) -> Path | None:
    """Where ``read_tensor_index`` keeps ``path``'s index: the cache folder
    (``$PAGEDSERVE_CACHE``), named by the file's stem, its content fingerprint
    (loader.gguf_fingerprint) and gguf-py's version; None (no cache) where
    gguf-py's version is unknown (no package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    from .cache import cache_dir, gguf_fingerprint

    try:
        gguf_version = version("gguf")
    except PackageNotFoundError:
        return None
    return cache_dir() / "gguf-index" / f"{path.stem}-{gguf_fingerprint(path)}-gguf{gguf_version}.json"


def _header_sha256(path: Path, num_bytes: int) -> str:
    """SHA-256 (hashlib) of the file's first num_bytes bytes: its header (metadata
    and tensor infos), which determines the whole index."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read(num_bytes)).hexdigest()


def _check_size(path: Path, index: dict) -> None:
    """Raises ModelLoadError when the file ends before its last tensor does (a truncated download or copy)."""
    from ..errors import ModelLoadError

    end = max((offset + nbytes for _, offset, nbytes, *_ in index["tensors"]), default=0)
    size = path.stat().st_size
    if size < end:
        raise ModelLoadError(f"{path} is truncated: {size} bytes, its tensors end at byte {end}")


# read_tensor_index's results in this process, by (path, size, inode, modification time, cache folder): a start
# asks for the index three times (the architecture, the metadata folder's key, the blocks), each a fingerprint and
# a header hash of several MB
_INDEX_MEMO: dict[tuple, dict] = {}


def read_tensor_index(path: Path) -> dict:
    """_read_tensor_index(path), remembered in this process while the file's
    size, inode and modification time and the cache folder stay the same
    (the returned dict is shared: do not change it)."""
    from .cache import cache_dir

    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_ino, st.st_mtime_ns, str(cache_dir()))
    if key not in _INDEX_MEMO:
        _INDEX_MEMO[key] = _read_tensor_index(Path(path))
    return _INDEX_MEMO[key]


def _read_tensor_index(path: Path) -> dict:
    """The tensor index of the GGUF file ``path`` as gguf-py's GGUFReader reads
    it: {"format": INDEX_FORMAT, "architecture": general.architecture or "",
    "header_bytes": where the tensor data starts, "header_sha256": of those
    bytes, "tensors": [[name, data offset (bytes from the file's start), bytes,
    numpy dtype string, shape of gguf-py's data array, qtype name such as
    "q4_1"], ...]}. Taken from the cache file (index_cache_path) when there is
    one of this layout whose header hash matches the file's, else read by
    gguf-py and written there (atomically; an unwritable cache only costs a
    re-read)."""
    import json
    import os

    cached = index_cache_path(path)
    if cached is not None:
        try:
            index = json.loads(cached.read_text())
            if (isinstance(index, dict) and index.get("format") == INDEX_FORMAT
                    and index["header_sha256"] == _header_sha256(path, index["header_bytes"])):
                _check_size(path, index)
                return index
        except (OSError, ValueError, KeyError, TypeError):
            pass
    _check_magic(path)
    index = _index_from_header(path)
    if index is None:
        index = _index_from_gguf_reader(path)
    _check_size(path, index)
    if cached is not None:
        tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(index))
            os.replace(tmp, cached)
        except OSError:
            tmp.unlink(missing_ok=True)
    return index


def is_gguf(path: Path) -> bool:
    """Whether the file at ``path`` starts with GGUF's magic bytes ("GGUF"); False where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _check_magic(path: Path) -> None:
    """Raises ModelLoadError when ``path`` is not a readable file starting with GGUF's magic bytes: a file
    of another kind named .gguf is refused by name, before any reader parses it."""
    from ..errors import ModelLoadError

    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes, or it "
                             f"cannot be read ({path.stat().st_size} bytes)")


def _index_from_gguf_reader(path: Path) -> dict:
    """_read_tensor_index's dict from gguf-py's GGUFReader, which parses every metadata field first (11 s for
    Qwen2.5's 151k-entry vocabulary and merges on a 2-core EPYC): the fallback of _index_from_header. Raises
    ModelLoadError when gguf-py cannot read the file."""
    from gguf import GGUFReader

    from ..errors import ModelLoadError

    try:
        reader = GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OSError) as e:  # gguf-py's errors on a short or foreign file
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt? "
                             f"{path.stat().st_size} bytes): {type(e).__name__}: {e}") from e
    arch = reader.fields.get("general.architecture")
    try:
        architecture = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: general.architecture is not UTF-8 text ({e})") from e
    return {"format": INDEX_FORMAT,
            "architecture": architecture,
            "header_bytes": int(reader.data_offset), "header_sha256": _header_sha256(path, int(reader.data_offset)),
            "tensors": [[t.name, int(t.data_offset), int(t.data.nbytes), t.data.dtype.str, list(t.data.shape),
                         t.tensor_type.name.lower()] for t in reader.tensors]}


# gguf-py's element types for the tensor types it reads as values (GGUFReader._build_tensors); every other type
# it reads as uint8 bytes, the last dimension in bytes (gguf.quant_shape_to_byte_shape)
_VALUE_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


def _index_from_header(path: Path) -> dict | None:
    """_read_tensor_index's dict, the same values gguf-py's GGUFReader gives, from the header walk of
    transformers' GGUF reader (``transformers.integrations.gguf.reader``: the metadata with string arrays
    skipped, then the tensor table; 0.08 s where GGUFReader takes 11 s, Qwen2.5-1.5B) and gguf-py's type
    table (gguf-py's element types, byte shapes and sizes). Its GgufHeader is not used: it refuses types it
    cannot de-quantise (Q5_0, Q5_1), which our kernels read. None where that reader is missing (another
    transformers) or cannot walk the file (a foreign or cut file): the caller falls back to GGUFReader,
    whose errors name the fault. It also answers None for whatever that walk reads more loosely than
    GGUFReader (repeated metadata keys or tensor names, a non-string architecture, sizes past 2^63,
    strings running past the file's end) and for a file that sets general.alignment (whose type the walk
    does not keep; GGUFReader takes only a uint32 power of two; none of the packaged models sets it), so
    such files get GGUFReader's verdict. tests/python/test_gguf_in_place.py holds both readers' dicts
    equal on files of every type the kernels read."""
    import math
    import struct

    try:
        import gguf
        from transformers.integrations.gguf import reader

        blob = reader._mapped(str(path))
        _, _, metadata_count = struct.unpack_from("<IQQ", blob, 4)
        metadata, count, pos = reader._read_metadata(blob, str(path))
        entries, pos = reader._read_tensor_table(blob, count, pos)
        architecture = metadata["general.architecture"]
        if (len(metadata) != metadata_count or not isinstance(architecture, str) or pos > len(blob)
                or "general.alignment" in metadata or len({name for name, *_ in entries}) != len(entries)):
            return None
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT  # general.alignment unset (above)
        data_start = (pos + alignment - 1) // alignment * alignment
        tensors = []
        for name, shape, ggml_type, offset in entries:  # shape in numpy order, as gguf-py's data arrays
            qtype = gguf.GGMLQuantizationType(ggml_type)
            shape = tuple(int(d) for d in shape)
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = math.prod(shape) * type_size // block_size
            if nbytes >= 2**63 or data_start + int(offset) >= 2**63:
                return None
            if qtype.name in _VALUE_DTYPES:
                dtype = np.dtype(_VALUE_DTYPES[qtype.name]).str
            else:
                dtype, shape = np.dtype(np.uint8).str, tuple(gguf.quant_shape_to_byte_shape(shape, qtype))
            tensors.append([name, data_start + int(offset), nbytes, dtype, list(shape), qtype.name.lower()])
    except (ImportError, AttributeError, TypeError, ValueError, KeyError, IndexError, OSError, struct.error,
            UnicodeDecodeError, ArithmeticError):
        return None
    return {"format": INDEX_FORMAT, "architecture": architecture, "header_bytes": data_start,
            "header_sha256": _header_sha256(path, data_start), "tensors": tensors}


@dataclass
class GGUFBlocks:
    """Raw blocks of a GGUF file's tensors.

    Attributes:
        path: the file.
        tensors: GGUF name -> (blocks [N, bytes] uint8 as stored, qtype name
            such as "q4_1", "q8_0", "q6_k", "f32").
        architecture: the file's ``general.architecture`` ("llama", "gemma3", ...).
        index: GGUF name -> (data offset in bytes, bytes, numpy dtype string,
            shape of gguf-py's data array, qtype name): read_tensor_index's rows.
    """

    path: Path
    tensors: dict = field(default_factory=dict)
    architecture: str = ""
    index: dict = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> "GGUFBlocks":
        """Reads the tensor index of ``path`` and memory-maps the file (the blocks
        are copied when used). The index is gguf-py's (GGUFReader); since that
        parses every metadata field (SmolLM2's 49,152 vocabulary strings and its
        merges: about 3 s), it is kept in a small JSON file under the cache folder
        (``index_cache_path``), and later reads take it from there while its
        header hash matches the file's (read_tensor_index)."""
        path = Path(path)
        index = read_tensor_index(path)
        data = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = {name: (data[offset:offset + nbytes].view(np.dtype(dtype)).reshape(shape), qtype)
                   for name, offset, nbytes, dtype, shape, qtype in index["tensors"]}
        blocks = cls(path, tensors, index["architecture"])
        blocks.index = {row[0]: tuple(row[1:]) for row in index["tensors"]}
        return blocks

    def read_array(self, name: str) -> np.ndarray:
        """A copy of tensor ``name`` as gguf-py's data array (uint8 [N, bytes]
        for quantised and BF16 tensors, float32 / float16 [N, K] otherwise),
        read from the file with pread rather than through the memory map: the
        pages read this way are not left resident in the process, so a layer
        repacked from them costs its own bytes only. Raises KeyError for a name
        the file does not hold, OSError for a short read."""
        offset, nbytes, dtype, shape, _ = self.index[name]
        buf = bytearray(nbytes)
        with open(self.path, "rb", buffering=0) as f:
            view, done = memoryview(buf), 0
            while done < nbytes:
                n = os.preadv(f.fileno(), [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{self.path}: short read of {name} ({done} of {nbytes} bytes)")
                done += n
        return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)

    def rows(self, name: str) -> tuple[torch.Tensor, str]:
        """(bytes of tensor ``name`` row by row: uint8 [N, bytes per row], its
        qtype name) read by read_array (what QuantizedWeight takes)."""
        data = self.read_array(name)
        return torch.from_numpy(data.view(np.uint8).reshape(data.shape[0], -1)), self.index[name][4]

    def dequantized(self, name: str) -> np.ndarray:
        """Tensor ``name`` de-quantised by gguf-py to float32, in the shape
        gguf-py gives (GGUF's dimensions reversed: [out, in] for a matrix)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        data = self.read_array(name)
        return np.asarray(dequantize(data, GGMLQuantizationType[self.index[name][4].upper()]), dtype=np.float32)

    def gguf_name(self, name: str) -> str | None:
        """The GGUF tensor name of a decoder linear layer's qualified transformers
        name (``model.layers.{i}.self_attn.q_proj``, ``lm_head``: the Llama,
        Gemma and Qwen families name them alike), or None."""
        if name == "lm_head":
            return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        parts = name.split(".")  # model.layers.{i}.{self_attn|mlp}.{proj}
        if len(parts) == 5 and parts[:2] == ["model", "layers"]:
            sub = _GGUF_LAYER.get(".".join(parts[3:]))
            return f"blk.{parts[2]}.{sub}.weight" if sub else None
        return None

    def layer_blocks(self, name: str, out_features: int, num_heads: int, num_kv_heads: int,
                     wanted: tuple[str, ...]) -> tuple[torch.Tensor, str] | None:
        """(blocks [out_features, bytes] uint8 in Hugging Face's row order, qtype)
        of the linear layer ``name`` as this file stores it, if it stores it in
        one of the ``wanted`` block types ("q4_1", "q8_0", ...) with
        out_features rows; else None. In a ``llama`` file the q and k
        projections' rows are moved from llama.cpp's rotary order
        (unpermute_rows; its converter permutes that architecture's only)."""
        gname = self.gguf_name(name)
        entry = self.tensors.get(gname) if gname else None
        if entry is None or entry[1] not in wanted:
            return None
        raw = self.rows(gname)[0] if gname in self.index else raw_bytes(entry[0])
        if raw.shape[0] != out_features:
            return None
        return self.hf_row_order(gname, raw, num_heads, num_kv_heads), entry[1]

    def hf_row_order(self, gname: str, raw: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """The rows ``raw`` ([N, bytes] uint8) of the tensor ``gname`` in
        Hugging Face's order: in a ``llama`` file (or one that names no
        architecture) the q and k projections' rows moved from llama.cpp's
        rotary order (unpermute_rows; its converter permutes that
        architecture's only); any other tensor as it is."""
        if self.architecture not in ("", "llama"):
            return raw
        if gname.endswith("attn_q.weight"):
            return unpermute_rows(raw, num_heads)
        if gname.endswith("attn_k.weight"):
            return unpermute_rows(raw, num_kv_heads)
        return raw
