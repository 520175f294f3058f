"""The chat's turns with a model loaded in this process: an LLMEngine, the
prompt built with the model's chat template, each answer streamed as the engine
steps produce its tokens."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

from ..config import EngineArgs
from ..sampling_params import SamplingParams
from .chat import ChatError


class EngineChat:
    """Chat completions from an in-process LLMEngine.

    Args:
        engine_args: the engine to load (the server's engine flags).
        temperature: sampling temperature (0 = greedy).
        max_tokens: output tokens per answer at most (None: what the context leaves).
    Raises:
        ValueError when the model has no tokenizer or no chat template; whatever
        LLMEngine raises for a model or flag it cannot serve.
    """

    def __init__(self, engine_args: EngineArgs, temperature: float, max_tokens: int | None) -> None:
        from ..engine.llm_engine import LLMEngine

        self.engine = LLMEngine(engine_args)
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.engine.model_name} has no tokenizer with a chat template to chat with")
        self.temperature, self.max_tokens = temperature, max_tokens

    def describe(self) -> str:
        """'<model> (in-process)'."""
        return f"{self.engine.model_name} (in-process)"

    def stream(self, messages: list[dict]) -> Iterator[str]:
        """Yields the answer's text pieces to `messages`, one per engine step that
        releases text. Closing the generator early aborts the request (its KV
        blocks are freed). Raises ChatError when the engine refuses the request
        (e.g. the conversation no longer fits the model's context)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids  # the template wrote BOS etc.
        room = self.engine.max_model_len - len(ids)
        try:
            params = SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens or max(room, 1))
            request_id = self.engine.add_request(ids, params)
        except ValueError as e:
            raise ChatError(f"{e} (/reset starts a new conversation)") from e
        finished = False
        try:
            while not finished:
                with _sigint_deferred():
                    outputs = self.engine.step()
                for out in outputs:
                    if out.request_id == request_id:
                        finished = out.finished
                        if out.outputs[0].delta_text:
                            yield out.outputs[0].delta_text
        finally:
            if not finished:
                self.engine.abort_request(request_id)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) while the block runs and raises KeyboardInterrupt
    when it ends, so that an engine step is never cut between the scheduler's
    decision and its update. Main thread only (signal.signal)."""
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
