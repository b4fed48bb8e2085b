"""Constrained decoding and the sampler's per-lane controls, as pure pieces (docs/protocol.md
section 12.3, docs/engine.md section 2.4).

Three layers, each usable alone:

1. **From a request to a constraint** (the head): :func:`response_format_grammar`,
   :func:`tools_grammar` and :func:`sampler_controls` turn what an OpenAI client sends
   (``response_format``; ``tools``, ``tool_choice``, ``parallel_tool_calls``; ``logit_bias`` and
   the penalties) into the wire's :class:`~sfnode.linkf.wire.Grammar` and
   :class:`~sfnode.linkf.wire.SamplerControls`, and :func:`check_grammar` asks the grammar library
   whether it can honour the grammar, without a tokenizer.  Every refusal is a
   :class:`ConstraintError` naming the request field, which an HTTP layer answers with a 400.
   :func:`shortest_answer` is the fewest tokens of an answer a node closes a grammar's
   output with, so that a budget too small for any answer is refused before it is placed.
   :func:`tools_system_text` is the generic rendering of tools for chat templates that know
   none: the tools described in the system turn (the head reads the calls back out of the
   output, ``sfnode.head.models.tools``).
2. **A grammar's text**: :func:`grammar_text` writes each wire variant in llguidance's
   Lark-like syntax (JSON Schemas embedded with ``%json``), the languages section 12.3 defines.
3. **A lane's stage** (the node): a :class:`Vocabulary` binds the grammar library to a model's
   tokenizer; a :class:`LaneStage` holds one generation's :class:`Matcher` (advanced by each
   accepted token, the allowed-token mask, rollback, and the replay of tokens delivered before
   a failover, and its budget's closing, :mod:`sfnode.decoding.closing`) and the counts its
   penalties need.  The engines apply a stage between the logits and the draw: logit bias,
   repetition penalty, presence and frequency penalties, then the grammar's mask.

Everything a stage does is a function of the grammar, the controls, the budget and the tokens
of the stream, so a lane gives the same masks alone or batched, and a node that takes over a stream
replays the delivered tokens and continues it exactly.

This module must never import torch (the head imports it), touch a model, start a thread or
read the reactor; llguidance releases the GIL while it computes masks, so an engine calls
:meth:`MaskFiller.fill` from a thread of its own while its forward pass runs.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sfnode.linkf.wire import (
    LOGIT_BIAS_RANGE,
    MAX_GRAMMAR_BYTES,
    MAX_LOGIT_BIAS,
    MAX_REPETITION_WINDOW,
    PENALTY_RANGE,
    REPETITION_RANGE,
    Constraint,
    Grammar,
    JsonObjectGrammar,
    JsonSchemaGrammar,
    SamplerControls,
    ToolChoice,
    ToolsGrammar,
)

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from sfnode.decoding.closing import TokenTable

CALL_OPEN = "<tool_call>"
"""What opens a tool call in the generic rendering (docs/protocol.md section 12.3)."""
CALL_CLOSE = "</tool_call>"
"""What closes it."""
CALL_SEPARATOR = "\n"
"""What stands between two calls of one answer."""
JSON_ITEM_SEPARATOR = ", "
JSON_KEY_SEPARATOR = ": "
DEFAULT_REPETITION_WINDOW = 64
"""llama.cpp's ``repeat_last_n``."""

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": JSON_ITEM_SEPARATOR,
    "key_separator": JSON_KEY_SEPARATOR,
}
"""How the grammar writes JSON: one line, ``, `` between items, ``: `` after keys, no other
whitespace outside strings (a small model left free to indent tends to loop on whitespace)."""


