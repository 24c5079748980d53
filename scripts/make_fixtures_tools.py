#!/usr/bin/env python3
"""Chat templates rendering tools and tool calls, as transformers renders them.

Writes tests/fixtures/tools/chats.json: for each template (Qwen3's official
one from tests/fixtures/tokenizer/qwen3, Qwen2.5-Coder-Instruct's from its
GGUF, and a small template of ours in the XML style of Qwen3-Coder/Qwen3.5
that uses `|items`, `is mapping` and `tojson|safe` on arguments), a set of
conversations with tools, assistant tool calls (arguments as objects, as
vLLM passes them after parsing OpenAI's JSON strings), tool results and
earlier reasoning; and what `apply_chat_template(messages, tools=...,
tokenize=False, add_generation_prompt=...)` renders.

    /work/venv-ref/bin/python scripts/make_fixtures_tools.py

Needs transformers (5.x) and Qwen2.5-Coder-0.5B-Instruct's GGUF, fetched by
scripts/fetch_qwen_coder.sh (its chat template is read from the file's
metadata without loading the weights).
"""
import json
import os
import struct
import sys

from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF = os.path.expanduser("~/.cache/qinfer/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf")


def gguf_chat_template(path):
    """The `tokenizer.chat_template` string of a GGUF file (type 8: string)."""
    with open(path, "rb") as f:
        head = f.read(32 << 20)
    key = b"tokenizer.chat_template"
    at = head.find(struct.pack("<Q", len(key)) + key)
    if at < 0:
        sys.exit(f"{path}: no tokenizer.chat_template")
    at += 8 + len(key)
    (kind,) = struct.unpack_from("<I", head, at)
    assert kind == 8, kind
    (n,) = struct.unpack_from("<Q", head, at + 4)
    return head[at + 12 : at + 12 + n].decode()


XML_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n<tools>' }}
{%- for tool in tools %}
{%- set f = tool.function if tool.function is defined else tool %}
{{- '\\n<function>\\n<name>' ~ f.name ~ '</name>' }}
{%- if f.description is defined %}{{- '\\n<description>' ~ f.description | trim ~ '</description>' }}{%- endif %}
{%- for pname, pfields in f.parameters.properties | items %}
{{- '\\n<parameter>\\n<name>' ~ pname ~ '</name>' }}
{%- if pfields.type is defined %}{{- '\\n<type>' ~ pfields.type | string ~ '</type>' }}{%- endif %}
{%- if pfields.enum is defined %}{{- '\\n<enum>' ~ pfields.enum | tojson | safe ~ '</enum>' }}{%- endif %}
{{- '\\n</parameter>' }}
{%- endfor %}
{%- if f.parameters.required is defined %}{{- '\\n<required>' ~ f.parameters.required | tojson ~ '</required>' }}{%- endif %}
{{- '\\n</function>' }}
{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls %}
{{- '<|im_start|>assistant\\n' ~ (message.content if message.content is string else '') }}
{%- for tc in message.tool_calls %}
{%- set tc = tc.function if tc.function is defined else tc %}
{{- '\\n<tool_call>\\n<function=' ~ tc.name ~ '>\\n' }}
{%- if tc.arguments is mapping %}
{%- for k, v in tc.arguments | items %}
{{- '<parameter=' ~ k ~ '>\\n' }}
{%- if v is string %}{{- v }}{%- elif v is mapping or (v is iterable and v is not string) %}{{- v | tojson | safe }}{%- else %}{{- v | string }}{%- endif %}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{%- endif %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city. Températures in °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_files",
        "description": "  Search a repository.\n",
        "parameters": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string"},
                "paths": {"type": "array", "items": {"type": "string"}},
                "options": {"type": "object", "properties": {"case": {"type": "boolean"}, "limit": {"type": "number"}}},
            },
            "required": ["pattern"],
        },
    },
}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CHATS = [
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris and in 東京?"},
        ],
        "tools": [WEATHER, SEARCH],
    },
    {
        "messages": [{"role": "user", "content": "Find TODOs."}],
        "tools": [SEARCH],
    },
    {
        "messages": [
            {"role": "user", "content": "Weather in Paris and in 東京?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call("call_1", "get_weather", {"city": "Paris", "days": 2}),
                    call("call_2", "get_weather", {"city": "東京", "unit": "celsius"}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21.5}"},
            {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "18 °C, rain"},
            {"role": "assistant", "content": "Paris 21.5 °C; Tokyo 18 °C with rain."},
            {"role": "user", "content": "And search for 'rain' in src/ and docs/, case-insensitive, 0.5 limit."},
        ],
        "tools": [WEATHER, SEARCH],
    },
    {
        "messages": [
            {"role": "user", "content": "Search."},
            {
                "role": "assistant",
                "content": "Searching now.",
                "reasoning_content": "The user wants a search.",
                "tool_calls": [
                    call("call_9", "search_files", {"pattern": "a\"b\\c\n", "paths": ["src", "docs"], "options": {"case": False, "limit": 0.5}}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_9", "content": "no matches"},
        ],
        "tools": [SEARCH],
    },
]


def main():
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tests/fixtures/tokenizer/qwen3"))
    templates = {
        "qwen3": tok.chat_template,
        "qwen2.5-coder": gguf_chat_template(GGUF),
        "xml-style": XML_STYLE,
    }
    out = {"templates": templates, "cases": []}
    for name, src in templates.items():
        for chat in CHATS:
            gen = chat["messages"][-1]["role"] != "assistant"
            rendered = tok.apply_chat_template(
                chat["messages"], tools=chat["tools"], tokenize=False, add_generation_prompt=gen, chat_template=src
            )
            out["cases"].append(
                {"template": name, "messages": chat["messages"], "tools": chat["tools"], "add_generation_prompt": gen, "rendered": rendered}
            )
    path = os.path.join(ROOT, "tests/fixtures/tools/chats.json")
    with open(path, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(path, len(out["cases"]), "cases")


if __name__ == "__main__":
    main()
