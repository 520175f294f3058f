"""Chat templates PagedServe ships (Jinja files beside this module), chosen with
``--chat-template NAME``; any other value is read as a path to a Jinja file."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent

# name -> file; one line each on what it is for
BUNDLED = {
    "chatml-tools": "chatml_tools.jinja",  # ChatML with tool calls in <tool_call> tags (SmolLM2 and other ChatML models)
    "llama3-json-tools": "llama3_json_tools.jinja",  # Llama 3 turns, JSON calls after <|python_tag|> (llama3_json)
    "mistral-tools": "mistral_tools.jinja",  # [INST] turns, [TOOL_CALLS] + a JSON array (mistral)
    "pythonic-tools": "pythonic_tools.jinja",  # ChatML, calls as a Python list [f(a=1)] (pythonic)
}


def load_chat_template(name_or_path: str) -> str:
    """The Jinja source of a bundled template (by name) or of a file (by path).

    Raises ValueError when it is neither a bundled name nor a readable file.
    """
    if name_or_path in BUNDLED:
        return (_HERE / BUNDLED[name_or_path]).read_text()
    path = Path(name_or_path).expanduser()
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"chat_template: '{name_or_path}' is neither a bundled template "
                         f"({', '.join(BUNDLED)}) nor a readable file ({e.strerror})") from e