class ConstraintError(ValueError):
    """A constraint that cannot be honoured: a malformed request field, a schema the grammar
    library cannot enforce, or delivered tokens the grammar does not allow.

    ``param`` names the request field at fault (``response_format``, ``tools``,
    ``tool_choice``, ``logit_bias``, ...), as an OpenAI error's ``param`` does.
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# --------------------------------------------------------------------------------------------
# 1. From a request to a constraint (the head)


def response_format_grammar(response_format: Any, *, check: bool = True) -> Grammar | None:
    """The grammar of OpenAI's ``response_format``: None for ``{"type": "text"}`` (or None),
    :class:`JsonObjectGrammar` for ``json_object``, :class:`JsonSchemaGrammar` for
    ``json_schema`` (whose ``json_schema.schema`` is required and must compile: ``check``
    false leaves the compiling to the caller, :func:`check_grammar`).

    :raises ConstraintError: with ``param`` ``response_format``.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ConstraintError("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        grammar: Grammar = JsonObjectGrammar()
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ConstraintError(
                "response_format.json_schema must be an object with a schema", "response_format"
            )
        schema = spec.get("schema")
        if schema is None:
            raise ConstraintError(
                "response_format.json_schema.schema is required", "response_format"
            )
        if not isinstance(schema, Mapping | bool):
            raise ConstraintError(
                "response_format.json_schema.schema must be a JSON Schema object",
                "response_format",
            )
        grammar = JsonSchemaGrammar(_json_text(schema, "response_format"))
    else:
        raise ConstraintError(
            f"response_format.type must be text, json_object or json_schema, not {kind!r}",
            "response_format",
        )
    if check:
        check_grammar(grammar, "response_format")
    return grammar


def tools_grammar(
    tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None, *, check: bool = True
) -> ToolsGrammar | None:
    """The grammar of OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
    (``check`` false: not compiled here, as in :func:`response_format_grammar`).

    None when there are no tools (and ``tool_choice`` is absent or ``none``).  ``tool_choice``
    defaults to ``auto`` with tools; ``none`` still constrains (the output may not open a
    call), ``required`` and ``{"type": "function", "function": {"name": ...}}`` allow only
    calls.  ``parallel_tool_calls`` (default true) false allows one call.

    :raises ConstraintError: with ``param`` ``tools``, ``tool_choice`` or
        ``parallel_tool_calls``.
    """
    if tools is None or (isinstance(tools, list) and not tools):
        if tool_choice in (None, "none"):
            return None
        raise ConstraintError("tool_choice needs tools", "tool_choice")
    if not isinstance(tools, list):
        raise ConstraintError("tools must be an array of function tools", "tools")
    functions: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ConstraintError(f"{where} must be a function tool", "tools")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ConstraintError(f"{where}.function must be an object", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise ConstraintError(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -", "tools"
            )
        if name in names:
            raise ConstraintError(f"{where}.function.name {name!r} is declared twice", "tools")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, Mapping):
            raise ConstraintError(f"{where}.function.parameters must be an object", "tools")
        functions.append({"name": name, "parameters": dict(parameters)})
    choice, function_name = _tool_choice(tool_choice, names)
    if parallel_tool_calls is None:
        parallel = True
    elif isinstance(parallel_tool_calls, bool):
        parallel = parallel_tool_calls
    else:
        raise ConstraintError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    grammar = ToolsGrammar(_json_text(functions, "tools"), choice, function_name, parallel)
    if check:
        check_grammar(grammar, "tools")
    return grammar


def _tool_choice(tool_choice: Any, names: set[str]) -> tuple[ToolChoice, str]:
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice.AUTO, ""
    if tool_choice == "none":
        return ToolChoice.NONE, ""
    if tool_choice == "required":
        return ToolChoice.REQUIRED, ""
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise ConstraintError("tool_choice.function.name is required", "tool_choice")
        if name not in names:
            raise ConstraintError(
                f"tool_choice names {name!r}, which is not among the declared tools",
                "tool_choice",
            )
        return ToolChoice.FUNCTION, name
    raise ConstraintError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def sampler_controls(
    *,
    logit_bias: Any = None,
    presence_penalty: Any = None,
    frequency_penalty: Any = None,
    repetition_penalty: Any = None,
    repetition_window: Any = None,
    vocab_size: int | None = None,
) -> SamplerControls | None:
    """The :class:`SamplerControls` of OpenAI's ``logit_bias`` (token id, as a string or an
    integer, to a bias in -100..100), ``presence_penalty`` and ``frequency_penalty`` (-2..2)
    and llama.cpp's ``repetition_penalty`` (0..10; 1 is off) over ``repetition_window`` tokens
    (default 64); None when they change nothing.  With ``vocab_size`` a token id past the
    vocabulary is refused.

    :raises ConstraintError: naming the field at fault.
    """
    bias: dict[int, float] = {}
    if logit_bias is not None:
        if not isinstance(logit_bias, Mapping):
            raise ConstraintError("logit_bias must map token ids to biases", "logit_bias")
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise ConstraintError(
                f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias"
            )
        for key, value in logit_bias.items():
            token = _token_id(key)
            if token is None or (vocab_size is not None and token >= vocab_size):
                raise ConstraintError(f"logit_bias: {key!r} is not a token id", "logit_bias")
            bias[token] = _number(value, LOGIT_BIAS_RANGE, "logit_bias")
    controls = SamplerControls(
        logit_bias=tuple(sorted((t, b) for t, b in bias.items() if b)),
        presence_penalty=_number(presence_penalty, PENALTY_RANGE, "presence_penalty"),
        frequency_penalty=_number(frequency_penalty, PENALTY_RANGE, "frequency_penalty"),
        repetition_penalty=_number(repetition_penalty, REPETITION_RANGE, "repetition_penalty"),
        repetition_window=_window(repetition_window),
    )
    return None if controls.empty else controls


def _token_id(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key if key >= 0 else None
    # A token id is a u32: at most 10 digits, checked before int() (which refuses more than
    # 4300 digits with a ValueError, and takes quadratic time below that).
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    return None


def _number(value: Any, bounds: tuple[float, float], param: str) -> float:
    if value is None:
        return 0.0
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and math.isnan(value))
    ):
        raise ConstraintError(f"{param} must be a number", param)
    low, high = bounds
    if not low <= value <= high:
        raise ConstraintError(f"{param} must be between {low:g} and {high:g}", param)
    return float(value)


