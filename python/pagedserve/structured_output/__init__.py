"""Grammar-constrained decoding (structured outputs): compile a request's
StructuredOutputsParams into a grammar once, keep one matcher per choice, mask
the logits of the tokens the grammar cannot take next, advance the matcher by
every sampled token. The grammar engine is xgrammar (Dong et al. 2024,
"XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models"), a dependency."""

from .manager import GrammarState, StructuredOutputManager

__all__ = ["GrammarState", "StructuredOutputManager"]
