#!/usr/bin/env python3
"""Writes model/tests/fixtures/tokenizer/smollm2_reference.json: >= 2,000 test strings with the
token ids and decoded text of an independent reference tokenizer, plus chat templates rendered
by Jinja.

Reference: Hugging Face `tokenizers` (Rust), built from the GGUF's tokenizer metadata by
transformers' own GGUF tokenizer converter (transformers/integrations/gguf/
gguf_tokenizer_mapping.py: convert_gguf_tokenizer), i.e. what
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds. Two notes:
  * transformers 5.x imports torch in its GGUF metadata reader, and torch is not installed
    here, so this script reads the metadata with the `gguf` package into the same dict that
    transformers' get_gguf_tokenizer() produces and then calls convert_gguf_tokenizer().
  * transformers' converter has no entry for tokenizer.ggml.pre = "smollm" and falls back to
    GPT-2's ByteLevel regex, which does not split digits. SmolLM2's own tokenizer.json (and
    llama.cpp for pre "smollm") use Sequence[Digits(individual_digits=true), ByteLevel]. The
    fixture's ids use that pre-tokenizer, set on the same converted tokenizer; the script
    prints how many strings the unmodified converter encodes differently (all of them contain
    digits).

Usage (throwaway venv, not part of CI):
  python3 -m venv ~/.cache/kvr/venv-ref
  ~/.cache/kvr/venv-ref/bin/pip install transformers tokenizers gguf sentencepiece protobuf jinja2
  ~/.cache/kvr/venv-ref/bin/python model/tests/scripts/tokenizer_make_fixture.py \
      --model ~/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out model/tests/fixtures/tokenizer/smollm2_reference.json
"""

import argparse
import hashlib
import json
import random
import sys

import gguf
import tokenizers
import transformers
from tokenizers import pre_tokenizers
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_PRE_TOKENIZER_SPLITS, GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

SEED = 20261122
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>",
            "<jupyter_code>", "<empty_output>", "<gh_stars>"]


def read_tokenizer_dict(path):
    """The dict transformers' get_gguf_tokenizer() builds, read with the gguf package."""
    reader = gguf.GGUFReader(path)
    metadata = {}
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") and name != "general.architecture":
            continue
        value = field.contents()
        metadata[name] = value
    tokenizer = {new: metadata[f"tokenizer.{old}"]
                 for old, new in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                 if f"tokenizer.{old}" in metadata}
    return metadata, tokenizer


# ---------------------------------------------------------------------------------------------
# Test strings. Deterministic: one seeded generator, fixed pools.

WORDS = ("the quick brown fox jumps over lazy dog tokenizer model cache attention retrieval "
         "summary cluster decode prefill latency throughput hello world naïve café résumé "
         "Straße façade coöperate über ÆØÅ ångström").split()
CONTRACTIONS = ["it's", "don't", "we're", "they've", "I'm", "you'll", "she'd", "IT'S", "Don'T",
                "rock'n'roll", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "o'clock", "''",
                "dog's", "James'", "’s", "it’s"]
SCRIPTS = [
    "你好，世界！这是一个测试。机器学习模型的分词器",
    "日本語のテキストとカタカナ、ひらがな。東京タワー",
    "한국어 텍스트입니다. 안녕하세요 세계",
    "Привет, мир! Съешь же ещё этих мягких французских булок",
    "Γειά σου Κόσμε· ξεσκεπάζω την ψυχοφθόρα βδελυγμία",
    "مرحبا بالعالم، هذا اختبار للنص العربي ١٢٣",
    "שלום עולם, זהו מבחן",
    "नमस्ते दुनिया, यह एक परीक्षण है १२३४",
    "สวัสดีชาวโลก นี่คือการทดสอบ",
    "Xin chào thế giới, đây là một bài kiểm tra",
    "Zażółć gęślą jaźń — Příliš žluťoučký kůň",
    "ሰላም ለዓለም",
    "Բարեւ աշխարհ",
    "გამარჯობა მსოფლიო",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉 ∀x∈ℝ: x²≥0 ∑ᵢ aᵢ ≤ ∞",
]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🏳️‍🌈", "❤️", "🤖", "🧑🏿‍💻", "🫠", "✅", "🔥🔥🔥", "©️", "1️⃣"]
COMBINING = ["e\u0301", "a\u0308", "n\u0303", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d",
             "\u0915\u093f", "\u0e01\u0e34\u0e4a", "o\u0338", "\u1100\u1161\u11a8", "A\u030a"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", " \t ", "\u00a0", "\u3000",
          "\u2009", "\u0085", "\u2028", "\u2029", "\u180e", "\u200b", "\u202f", "\x0b", "\x0c",
          "\x1c", "\u1680", "\ufeff"]