def _window(value: Any) -> int:
    if value is None:
        return DEFAULT_REPETITION_WINDOW
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConstraintError("repetition_window must be an integer", "repetition_window")
    if not 0 <= value <= MAX_REPETITION_WINDOW:
        raise ConstraintError(
            f"repetition_window must be between 0 and {MAX_REPETITION_WINDOW}",
            "repetition_window",
        )
    return value


def _json_text(value: Any, param: str) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"{param} is not JSON: {e}", param) from e
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"{param} is longer than {MAX_GRAMMAR_BYTES} bytes as JSON", param)
    return text


# --------------------------------------------------------------------------------------------
# The generic rendering of tools (for chat templates that know none)


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The generic rendering's description of ``tools`` (OpenAI's ``tools`` array, already
    checked by :func:`tools_grammar`), for the system turn of a chat template that does not
    render tools itself: what a call looks like, then one line of JSON per function with its
    name, description and parameters (docs/protocol.md section 12.3)."""
    lines = [
        "You can call functions. To call one, write exactly",
        f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments as a JSON object>}}'
        f"{CALL_CLOSE}",
        "and nothing else. The functions:",
    ]
    for tool in tools:
        function = tool["function"]
        entry: dict[str, Any] = {"name": function["name"]}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# 2. A grammar's text (llguidance's Lark-like syntax)


def grammar_text(grammar: Grammar) -> str:
    """The grammar library's text of a wire grammar: the language docs/protocol.md section
    12.3 gives each variant.

    :raises ConstraintError: ``param`` ``grammar`` when its JSON text is not what the variant
        needs (a schema that is no JSON, tools that are no array of named functions).
    """
    if isinstance(grammar, JsonObjectGrammar):
        return _lark("start: body", _json_rule({"type": "object"}))
    if isinstance(grammar, JsonSchemaGrammar):
        schema = _loads(grammar.schema)
        if not isinstance(schema, dict | bool):
            raise ConstraintError("the schema is not a JSON Schema object", "grammar")
        return _lark("start: body", _json_rule(schema))
    return _tools_text(grammar)


def _tools_text(grammar: ToolsGrammar) -> str:
    functions = _loads(grammar.tools)
    if not isinstance(functions, list) or not all(
        isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions
    ):
        raise ConstraintError("tools is not an array of named functions", "grammar")
    if grammar.choice is ToolChoice.FUNCTION:
        functions = [f for f in functions if f["name"] == grammar.function]
        if not functions:
            raise ConstraintError(f"no declared tool is named {grammar.function!r}", "grammar")
    # Text of the answer: anything but the opening of a call (special tokens never match).
    text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(CALL_OPEN)}.*)/"
    if grammar.choice is ToolChoice.NONE or not functions:
        return _lark("start: TEXT", text)
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters", {"type": "object"}),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    close = json.dumps(CALL_CLOSE)
    more = f"more: {json.dumps(CALL_SEPARATOR + CALL_OPEN)} body {close}"
    tail = " more*" if grammar.parallel else ""
    if grammar.choice is ToolChoice.AUTO:
        # Text, then maybe calls: the lazy lexeme ends at the first opening tag, after
        # which the call is held to the grammar (llama.cpp's lazy grammar, as one grammar).
        opening = f"opening[lazy]: /(?s:.*){re.escape(CALL_OPEN)}/"
        start = f"start: TEXT | opening body {close}{tail}"
        return _lark(start, text, opening, more, _json_rule(calls))
    start = f"start: {json.dumps(CALL_OPEN)} body {close}{tail}"
    return _lark(start, more, _json_rule(calls))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConstraintError(f"the grammar's JSON text does not parse: {e}", "grammar") from e


def _json_rule(schema: Mapping[str, Any] | bool) -> str:
    """``body`` as a JSON value that validates against ``schema``, written as
    :data:`_JSON_OPTIONS` says."""
    if schema is True:
        schema = {}
    elif schema is False:
        schema = {"not": {}}
    assert isinstance(schema, Mapping)
    return "body: %json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def _lark(*rules: str) -> str:
    return "\n".join(('%llguidance {"no_forcing": true}', *rules)) + "\n"


def check_grammar(grammar: Grammar, param: str = "grammar") -> None:
    """Whether the grammar library can honour ``grammar`` (compiled without a tokenizer).

    :raises ConstraintError: with ``param``, and the library's reason.
    """
    try:
        text = grammar_text(grammar)
    except ConstraintError as e:
        raise ConstraintError(e.message, param) from e
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(text))
    if error:
        raise ConstraintError(f"{_what(grammar)} cannot be enforced: {_first_line(error)}", param)


def shortest_answer(vocabulary: Vocabulary, grammar: Grammar) -> int | None:
    """The tokens of the shortest answer a node closes ``grammar``'s output with, its EOS
    included: a ``max_new`` below it cannot give a whole answer, and a head can refuse such a
    request before placing it (docs/protocol.md section 12.6).  None when no answer is within
    the closing walk's reach (:data:`~sfnode.decoding.closing.MAX_CLOSING_BYTES`).

    :raises ConstraintError: the grammar cannot be built for this vocabulary.
    """
    return Matcher(vocabulary, grammar).closing_length()


def _what(grammar: Grammar) -> str:
    if isinstance(grammar, JsonSchemaGrammar):
        return "the JSON schema"
    if isinstance(grammar, ToolsGrammar):
        return "the tools' parameters"
    return "the grammar"


def _first_line(error: str) -> str:
    # The library prefixes where in the grammar's text it was ("at 3(7): "): that text is ours.
    error = re.sub(r"^at \d+\(\d+\): ", "", error.strip())
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    # The library's first line says what; a regex error says it on a later line.
    detail = next((line for line in lines if line.startswith("error:")), "")
    return f"{lines[0]} ({detail})" if detail and detail != lines[0] else lines[0]


# --------------------------------------------------------------------------------------------
# 3. A lane's stage (the node)


class Vocabulary:
    """A model's tokens as the grammar library reads them: its tokenizer, the width of its
    logits (``size``, which may exceed the tokenizer's) and its EOS ids.

    Reading the whole vocabulary takes about a second and some 20 MB for 49,152 tokens: it is
    read once, when a constraint first needs it (:attr:`tokenizer`, :attr:`table`), so a node
    that serves no constrained request never holds it.
    """

    def __init__(self, tokenizer_json: str, *, size: int, eos_ids: Iterable[int]) -> None:
        self.size = size
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        if not self.eos_ids:
            raise ValueError("a vocabulary for constraints needs at least one EOS id")
        self.words = (size + 31) // 32
        """int32 words of one mask row."""
        self._json: str | None = tokenizer_json
        self._read: tuple[Any, TokenTable] | None = None
        self._reading = threading.Lock()

    def _tables(self) -> tuple[Any, TokenTable]:
        """The grammar library's tokenizer and the token table, read on first use (by
        whichever thread needs them first; the others wait for it)."""
        read = self._read
        if read is not None:
            return read
        with self._reading:
            if self._read is None:
                import llguidance

                from sfnode.decoding.closing import TokenTable

                assert self._json is not None
                tokenizer = llguidance.LLTokenizer(
                    self._json, n_vocab=self.size, eos_token=sorted(self.eos_ids)
                )
                self._read = (tokenizer, TokenTable(tokenizer, self.size, min(self.eos_ids)))
                self._json = None
            return self._read

    @property
    def tokenizer(self) -> Any:
        """The grammar library's ``LLTokenizer``."""
        return self._tables()[0]

    @property
    def table(self) -> TokenTable:
        """Its tokens as bytes, for the closings of budgets (:mod:`sfnode.decoding.closing`)."""
        return self._tables()[1]

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, *, size: int, eos_ids: Iterable[int]) -> Vocabulary:
        """From a ``tokenizer.json`` text, or a transformers fast tokenizer (its backend's
        JSON, added tokens included)."""
        if isinstance(tokenizer, str):
            return cls(tokenizer, size=size, eos_ids=eos_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("constraints need a fast tokenizer (a tokenizers backend)")
        return cls(backend.to_str(), size=size, eos_ids=eos_ids)

    def encode(self, text: str) -> list[int]:
        """``text`` as the tokenizer splits it (no special tokens)."""
        return list(self.tokenizer.tokenize_str(text))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode_str(list(tokens)))

    def new_masks(self, rows: int) -> NDArray[np.int32]:
        """A bitmask of ``rows`` rows, every token allowed."""
        import numpy as np

        return np.full((rows, self.words), -1, dtype=np.int32)

    def allowed(self, masks: NDArray[np.int32], row: int) -> NDArray[np.intp]:
        """The ids a mask row allows, ascending."""
        import numpy as np

        bits = np.unpackbits(masks[row].view(np.uint8), bitorder="little")[: self.size]
        return np.flatnonzero(bits)


