"""The head's tool calls as pure pieces (sfnode.head.models.tools): the generic rendering of tools
and tool history, a template that renders tools itself, and the calls read back out of an output
as it streams, in any cut of its text.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from sfnode.decoding.constraint import tools_system_text
from sfnode.head.models.chat import ChatMessage, ChatToolCall
from sfnode.head.models.text import Renderer
from sfnode.head.models.tools import (
    ArgumentsDelta,
    CallOpened,
    CallsAnswer,
    CallSplitter,
    Content,
    template_messages,
)
from tests.agents import TOOL_CALL_INSTANCE
from tests.test_http import tokenizer

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "jump",
            "parameters": {"type": "object", "properties": {"over": {"type": "string"}}},
        },
    }
]
OUTPUT = (
    'Sure: <tool <b>.<tool_call>{"name": "jump", "arguments": {"over": "a \\"}\\" {[x"}}'
    '</tool_call>\n<tool_call>{"name": "land", "arguments": {"at": [1, {"b": []}]}}</tool_call>'
)


def split(text: str, size: int) -> CallsAnswer:
    splitter = CallSplitter(iter(f"call_{i}" for i in range(9)).__next__)
    answer = CallsAnswer()
    for start in range(0, len(text), size):
        answer.add(splitter.feed(text[start : start + size]))
    answer.add(splitter.finish())
    return answer


def read_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """A whole output's content and its whole calls' (name, arguments), as the head reads
    them."""
    answer = split(text, max(len(text), 1))
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in answer.whole_calls]
    return answer.text, calls


class SplitterTests(SynchronousTestCase):
    def test_any_cut_of_the_text_reads_the_same_calls_as_the_whole(self) -> None:
        """Fed one character at a time, or in any chunk size, the splitter gives the content
        before the first call and each call's name and arguments exactly as written (brackets
        and quotes inside strings do not end the arguments)."""
        content = "Sure: <tool <b>."
        calls = [("jump", '{"over": "a \\"}\\" {[x"}'), ("land", '{"at": [1, {"b": []}]}')]
        for size in (1, 2, 3, 5, 11, len(OUTPUT)):
            answer = split(OUTPUT, size)
            self.assertEqual(answer.text, content, size)
            self.assertEqual(
                [(c["function"]["name"], c["function"]["arguments"]) for c in answer.calls],
                calls,
            )
            self.assertEqual([c["id"] for c in answer.calls], ["call_0", "call_1"])

    def test_calls_are_read_back_with_their_arguments_as_written(self) -> None:
        """Text before the first call is content; each closed call gives its name and its
        arguments' exact text; a call cut short is dropped; output without a call is all
        content."""
        text = "Let me check. " + TOOL_CALL_INSTANCE + "\n" + TOOL_CALL_INSTANCE[:30]
        self.assertEqual(
            read_calls(text),
            ("Let me check. ", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        )
        self.assertEqual(read_calls("no calls"), ("no calls", []))

    def test_events_come_in_order_and_tags_never_show(self) -> None:
        """A call opens (index, id, name) before its argument fragments; no content carries
        any part of a tag."""
        splitter = CallSplitter(lambda: "call_x")
        events = [e for ch in OUTPUT for e in splitter.feed(ch)]
        opened = [e for e in events if isinstance(e, CallOpened)]
        self.assertEqual([(e.index, e.name) for e in opened], [(0, "jump"), (1, "land")])
        first_fragment = next(i for i, e in enumerate(events) if isinstance(e, ArgumentsDelta))
        self.assertIsInstance(events[first_fragment - 1], CallOpened)
        text = "".join(e.text for e in events if isinstance(e, Content))
        self.assertEqual(text, "Sure: <tool <b>.")

    def test_text_that_only_looks_like_a_call_is_content(self) -> None:
        """A held-back ``<tool`` at the end, or a tag whose header is no call, comes out as
        content when the output ends."""
        self.assertEqual(split("ends with <tool_c", 1).text, "ends with <tool_c")
        answer = split("<tool_call>not json</tool_call> after", 4)
        self.assertEqual((answer.text, answer.calls), ("<tool_call>not json</tool_call> after", []))

    def test_a_call_cut_short_keeps_what_came(self) -> None:
        """An output cut by max_tokens inside a call's arguments: the call is open with the
        fragments so far (what a stream showed), finish adds nothing, and the whole calls (what
        a non-streamed answer lists) leave it out, as they do a call cut inside its header."""
        text = '<tool_call>{"name": "jump", "arguments": {}}</tool_call>\n<tool_call>{"name": '
        answer = split(text + '"jump", "arguments": {"over": "fo', 3)
        self.assertEqual(answer.calls[1]["function"]["arguments"], '{"over": "fo')
        self.assertEqual(answer.whole_calls, answer.calls[:1])
        self.assertEqual(read_calls(text)[1], [("jump", "{}")])


class RenderingTests(SynchronousTestCase):
    HISTORY = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "jump"),
        ChatMessage("assistant", "", (ChatToolCall("call_1", "jump", '{"over":"fox"}'),)),
        ChatMessage("tool", "done", (), "call_1"),
        ChatMessage("tool", "again", (), "call_2"),
    ]

    def test_the_generic_rendering(self) -> None:
        """Without template support: the tools' description joins the system turn, the call
        is written as the grammar writes it, and consecutive results form one user turn of
        tool_response blocks."""
        messages, tools = template_messages(self.HISTORY, TOOLS, knows_tools=False)
        self.assertIsNone(tools)
        self.assertEqual([m.role for m in messages], ["system", "user", "assistant", "user"])
        self.assertEqual(messages[0].content, "Be brief.\n\n" + tools_system_text(TOOLS))
        self.assertEqual(
            messages[2].content,
            '<tool_call>{"name": "jump", "arguments": {"over": "fox"}}</tool_call>',
        )
        self.assertEqual(
            messages[3].content,
            "<tool_response>\ndone\n</tool_response>\n<tool_response>\nagain\n</tool_response>",
        )
        self.assertEqual(
            template_messages(self.HISTORY[:2], (), knows_tools=False)[0], self.HISTORY[:2]
        )

    def test_a_template_that_knows_tools_renders_them(self) -> None:
        """A chat template that reads ``tools`` gets the tools and the history as they are
        (calls with arguments as an object, results with their tool_call_id)."""
        tok = tokenizer()
        saved = getattr(tok, "chat_template", None)
        self.addCleanup(setattr, tok, "chat_template", saved)
        tok.chat_template = (
            "{% for t in tools %}T:{{ t.function.name }};{% endfor %}"
            "{% for m in messages %}{{ m.role }}:{{ m.content }}"
            "{% for c in m.tool_calls or [] %}C:{{ c.function.name }}="
            "{{ c.function.arguments.over }}{% endfor %}"
            "{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %};{% endfor %}"
        )
        text = tok.decode(Renderer(tok).chat(self.HISTORY, tools=TOOLS))
        self.assertEqual(
            text,
            "T:jump;system:Be brief.;user:jump;assistant:C:jump=fox;tool:done@call_1;"
            "tool:again@call_2;",
        )