NUMBERS = ["0", "7", "42", "1234567890", "3.14159265358979", "-273.15", "1,000,000", "1e-9",
           "0x7fffffff", "2026-11-22", "06:15", "+1 (555) 010-9999", "١٢٣٤٥", "１２３", "²³",
           "Ⅻ", "½", "⅞", "٣.١٤", "१२३", "๑๒๓", "99.9%", "$1,299.99", "v1.2.3", "10^18",
           "123456789012345678901234567890"]
CODE = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; return v.size(); }\n",
    "const add = (a, b) => a + b;\nconsole.log(`sum=${add(2, 3)}`);\n",
    "fn main() {\n    let s: &str = \"héllo\";\n    println!(\"{}\", s.len());\n}\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hi\")\n}\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b\\n"}}',
    "<div class=\"x\"><p>Hello &amp; welcome</p></div>",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done\n",
    "    if x == 1:\n        pass\n    elif x != 2:\n        raise ValueError('bad')\n",
    "template <typename T>\nconcept Addable = requires(T a) { a + a; };\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares\n",
    "\\begin{equation} E = mc^2 \\end{equation}",
    "git commit -m \"fix: handle CRLF\\r\\n\" && git push origin main",
    "a<<=1; b>>=2; c&&=d; e||=f; g??=h; i!==j; k===l; m->n; o::p",
]


def random_code_point(rng):
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F),
              (0x2190, 0x23FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x1D400, 0x1D7FF), (0x10000, 0x1007F)]
    lo, hi = rng.choice(ranges)
    return chr(rng.randint(lo, hi))


def substring(rng, strings, max_len):
    s = rng.choice(strings)
    a = rng.randrange(len(s))
    return s[a:a + rng.randint(1, max_len)]


# One random piece of a test string, by kind; the draws from rng (and so the fixture) depend on
# this order.
PIECES = [
    lambda rng: rng.choice(WORDS),
    lambda rng: rng.choice(CONTRACTIONS),
    lambda rng: substring(rng, SCRIPTS, 12),
    lambda rng: rng.choice(EMOJI),
    lambda rng: rng.choice(COMBINING),
    lambda rng: rng.choice(NUMBERS),
    lambda rng: substring(rng, CODE, 30),
    lambda rng: "".join(random_code_point(rng) for _ in range(rng.randint(1, 4))),
    lambda rng: rng.choice(SPACES),
]


def piece(rng):
    return PIECES[rng.randrange(len(PIECES))](rng)