class Matcher:
    """Where one generation stands in its grammar.

    Tokens the output has (sampled, or delivered before a failover) are :meth:`consume`\\ d in
    order; :meth:`fill` writes the tokens allowed next as one bit per token id: EOS ids only
    where the grammar may end (and nothing else once it must).  :meth:`rollback` takes back
    the last tokens.
    """

    def __init__(self, vocabulary: Vocabulary, grammar: Grammar) -> None:
        import llguidance

        from sfnode.decoding.closing import LaneBudget

        self.vocabulary = vocabulary
        text = grammar_text(grammar)
        self._matcher = llguidance.LLMatcher(
            vocabulary.tokenizer, llguidance.LLMatcher.grammar_from_lark(text), log_level=0
        )
        if self._matcher.is_error():
            raise ConstraintError(
                f"{_what(grammar)} cannot be enforced: {_first_line(self._matcher.get_error())}",
                "grammar",
            )
        self.consumed = 0
        """Tokens consumed so far."""
        self.budget = LaneBudget(vocabulary.table, vocabulary.eos_ids)
        """Its budget: set ``budget.limit``, the most tokens the output may have (counted as
        :attr:`consumed` is), and the masks close the output within it (docs/engine.md
        section 2.4)."""

    @property
    def accepting(self) -> bool:
        """Whether the output may end here."""
        return bool(self._matcher.is_accepting())

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more but an EOS id."""
        return bool(self._matcher.is_stopped())

    def consume(self, token: int) -> None:
        """Advance by ``token``.

        :raises ConstraintError: the grammar does not allow ``token`` here (the matcher is then
            unusable).
        """
        if not self._matcher.consume_token(token):
            raise ConstraintError(
                f"token {token} is not allowed after {self.consumed} tokens: "
                f"{_first_line(self._matcher.get_error())}",
                "grammar",
            )
        self.consumed += 1
        self.budget.advanced(token)

    def rollback(self, tokens: int) -> None:
        """Take back the last ``tokens`` consumed."""
        if not 0 <= tokens <= self.consumed:
            raise ValueError(f"cannot roll back {tokens} of {self.consumed} tokens")
        if tokens and not self._matcher.rollback(tokens):
            raise ConstraintError(
                f"rollback failed: {_first_line(self._matcher.get_error())}", "grammar"
            )
        self.consumed -= tokens
        self.budget.rolled_back(tokens)

    def fill(self, masks: NDArray[np.int32], row: int) -> None:
        """Write the tokens allowed next into ``masks[row]`` (see :class:`MaskFiller` for
        many at once)."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, masks, row)
        _end_only_where_allowed(masks, row, self.vocabulary)
        self.narrow(masks, row)

    def narrow(self, masks: NDArray[np.int32], row: int) -> None:
        """Narrow the grammar's mask in ``masks[row]`` to what the budget leaves room for
        (docs/engine.md section 2.4)."""
        self.budget.narrow(self._matcher, masks, row)

    def closing_length(self) -> int | None:
        """The tokens the output needs from here to end, its EOS included, as the budget
        counts them (None: no closing within reach, :mod:`sfnode.decoding.closing`)."""
        closing = self.budget.closing(self._matcher)
        return None if closing is None else closing.length

    def allowed(self) -> NDArray[np.intp]:
        """The ids allowed next, ascending."""
        masks = self.vocabulary.new_masks(1)
        self.fill(masks, 0)
        return self.vocabulary.allowed(masks, 0)


