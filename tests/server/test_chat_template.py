"""Qwen3.6's chat format with tools: the tool preamble, assistant tool calls and reasoning in the
history, runs of tool results, and what the format refuses."""

from __future__ import annotations

import pytest

from metainfer.tokenizer import TOOLS_FORMAT, TOOLS_HEADER, apply_chat_template

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & later",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
)


def test_agent_loop_history() -> None:
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Old question"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nOld answer"},
        {"role": "user", "content": " Weather in Paris and Rome? "},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": " Two calls. ",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "n": 2, "x": true}'},
                },
                {"function": {"name": "get_weather", "arguments": {"city": "Rome", "o": {"a": [1, None]}}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "content": [{"type": "text", "text": "Rainy"}]},
    ]
    expected = (
        f"<|im_start|>system\n{TOOLS_HEADER}\n{TOOL_JSON}{TOOLS_FORMAT}\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nOld question<|im_end|>\n"
        "<|im_start|>assistant\nOld answer<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=n>\n2\n</parameter>\n<parameter=x>\nTrue\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        '<parameter=o>\n{"a": [1, null]}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\nRainy\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert apply_chat_template(messages, tools=[TOOL]) == expected


def test_calls_without_text_and_reasoning_from_content() -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": ""}}]},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "<think>why</think>done"},
    ]
    text = apply_chat_template(messages, add_generation_prompt=False, tools=[TOOL])
    assert text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nwhy\n</think>\n\ndone<|im_end|>\n"
    )


def test_without_tools_and_thinking_off() -> None:
    text = apply_chat_template(
        [{"role": "developer", "content": "S"}, {"role": "user", "content": "hi"}], True, False
    )
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert "# Tools" not in apply_chat_template([{"role": "user", "content": "hi"}], tools=[])


@pytest.mark.parametrize(
    "call,message",
    [
        ({"function": {"name": "f", "arguments": "{not json"}}, "is not valid JSON"),
        ({"function": {"name": "f", "arguments": "[1]"}}, "must be a JSON object"),
        ({"function": {"arguments": "{}"}}, "function.name is required"),
    ],
)
def test_bad_tool_calls_are_refused(call: dict, message: str) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(ValueError, match=message):
        apply_chat_template(messages)