def make_strings():
    rng = random.Random(SEED)
    out = ["", " ", "  ", "\n", "\t", "a", "A", "0", "'", "''s", " 's", "Hello, World!",
           "Hello world", " Hello world", "Hello world ", "  leading and trailing  ",
           "<|im_start|>", "<|im_end|>", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
           "<|im_start|>assistant\n", " <|im_start|> ", "<|im_start", "im_start|>",
           "<|im_start|><|im_end|><|endoftext|>", "text<|endoftext|>more", "<|im_end|>\n\n",
           "<<|im_start|>>", "<|IM_START|>", "<repo_name>kvr<file_sep>src/main.cc\nint x;"]
    out += [" " * n for n in range(1, 41)]
    out += ["\n" * n for n in range(1, 9)] + ["\t" * n for n in range(1, 9)]
    out += [" \t\n" * n for n in range(1, 6)] + ["a" + " " * n + "b" for n in range(1, 17)]
    out += ["x" + s + "y" for s in SPACES] + [s + "word" for s in SPACES] + \
           ["word" + s for s in SPACES]
    out += NUMBERS + ["a" + n + "b" for n in NUMBERS] + [" " + n for n in NUMBERS]
    out += ["".join(str(rng.randrange(10)) for _ in range(rng.randint(1, 60))) for _ in range(60)]
    out += CONTRACTIONS + ["I said " + c + " twice" for c in CONTRACTIONS]
    out += SCRIPTS + EMOJI + COMBINING + CODE
    out += ["".join(EMOJI[rng.randrange(len(EMOJI))] for _ in range(rng.randint(2, 6)))
            for _ in range(30)]
    for _ in range(200):  # special tokens embedded in text
        parts = []
        for _ in range(rng.randint(1, 6)):
            parts.append(rng.choice(SPECIALS) if rng.random() < 0.4 else piece(rng))
        out.append("".join(parts))
    for _ in range(600):  # mixtures
        sep = rng.choice(["", " ", " ", " ", "\n", rng.choice(SPACES)])
        out.append(sep.join(piece(rng) for _ in range(rng.randint(1, 12))))
    for _ in range(300):  # random code points
        out.append("".join(random_code_point(rng) for _ in range(rng.randint(1, 20))))
    for _ in range(300):  # code fragments
        s = rng.choice(CODE)
        a = rng.randrange(len(s))
        out.append(s[a:a + rng.randint(1, 120)])
    for _ in range(300):  # sentences
        words = [rng.choice(WORDS + CONTRACTIONS + NUMBERS) for _ in range(rng.randint(3, 25))]
        out.append(" ".join(words) + rng.choice([".", "!", "?", "...", "", "\n"]))
    for _ in range(6):  # a few long documents
        out.append("".join(piece(rng) + rng.choice([" ", "", "\n"]) for _ in range(1500)))
    seen = set()
    unique = []
    for s in out:
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique


# ---------------------------------------------------------------------------------------------
# Chat templates (Jinja text as the models ship it) and conversations.

QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen2.5-Instruct's layout: the default system prompt sits outside the message loop and a
# tools branch mentions '<|im_start|>system' without a default prompt.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHATML_PLAIN_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
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
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = "
    "'<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}"
    "{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "  What is 2+2?  \n"},
     {"role": "assistant", "content": " 4. \n"},
     {"role": "user", "content": "And 3+3? ünïcödé 😀"}],
    [{"role": "system", "content": " Be kind.\n"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [],
]


def render_templates(smollm_template):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    # transformers' chat template environment (utils/chat_template_utils.py).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    templates = {"smollm2": smollm_template, "qwen2": QWEN2_TEMPLATE, "qwen25": QWEN25_TEMPLATE,
                 "chatml_plain": CHATML_PLAIN_TEMPLATE, "llama3": LLAMA3_TEMPLATE,
                 "llama31": LLAMA31_TEMPLATE, "llama2": LLAMA2_TEMPLATE,
                 "mistral": MISTRAL_TEMPLATE}
    bos = {"llama3": "<|begin_of_text|>", "llama31": "<|begin_of_text|>"}
    cases = []
    for name, text in templates.items():
        compiled = env.from_string(text)
        for conv_index, messages in enumerate(CONVERSATIONS):
            if name == "qwen25" and not messages:
                continue  # reads messages[0]; kvr's chatml renders an empty conversation
            for add_generation_prompt in (True, False):
                bos_token = bos.get(name, "<s>")
                eos_token = "</s>"
                try:
                    rendered = compiled.render(messages=messages, bos_token=bos_token,
                                               eos_token=eos_token,
                                               add_generation_prompt=add_generation_prompt)
                    error = None
                except Exception as e:  # noqa: BLE001 - the template raised: record it
                    rendered, error = None, str(e)
                cases.append({"template": name, "conversation": conv_index,
                              "add_generation_prompt": add_generation_prompt,
                              "bos_token": bos_token, "eos_token": eos_token,
                              "rendered": rendered, "error": error})
    return {"templates": templates, "conversations": CONVERSATIONS, "cases": cases}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    metadata, tokenizer_dict = read_tokenizer_dict(args.model)
    architecture = metadata["general.architecture"]
    as_converted = convert_gguf_tokenizer(architecture, tokenizer_dict)[0]
    reference = tokenizers.Tokenizer.from_str(as_converted.to_str())
    # SmolLM2's tokenizer.json pre-tokenizer (see the module docstring).
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    no_special = tokenizers.Tokenizer.from_str(reference.to_str())
    no_special.encode_special_tokens = True

    # The other pre-tokenizer families, on the same vocabulary: what transformers' converter
    # builds for a GGUF whose tokenizer.ggml.pre names them. This checks kvr's PCRE2 rendering
    # of each family's regex against Hugging Face's Oniguruma on every string. Llama 3's own
    # tokenizer.json sets "ignore_merges": true (llama.cpp does the same for llama-bpe), which
    # transformers' converter leaves off; the reference turns it on.
    variants = {"gpt2": as_converted}
    for pre, ignore_merges in (("llama-bpe", True), ("qwen2", False)):
        converted = convert_gguf_tokenizer(architecture,
                                           dict(tokenizer_dict, pre_tokenizer_type=pre))[0]
        state = json.loads(converted.to_str())
        assert state["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == \
            GGUF_PRE_TOKENIZER_SPLITS[pre]
        state["model"]["ignore_merges"] = ignore_merges
        variants[pre] = tokenizers.Tokenizer.from_str(json.dumps(state))
    # Qwen2's own tokenizer.json also normalises to NFC (transformers' GGUF converter and
    # llama.cpp do not); this variant checks kvr's tokenizer.json path with that normaliser.
    state = json.loads(variants["qwen2"].to_str())
    state["normalizer"] = {"type": "NFC"}
    variants["qwen2+nfc"] = tokenizers.Tokenizer.from_str(json.dumps(state))

    strings = make_strings()
    cases = []
    variant_ids = {name: {} for name in variants}
    differ_from_converter = 0
    for text in strings:
        ids = reference.encode(text, add_special_tokens=False).ids
        if as_converted.encode(text, add_special_tokens=False).ids != ids:
            differ_from_converter += 1
        for name, variant in variants.items():
            if len(text) > 2000:
                continue  # the few long documents would double the file; short strings suffice
            variant_result = variant.encode(text, add_special_tokens=False).ids
            if variant_result != ids:  # stored only where it differs, to keep the file small
                variant_ids[name][str(len(cases))] = variant_result
        case = {"text": text, "ids": ids}
        ids_plain = no_special.encode(text, add_special_tokens=False).ids
        if ids_plain != ids:
            case["ids_no_special"] = ids_plain
        decoded = reference.decode(ids, skip_special_tokens=False)
        if decoded != text:
            case["decoded"] = decoded
        cases.append(case)

    with open(args.model, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    fixture = {
        "model_sha256": sha256,
        "reference": (f"tokenizers {tokenizers.__version__} via transformers "
                      f"{transformers.__version__} convert_gguf_tokenizer, pre-tokenizer "
                      "Sequence[Digits(individual), ByteLevel] (SmolLM2 tokenizer.json)"),
        "seed": SEED,
        "cases": cases,
        "pre_tokenizer_variants": variant_ids,
        "chat": render_templates(tokenizer_dict_template(metadata)),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, separators=(",", ":"))
    n_tokens = sum(len(c["ids"]) for c in cases)
    for name, diffs in variant_ids.items():
        print(f"pre-tokenizer {name}: {len(diffs)} strings encode differently from smollm",
              file=sys.stderr)
    print(f"{len(cases)} strings, {n_tokens} tokens, "
          f"{sum('ids_no_special' in c for c in cases)} with special tokens, "
          f"{differ_from_converter} encoded differently by the unmodified GGUF converter",
          file=sys.stderr)


def tokenizer_dict_template(metadata):
    return metadata["tokenizer.chat_template"]


if __name__ == "__main__":
    main()
