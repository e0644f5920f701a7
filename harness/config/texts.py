"""Built-in prompt texts: English prose the harness can score perplexity on without a download.

`prompt=NAME` with a name of BUILTIN_TEXTS takes that text instead of a file (any other value is a
path; a file that happens to carry such a name is given as `./NAME`). The text is tokenized with the
checkpoint's tokenizer like a text file, and hashed like one (harness.measure.prompts): the row's
`prompt` is the name, its `prompt_hash` the text's and tokenizer's content, so a Python whose copy of
the text differs gives other keys.

- `python-docs`: the topic pages of the Python Language Reference that `pydoc` shows for `help("if")`
  and the like, shipped with the standard library as `pydoc_data.topics` (under the Python Software
  Foundation License, as Python itself). Every topic in the order of its name, separated by a blank
  line: about 465,000 characters of technical English prose with grammar rules and short code
  examples (Python 3.11). The topics are the same text that https://docs.python.org serves.
"""
from __future__ import annotations

BUILTIN_TEXTS = {  # name -> where the text comes from
    "python-docs": "pydoc_data.topics (the Python Language Reference's topic pages, PSF license)",
}


def is_builtin_text(prompt: object) -> bool:
    return isinstance(prompt, str) and prompt in BUILTIN_TEXTS


def builtin_text(name: str) -> str:
    """The text `name` stands for (a name of BUILTIN_TEXTS)."""
    if name == "python-docs":
        from pydoc_data.topics import topics  # a 0.5 MB module: imported only by a point that uses it

        return "\n\n".join(topics[topic] for topic in sorted(topics))
    raise KeyError(f"{name!r} is not a built-in text; known: {', '.join(BUILTIN_TEXTS)}")
