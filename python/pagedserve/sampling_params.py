"""SamplingParams: how to sample one request's continuation (vLLM's names,
OpenAI-shaped values)."""

from __future__ import annotations

from dataclasses import dataclass, field

_INT32_MAX = 2**31 - 1
_MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (as vLLM does)
_MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass
class StructuredOutputsParams:
    """A constraint on the output text (vLLM's StructuredOutputsParams): exactly
    one field is set. Enforced by grammar-constrained decoding: before each
    token is sampled, the tokens the grammar cannot accept next are masked
    (xgrammar, Dong et al. 2024), so the output always is a prefix of a
    sentence of the grammar, and a complete one when it ends by EOS.

    Attributes:
        json: a JSON schema (dict, or its JSON text): the output is one JSON
            value valid under it.
        json_object: True: the output is any JSON object.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF as llama.cpp writes it; rule `root`).
    Raises:
        ValueError from __post_init__ when not exactly one field is set or a
        value has the wrong type (an invalid schema, regex or grammar is found
        when it is compiled: pagedserve.structured_output).
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    FIELDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        set_ = self._fields_set()
        if len(set_) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(self.FIELDS)}; got "
                             f"{', '.join(set_) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs' choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs' {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured outputs' json must be a JSON schema (an object or its JSON text)")

    def _fields_set(self) -> list[str]:
        return [name for name in self.FIELDS if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The name of the field that is set."""
        return self._fields_set()[0]


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request.

    Attributes:
        n: sequences to return (parallel sampling: the prompt is prefilled once,
            then forked; the choices share its KV blocks until they write).
        temperature: 0 = greedy (argmax); else logits / temperature.
        top_p: nucleus sampling mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off.
        seed: torch.Generator seed; same seed -> same samples whatever else is
            in the batch. Choice i samples with choice_seed(i).
        max_tokens: output tokens at most (>= 1).
        stop: strings that end the output; they are not included in the text
            unless include_stop_str_in_output.
        include_stop_str_in_output: keep the stop string that ended the output at
            the end of its text (vLLM's).
        stop_token_ids: token ids that end the output (kept in token_ids).
        ignore_eos: keep generating past EOS (benchmarks).
        skip_special_tokens: drop special tokens from the text.
        presence_penalty: in [-2, 2], logit units; subtracted once from the logit
            of every token that already appears in this choice's OUTPUT (prompt
            tokens do not count). > 0 favours new tokens. OpenAI API semantics,
            as vLLM. 0 = off.
        frequency_penalty: in [-2, 2], logit units per occurrence; subtracted
            count(token in this choice's OUTPUT) times from its logit. OpenAI /
            vLLM. 0 = off.
        repetition_penalty: in (0, 2] (vLLM only requires > 0; 2 is this
            server's cap), dimensionless factor; every distinct
            token of the prompt OR the output has its logit divided by it when
            positive, multiplied by it otherwise (CTRL, Keskar et al. 2019, as
            Hugging Face and vLLM). > 1 discourages repeats; 1 = off.
        min_p: in [0, 1]; after temperature, tokens whose probability is below
            min_p * (probability of the most likely token) are dropped (vLLM,
            Nguyen et al. 2024 "min-p sampling"). 0 = off.
        logprobs: None, or 0..20: per sampled token, return its logprob and the
            `logprobs` most likely alternatives (0 = only the sampled token's).
            Natural-log probabilities of the raw model logits, before penalties
            and temperature (vLLM V1's default "raw_logprobs"; OpenAI's
            top_logprobs).
        prompt_logprobs: None, or 0..20: the same for every prompt token after
            the first (vLLM; OpenAI completions' echo + logprobs).
        structured_outputs: None, or a StructuredOutputsParams constraining
            every choice's output (JSON schema, regex, choice, grammar).
        min_tokens: output tokens before EOS (unless ignore_eos) and
            stop_token_ids may be sampled and stop strings end the output
            (vLLM's); <= max_tokens. 0 = off.
        logit_bias: None, or {token id: bias in [-100, 100]} added to those
            logits before penalties and sampling (OpenAI's; logprobs stay raw).
        allowed_token_ids: None, or the only token ids that may be sampled
            (vLLM's; non-empty).
        bad_words: words that must not be generated (vLLM's): each is
            tokenized as it is and with one leading space (LLMEngine.add_request
            fills bad_words_token_ids), and a sequence's last token is masked
            wherever the output so far ends with the tokens before it.
        bad_words_token_ids: the token-id sequences of bad_words (set by the
            engine from its tokenizer; may be given directly instead).
        reasoning_ended: with a reasoning parser, whether the prompt itself
            closed the reasoning (the server decides it from what the chat
            template added); None: the engine looks at the prompt's last tokens.
    Raises:
        ValueError from __post_init__ on an out-of-range value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    reasoning_ended: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_tokens > _INT32_MAX:
            raise ValueError(f"max_tokens must be at most {_INT32_MAX}, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= _MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {_MAX_LOGPROBS}], got {value}")
        bad = [t for t in self.stop_token_ids if not 0 <= t <= _INT32_MAX]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids, got {bad[0]}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            for t, b in self.logit_bias.items():
                if not 0 <= t <= _INT32_MAX or not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias must map token ids to biases in [-100, 100], got {t}: {b}")
            self.logit_bias = self.logit_bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or any(not 0 <= t <= _INT32_MAX for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids}")

        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
            if any(not w or any(not 0 <= t <= _INT32_MAX for t in w) for w in self.bad_words_token_ids):
                raise ValueError("bad_words_token_ids must be non-empty lists of token ids")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words}")
        if self.structured_outputs is not None:
            self._check_enforceable()

    def _check_enforceable(self) -> None:
        """Raises UnenforceableConstraintError for a field the constraint
        could not be honoured together with: min_tokens (the grammar may end
        sooner), stop strings and stop_token_ids (they could cut the output
        before the grammar completes), allowed_token_ids and bad words (the
        grammar may need a token they forbid: no token would be left to draw)."""
        from .errors import UnenforceableConstraintError

        conflicts = (("min_tokens", self.min_tokens > 0, "the grammar decides where the output ends"),
                     ("stop", bool(self.stop), "a stop string could end the output before the grammar is complete, "
                                              "an answer cut short that would still say it stopped"),
                     ("stop_token_ids", bool(self.stop_token_ids),
                      "a stop token could end the output before the grammar is complete"),
                     ("allowed_token_ids", self.allowed_token_ids is not None,
                      "the grammar may need a token it leaves out"),
                     ("bad_words", bool(self.bad_words or self.bad_words_token_ids),
                      "the grammar may need a token they forbid"))
        for name, given, why in conflicts:
            if given:
                raise UnenforceableConstraintError(
                    name, f"`{name}` cannot be enforced together with a structured-output constraint "
                          f"(response_format, tool_choice required or named, structured_outputs): {why}")

    @property
    def has_token_filters(self) -> bool:
        """min_tokens, logit_bias, allowed_token_ids or bad words is set: the
        sampler changes the logits per row before choosing."""
        return (self.min_tokens > 0 or self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    def choice_seed(self, index: int) -> int | None:
        """The generator seed of choice `index`: seed itself for choice 0, then
        well-spread values derived from it (None when unseeded)."""
        if self.seed is None:
            return None
        return (self.seed + index * 0x9E3779B97F4A7C15) % 2**63

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (penalised) logits
        (temperature below 1e-5, where logits / temperature would overflow, or
        top_k 1)."""
        return self.temperature < _MIN_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalty is on (the
        sampler then needs the token history of each choice)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