def _end_only_where_allowed(masks: NDArray[np.int32], row: int, vocabulary: Vocabulary) -> None:
    """A row that allows nothing (a grammar that cannot go on) allows the EOS ids: the lane
    may only end."""
    import numpy as np

    if not masks[row].any():
        for token in vocabulary.eos_ids:
            masks[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))


class MaskFiller:
    """Computes the masks of many matchers at once, on the grammar library's own threads with
    the GIL released; an engine calls :meth:`fill` from a thread of its own."""

    def __init__(self, vocabulary: Vocabulary, *, threads: int = 1) -> None:
        import llguidance

        self.vocabulary = vocabulary
        self._executor = llguidance.LLExecutor(num_threads=max(1, threads))

    def fill(
        self,
        matchers: Sequence[tuple[Matcher, int]],
        rows: int,
        *,
        into: NDArray[np.int32] | None = None,
    ) -> NDArray[np.int32]:
        """A bitmask of ``rows`` rows: ``matchers``' rows filled, every other row all ones (or
        as it was in ``into``, which is filled and returned instead of a new one)."""
        masks = self.vocabulary.new_masks(rows) if into is None else into
        if matchers:
            import llguidance.numpy

            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(m._matcher, row) for m, row in matchers], masks
            )
            for matcher, row in matchers:
                _end_only_where_allowed(masks, row, self.vocabulary)
                matcher.narrow(masks, row)
        return masks


