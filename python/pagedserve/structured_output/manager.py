"""StructuredOutputManager (the engine's, one per tokenizer) and GrammarState
(one per choice of a constrained request)."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from ..errors import InvalidStructuredOutputError
from ..sampling_params import StructuredOutputsParams
from .limits import check_schema, check_size


CACHE_LIMIT_BYTES = 256 * 2**20  # compiled grammars kept (bytes); least recently used go first


class GrammarState:
    """Where one choice's output stands in its grammar (an xgrammar matcher).

    The output tokens it has accepted are the choice's output tokens, which a
    preempted sequence keeps (recompute rebuilds only the KV cache), so the
    state survives preemption unchanged.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` ([V] float32 on the CPU) with every token the
        grammar cannot take next set to -inf."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.unsqueeze(0).clone()
        xgr.apply_token_bitmask_inplace(out, self._bitmask, vocab_size=self.vocab_size)
        return out[0]

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar can take next."""
        return torch.isfinite(self.mask_logits(torch.zeros(self.vocab_size)))

    def fork(self) -> GrammarState:
        """An independent copy at the same point of the grammar (xgrammar's
        GrammarMatcher.fork): advancing one leaves the other where it was."""
        return GrammarState(self.matcher.fork(), self.vocab_size)

    def admits_any(self) -> bool:
        """True when the grammar allows at least one next token (or its end)."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return bool(self._bitmask.any())

    def accept(self, token_id: int) -> bool:
        """Advances the grammar by a sampled token; False if the grammar refuses
        it (which masking prevents; a stop string or EOS may still end the
        output earlier)."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """True once the grammar has accepted its end (a stop token after a
        complete sentence): nothing more may follow."""
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and hands out matchers.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the width of the model's logits (tokens); may exceed the
            tokenizer's vocabulary (padding rows are always masked).
        eos_token_ids: tokens that end a sentence of the grammar.

    Compiled grammars are cached by xgrammar (by constraint text, at most
    CACHE_LIMIT_BYTES), so the same schema is compiled once. Compiling is thread-safe: the server compiles on a
    worker thread before a request reaches the engine thread, whose own
    compile then hits the cache.

    JSON schemas are compiled without free whitespace (one space after ':' and
    ','): small models otherwise tend to emit whitespace until max_tokens.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of a constraint.

        Raises InvalidStructuredOutputError (a ValueError) naming the field
        when the schema, regex or grammar is invalid or unsupported, uses a
        keyword the backend would ignore, is larger than limits.py allows, or
        admits no first token at all (e.g. a schema that only refers to itself).
        """
        self.check(params)
        compiled = self._compile(params)
        if not self.new_states(compiled, 1)[0].admits_any():
            raise InvalidStructuredOutputError(params.kind, f"invalid {_WHAT[params.kind]}: no output satisfies it")
        return compiled

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        """What needs no compiling (milliseconds): the size limits and, for a JSON
        schema, that it parses and uses no keyword the backend would ignore
        (limits.py). Raises InvalidStructuredOutputError naming the field."""
        check_size(params)
        if params.kind == "json":
            try:
                check_schema(json.loads(_schema_text(params)))
            except InvalidStructuredOutputError:
                raise
            except (ValueError, RecursionError) as e:  # text that is not JSON, nesting deeper than Python recurses
                raise InvalidStructuredOutputError("json", f"invalid {_WHAT['json']}: {e}") from e

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(_schema_text(params), any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            return self.compiler.compile_grammar(params.grammar)
        except InvalidStructuredOutputError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            if "] " in reason and reason.startswith("["):  # xgrammar's "[time] file:line: message"
                reason = reason.split(": ", 1)[-1]
            raise InvalidStructuredOutputError(kind, f"invalid {_WHAT[kind]}: {reason}") from e

    def new_states(self, compiled: xgr.CompiledGrammar, n: int) -> list[GrammarState]:
        """n fresh GrammarStates (one per choice), at the grammar's start."""
        return [GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size) for _ in range(n)]


def _schema_text(params: StructuredOutputsParams) -> str:
    """A json constraint's schema as JSON text."""
    return params.json if isinstance(params.json, str) else json.dumps(params.json)


_WHAT = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}
