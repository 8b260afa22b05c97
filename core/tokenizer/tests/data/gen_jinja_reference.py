"""Regenerates jinja_reference.json: chat templates rendered by jinja2 in the environment
transformers builds for apply_chat_template (trim_blocks, lstrip_blocks, loopcontrols, the
{% generation %} tag, raise_exception, strftime_now and its own tojson), with tools=None and
documents=None as transformers passes them. Needs only `pip install jinja2` (3.1.x).

Run: python3 gen_jinja_reference.py  (from this directory)

The expected strings were also checked against transformers 5.23's own
PreTrainedTokenizerFast.apply_chat_template(..., tokenize=False) (identical).
"""
import json, sys
from datetime import datetime
import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

class AssistantTracker(Extension):
    tags = {"generation"}
    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_gen"), [], [], body).set_lineno(lineno)
    def _gen(self, caller):
        return caller()

def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)
def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
def strftime_now(format):
    return datetime.now().strftime(format)

def render(template, messages, add_generation_prompt, **special):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    t = env.from_string(template)
    return t.render(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **special)

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

MULTILINE = """{{- bos_token }}
{%- if tools is not none %}TOOLS{% endif %}
{%- if documents is defined and documents is none %}[docs none]{% endif %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {% if message.role == 'assistant' %}
    {% generation %}
    {{ message.content.strip() }}{{ eos_token }}
    {% endgeneration %}
    {% else %}
    [{{ message['role'].upper() }}] {{ message['content'].split()|join('_') }} {{ message | tojson }}
    {% endif %}
{%- endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

VALUES = """{{ add_generation_prompt }} {{ none }} {{ 1.5e20 }} {{ 0.1 + 0.2 }} {{ 7 // 2 }} {{ unk_token }}|{{ pad_token is defined }}|{{ eos_token }}
{{ {"a": "<b>&'\\"", "n": [1, 2.0, true, none, -0.5], "é": "ü\\n"} | tojson }}
{{ {"k": [1, {"x": 1}], "e": [], "d": {}} | tojson(indent=2) }}
{{ "x é" | tojson(ensure_ascii=true) }} {{ {"b": 1, "a": 2} | tojson(sort_keys=true, separators=[",", ":"]) }}
{{ messages | tojson }}
{% for k, v in {"z": 1, "y": 2}.items() %}{{ k }}={{ v }};{% endfor %}
{{ "Hello World".startswith("Hello") }} {{ "a,b".split(",") | length }} {{ "  x  ".lstrip() }}| {{ "abc".endswith(("c", "d")) if false else "abc".endswith("c") }}
{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.role }}:{{ m.get('content') }};{{ m.get('missing', 'dflt') }}{% endfor %}
{%- set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %} n={{ ns.n }} {{ messages[-1]['content'][:3] }} {{ messages|selectattr('role', 'equalto', 'user')|list|length }}
    {%- if true %}
  lstrip {{ "rstrip me   ".rstrip() }}.
    {% endif %}
trailing"""

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

DICT_GLOBAL = """{% set d = dict(a=1, b="x<y") %}{{ d | tojson }} {{ d.b }}
{%- for m in messages %} [{{ m.content | trim }}]{% endfor %}
{{ '{"k": 1}' }} {{ [1, 2] | length }}{{ "%" }}
"""

msgs = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hello   there <b>&  "},
    {"role": "assistant", "content": "  Hi!\nHow can I help?  "},
    {"role": "user", "content": "Wie geht's? 😀"},
]
alt = [m for m in msgs if m["role"] != "system"]
special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
cases = [
    {"name": "chatml_gen", "template": CHATML, "messages": msgs, "agp": True, "special": special},
    {"name": "chatml_nosys", "template": CHATML, "messages": alt, "agp": False, "special": special},
    {"name": "multiline_gen", "template": MULTILINE, "messages": alt, "agp": True, "special": special},
    {"name": "multiline_nogen", "template": MULTILINE, "messages": alt[:2], "agp": False, "special": {"bos_token": "<s>", "eos_token": "</s>"}},
    {"name": "values", "template": VALUES, "messages": alt, "agp": True, "special": special},
    {"name": "values_nospecial", "template": VALUES, "messages": alt, "agp": False, "special": {}},
    {"name": "llama3", "template": LLAMA3, "messages": msgs, "agp": True, "special": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}},
    {"name": "llama3_nosys", "template": LLAMA3, "messages": alt, "agp": False, "special": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}},
    {"name": "dict_global", "template": DICT_GLOBAL, "messages": alt[:1], "agp": True, "special": {}},
]

if __name__ == "__main__":
    out = []
    for case in cases:
        expected = render(case["template"], case["messages"], case["agp"], **case["special"])
        out.append({
            "name": case["name"],
            "template": case["template"],
            "messages": case["messages"],
            "add_generation_prompt": case["agp"],
            "special": case["special"],
            "expected": expected,
        })
    with open("jinja_reference.json", "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