@dataclass(frozen=True)
class Penalty:
    """What the penalties do to one token's logit (docs/engine.md section 2.4)."""

    token: int
    repeated: bool
    """In the repetition window."""
    count: int
    """Times the generation has produced it."""


class LaneStage:
    """One generation's stage between the logits and the draw: its matcher, its controls and
    the counts its penalties need.

    Built by :meth:`prepare` from the generation's :class:`~sfnode.linkf.wire.Constraint` and
    context (compiling the grammar and replaying the tokens generated before a failover);
    advanced by each token the lane draws.  It lives as long as the lane.
    """

    def __init__(
        self,
        matcher: Matcher | None,
        controls: SamplerControls | None,
        context: Sequence[int],
        generated_from: int,
    ) -> None:
        self.matcher = matcher
        self.controls = controls if controls is not None and not controls.empty else None
        self._bias: dict[int, float] = {}
        if self.controls is not None:
            for token, value in self.controls.logit_bias:
                self._bias[token] = self._bias.get(token, 0.0) + value
        self._window_size = (
            self.controls.repetition_window
            if self.controls is not None and self.controls.repetition_penalty not in (0.0, 1.0)
            else 0
        )
        self._history: list[int] = list(context)
        self._generated_from = generated_from
        self._counts: Counter[int] = Counter(self._history[generated_from:])
        self._window: Counter[int] = Counter(self._window_tokens())

    @classmethod
    def prepare(
        cls,
        vocabulary: Vocabulary | None,
        constraint: Constraint,
        context: Sequence[int],
        budget: int | None = None,
    ) -> LaneStage:
        """The stage of a generation that continues ``context`` under ``constraint`` for at
        most ``budget`` more tokens (its grammar's masks close the output within them; None:
        no budget): the grammar compiled, and the context's tokens from ``generated_from`` on
        replayed through it (they were delivered before a failover), with the masks they were
        drawn from where the budget narrowed them (docs/engine.md section 2.4).

        :raises ConstraintError: no vocabulary for a grammar, a grammar that does not compile,
            ``generated_from`` past the context, or a replayed token the grammar refuses.
        """
        if constraint.generated_from > len(context):
            raise ConstraintError(
                f"generated_from {constraint.generated_from} is past the context's "
                f"{len(context)} tokens",
                "constraint",
            )
        matcher = None
        if constraint.grammar is not None:
            if vocabulary is None:
                raise ConstraintError("this engine has no grammar support", "grammar")
            matcher = Matcher(vocabulary, constraint.grammar)
            replayed = context[constraint.generated_from :]
            if budget is not None:
                matcher.budget.limit = len(replayed) + budget
            scratch = vocabulary.new_masks(1)
            for token in replayed:
                if matcher.budget.due:
                    matcher.fill(scratch, 0)
                matcher.consume(int(token))
        return cls(matcher, constraint.controls, context, constraint.generated_from)

    @property
    def generated(self) -> int:
        """Tokens the generation has produced (before a failover and since)."""
        return len(self._history) - self._generated_from

    @property
    def closed(self) -> bool:
        """Whether the lane ended with its grammar's end while its budget held it to the
        closing (:attr:`~sfnode.decoding.closing.LaneBudget.closed`)."""
        return self.matcher is not None and self.matcher.budget.closed

    def advance(self, token: int) -> None:
        """The lane drew ``token``."""
        if self.matcher is not None:
            self.matcher.consume(token)
        self._history.append(token)
        self._counts[token] += 1
        if self._window_size:
            self._window[token] += 1
            if len(self._history) > self._window_size:
                old = self._history[-self._window_size - 1]
                self._window[old] -= 1
                if not self._window[old]:
                    del self._window[old]

    def rollback(self, tokens: int) -> None:
        """Take back the lane's last ``tokens`` draws."""
        if not 0 <= tokens <= self.generated:
            raise ValueError(f"cannot roll back {tokens} of {self.generated} generated tokens")
        if self.matcher is not None:
            self.matcher.rollback(tokens)
        for _ in range(tokens):
            token = self._history.pop()
            self._counts[token] -= 1
            if not self._counts[token]:
                del self._counts[token]
        self._window = Counter(self._window_tokens())

    def _window_tokens(self) -> list[int]:
        return self._history[-self._window_size :] if self._window_size else []

    @property
    def bias(self) -> Mapping[int, float]:
        """Token id to the bias added to its logit (entries for one token add up)."""
        return self._bias

    def penalties(self) -> list[Penalty]:
        """The tokens whose logits the penalties change now, by id."""
        if self.controls is None or not self.controls.penalises:
            return []
        counted = (
            self._counts
            if (self.controls.presence_penalty or self.controls.frequency_penalty)
            else Counter[int]()
        )
        tokens = sorted(set(self._window) | set(counted))
        return [Penalty(t, t in self._window, counted.get(t, 0)) for t in tokens]

    def adjusted(self, token: int, logit: float) -> float:
        """``logit`` of ``token`` after the bias and the penalties (docs/engine.md section 2.4),
        in float64 (the engines apply the same rules to float32 tensors)."""
        controls = self.controls
        if controls is None:
            return logit
        logit += self._bias.get(token, 0.0)
        if token in self._window:
            r = controls.repetition_penalty
            logit = logit * r if logit <= 0 else logit / r
        count = self._counts.get(token, 0)
        if count and (controls.presence_penalty or controls.frequency_penalty):
            logit -= count * controls.frequency_penalty + controls.presence_penalty
        return logit


__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "CALL_SEPARATOR",
    "ConstraintError",
    "LaneStage",
    "MaskFiller",
    "Matcher",
    "Penalty",
    "Vocabulary",
    "check_grammar",
    "grammar_text",
    "response_format_grammar",
    "sampler_controls",
    "shortest_answer",
    "tools_grammar",
    "tools_system_text",
]
