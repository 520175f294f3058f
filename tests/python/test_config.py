"""One configuration path: EngineArgs' fields are the server's engine flags
and LLM's keywords, with one set of defaults."""

import dataclasses
import subprocess
import sys

import pytest

from pagedserve import LLM, EngineArgs
from pagedserve.server.__main__ import build_parser


def test_every_engine_argument_is_a_flag_with_the_same_default():
    parser = build_parser()
    args = parser.parse_args([])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    dests = {a.dest for a in parser._actions}
    for f in dataclasses.fields(EngineArgs):
        assert f.name in dests, f"--{f.name.replace('_', '-')} missing"
        assert f.metadata.get("help"), f"{f.name} has no help"


def test_flags_parse_into_engine_args():
    args = build_parser().parse_args([
        "--model", "m", "--dtype", "float32", "--block-size", "32", "--kv-cache-memory", "512MiB",
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--linear-impl", "torch", "--attention-backend", "torch",
        "--skip-tokenizer-init", "--device", "cpu", "--port", "9000"])
    e = EngineArgs.from_cli_args(args)
    assert (e.model, e.dtype, e.block_size, e.kv_cache_memory, e.max_num_seqs) == ("m", "float32", 32, 2**29, 8)
    assert not e.enable_prefix_caching and e.linear_impl == "torch" and e.skip_tokenizer_init
    assert e.attention_backend == "torch" and args.port == 9000


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(block_size=8)
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(dtype="float64")
    with pytest.raises(ValueError, match="torch device"):
        EngineArgs(device="gpu-please")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineArgs(kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=2**40)  # the core counts in int32
    for kw in (dict(block_size=16.0), dict(num_kv_blocks=2.5), dict(block_size="16"), dict(max_num_seqs=True)):
        with pytest.raises(TypeError):
            EngineArgs(**kw)
    assert EngineArgs(kv_cache_memory="512MiB").kv_cache_memory == 2**29
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--attention-backend", "nope"])


def test_the_linear_method_is_one_option_with_vllms_quantization_as_its_other_spelling():
    """--linear-impl names every linear method; --quantization q4|int8 (vLLM's flag, LLM's quantization=
    keyword) sets that same option, and naming two different methods is refused by name."""
    parse = build_parser().parse_args
    assert EngineArgs.from_cli_args(parse(["--quantization", "q4"])).linear_impl == "q4"
    assert EngineArgs.from_cli_args(parse(["--linear-impl", "int8"])).linear_impl == "int8"
    assert EngineArgs.from_cli_args(parse(["--quantization", "int8", "--linear-impl", "int8"])).linear_impl == "int8"
    assert EngineArgs.from_cli_args(parse(["--quantization", "none"])).linear_impl == "auto"
    assert EngineArgs(quantization="q4").linear_impl == "q4"
    assert "quantization" not in {f.name for f in dataclasses.fields(EngineArgs)}  # one field, not two
    with pytest.raises(ValueError, match="name two linear methods"):
        EngineArgs.from_cli_args(parse(["--quantization", "q4", "--linear-impl", "torch"]))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="q3")
    with pytest.raises(ValueError, match="linear_impl must be one of"):
        EngineArgs(linear_impl="q3")
    for method in ("gguf", "q4", "int8"):  # refused by name before any file is read or converted
        with pytest.raises(ValueError, match=f"--linear-impl {method} runs our CPU kernels: not on device meta"):
            LLM(linear_impl=method, device="meta")


def test_llm_takes_keywords_only():
    with pytest.raises(TypeError):
        LLM("some-model")
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(no_such_option=1)


def test_help_lists_the_registered_backends():
    out = subprocess.run([sys.executable, "-m", "pagedserve.server", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "{auto,cpu,torch}" in out.replace("\n", "").replace(" ", "") or "auto,cpu,torch" in out
    assert "--dtype" in out and "--device" in out and "--no-enable-prefix-caching" in out
