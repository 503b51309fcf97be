"""Chat templates: rendering equals transformers' ``apply_chat_template`` (its own renderer,
``render_jinja_template``), the sandbox refuses escapes, the export copies the target's
template into the engine folder with its hash, the runtime checks it, and a rendered chat
is tokenized without a second BOS."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import EOS, TINY_CHAT_TEMPLATE

from specrt import Engine
from specrt.runtime.errors import EngineError, InputError

pytest.importorskip("jinja2", reason="the [serve] extra (jinja2) is not installed")

from specrt.runtime.chat import ChatTemplate, TemplateSourceError, normalize_messages  # noqa: E402

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA2_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
TOOLISH = (
    "{%- for message in messages %}\n"
    "  {%- if loop.first and message.role == 'system' %}[SYS]{{ message.content | tojson }}\n"
    "  {%- elif message.role == 'user' -%}\n"
    "    [U]{{ message.content }}\n"
    "  {%- else %}{% if message.content == 'skip' %}{% continue %}{% endif %}[A]{{ message.content }}{{ eos_token }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}[A]{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Réponds en Python — ✓ 日本語"},
    {"role": "user", "content": "  Write fib.  "},
    {"role": "assistant", "content": "def fib(n): ..."},
    {"role": "user", "content": "Faster?"},
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("template", [TINY_CHAT_TEMPLATE, CHATML, LLAMA2_LIKE, TOOLISH, "default-pair"])
def test_rendering_equals_transformers(template):
    from pathlib import Path

    from transformers.utils.chat_template_utils import render_jinja_template

    if template == "default-pair":
        template = json.loads((Path(__file__).resolve().parents[1] / "models" / "target" / "tokenizer_config.json").read_text())["chat_template"]
    for messages in (CONVERSATION, CONVERSATION[1:], [{"role": "user", "content": "skip"}, {"role": "assistant", "content": "skip"}]):
        for gen in (True, False):
            try:
                (want,), _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=gen, **SPECIAL)
            except Exception as e:  # the template itself refuses this conversation: ours must refuse it alike
                with pytest.raises(InputError) as got:
                    ChatTemplate(template, "t", SPECIAL).render(messages, gen)
                assert str(e) in str(got.value) and got.value.param == "messages"
                continue
            assert ChatTemplate(template, "t", SPECIAL).render(messages, gen) == want


def test_sandbox_and_template_errors():
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "t")
    with pytest.raises(InputError, match="messages: the chat template refused the conversation") as e:
        escape.render(CONVERSATION)
    assert e.value.param == "messages"
    with pytest.raises(InputError):  # immutable sandbox: no mutation of the messages
        ChatTemplate("{{ messages.append(1) }}", "t").render(CONVERSATION)
    with pytest.raises(InputError, match="Conversation roles must alternate"):
        ChatTemplate(LLAMA2_LIKE, "t", SPECIAL).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(TemplateSourceError, match=r"chat template my.jinja: line 1: .*"):
        ChatTemplate("{% for m in messages %}", "my.jinja")
    assert ChatTemplate("{{ messages[0].content | tojson }}", "t").render([{"role": "user", "content": "✓"}]) == '"✓"'  # ensure_ascii=False
    assert ChatTemplate("{{ strftime_now('%Y') | length }}", "t").render([]) == "4"


def test_normalize_messages():
    got = normalize_messages(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": None}, {"role": "assistant", "content": None}]
    )
    assert got == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    with pytest.raises(InputError, match=r"messages\[0\].content\[1\]: only text parts are supported .* 'image_url'"):
        normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}])


def test_find_chat_template(tmp_path):
    from specrt.export.pipeline import find_chat_template
    from specrt.runtime.errors import PairError

    assert find_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert find_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J ✓", encoding="utf-8")  # the separate file wins, as in transformers
    assert find_chat_template(tmp_path) == "J ✓"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(PairError, match="with a 'default' one"):
        find_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "x"}))
    assert find_chat_template(tmp_path) is None


def test_export_copies_and_runtime_checks_the_template(tiny_pair, noisy_pair, tmp_path):
    from specrt.runtime.manifest import sha256_file

    engine = Engine(tiny_pair[2])
    m = engine.manifest
    assert engine.chat_template == TINY_CHAT_TEMPLATE
    assert m.chat_template_file == "chat_template.jinja" and m.chat_template_sha256 == sha256_file(tiny_pair[2] / "chat_template.jinja")
    assert Engine(noisy_pair[1]).chat_template is None  # a target without a template: nothing copied, nothing recorded
    assert not (noisy_pair[1] / "chat_template.jinja").exists()
    # an altered template is refused at load, like the other files
    folder = tmp_path / "engine"
    shutil.copytree(tiny_pair[2], folder)
    (folder / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE + "{{ 'injected' }}")
    with pytest.raises(EngineError, match=r"chat_template.jinja (does not match the SHA-256|has \d+ bytes, the manifest records)"):
        Engine(folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(EngineError, match="chat_template.jinja is missing"):
        Engine(folder)
    # manifests written before the field existed stay loadable
    raw = json.loads((folder / "manifest.json").read_text())
    del raw["chat_template_file"], raw["chat_template_sha256"]
    (folder / "manifest.json").write_text(json.dumps(raw))
    assert Engine(folder).chat_template is None


def test_default_pair_engine_has_the_models_template():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    folder = root / "engines" / "default"
    if not (folder / "manifest.json").is_file():
        pytest.skip("the default pair is not exported (make export)")
    want = json.loads((root / "models" / "target" / "tokenizer_config.json").read_text())["chat_template"]
    assert Engine(folder).chat_template == want


def test_rendered_chat_gets_no_second_bos(tiny_pair):
    from specrt.runtime.serve.protocol import chat_request_model, completion_request_model
    from specrt.runtime.serve.server import CompletionService, WorkerPool

    engine = Engine(tiny_pair[2])
    bos = engine.codec.tokenizer.token_to_id(EOS)
    engine.codec.bos = bos  # as a tokenizer that prepends BOS (Llama): the manifest's add_bos
    pool = WorkerPool([engine])
    try:
        svc = CompletionService(pool, "tiny", ChatTemplate(TINY_CHAT_TEMPLATE, "t", {"bos_token": EOS, "eos_token": EOS}))
        ids = svc.prepare_chat(chat_request_model()(messages=[{"role": "user", "content": "hi"}])).gens[0].ids
        text = ChatTemplate(TINY_CHAT_TEMPLATE, "t", {"bos_token": EOS, "eos_token": EOS}).render([{"role": "user", "content": "hi"}])
        assert ids[0] == bos and ids[1] != bos  # the template's BOS only
        assert ids == engine.codec.encode(text, add_special_tokens=False)
        assert engine.codec.encode(text)[:2] == [bos, bos]  # what tokenizing with special tokens would have given
        plain = svc.prepare_completion(completion_request_model()(prompt="hi")).gens[0].ids
        assert plain[0] == bos  # /v1/completions still adds BOS as the manifest says
    finally:
        pool.close()


def test_token_bytes(tiny_pair):
    engine = Engine(tiny_pair[2])
    codec = engine.codec
    text = "héllo wörld — ünïcode ✓ 日本語\ndef add(a, b):"
    ids = codec.encode(text)
    assert b"".join(codec.token_bytes(i) for i in ids) == text.encode("utf-8")  # byte-level BPE: exact bytes
    partial = [i for i in ids if codec.token_text(i).startswith("bytes:")]
    assert partial, "expected tokens holding part of a multi-byte character"
    for i in partial:
        assert codec.token_text(i) == "bytes:" + "".join(f"\\x{b:02x}" for b in codec.token_bytes(i))
    eos = codec.tokenizer.token_to_id(EOS)
    assert codec.token_bytes(eos) == EOS.encode() and codec.token_text(eos) == EOS
    assert codec.max_token_bytes == max(len(codec.token_bytes(i)) for i in range(codec.vocab_size)) >= len(EOS)


def test_encoding_releases_the_gil(tiny_pair):
    """The server tokenizes in executor threads: TextCodec.encode must let the event loop's
    thread run meanwhile (tokenizers' encode holds the GIL, encode_batch releases it)."""
    import threading
    import time

    codec = Engine(tiny_pair[2]).codec
    text = "def add(a, b):\n    return a + b\n" * 20000
    done, took = threading.Event(), []

    def work():
        t0 = time.perf_counter()
        codec.encode(text)
        took.append(time.perf_counter() - t0)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    ticks = 0
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    t.join()
    if took[0] < 0.05:
        pytest.skip(f"encoding took only {took[0] * 1000:.0f} ms here: too fast to tell")
    assert ticks >= 10, f"the main thread ran {ticks} times in {took[0] * 1000:.0f} ms of encoding"


@pytest.mark.parametrize("template", [TINY_CHAT_TEMPLATE, CHATML, LLAMA2_LIKE])
@pytest.mark.parametrize("final", ["def fib(n):", "def fib(n):\n    ", "  x = 1  "])
def test_continue_final_message_equals_transformers(template, final):
    """An assistant prefill is left open, as transformers' ``continue_final_message`` does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    conv = [{"role": "user", "content": "Write fib."}, {"role": "assistant", "content": final}]
    tpl = ChatTemplate(template, "test", SPECIAL)
    got = tpl.render(conv, add_generation_prompt=False, continue_final_message=True)
    want, _ = render_jinja_template(conversations=[conv], chat_template=template, continue_final_message=True, **SPECIAL)
    assert got == want[0]
    assert got.rstrip().endswith(final.strip()) and not got.endswith("</s>")
    with pytest.raises(InputError, match="cannot both be true"):
        tpl.render(conv, add_generation_prompt=True, continue_final_message=True)


def test_continue_final_message_refuses_what_it_cannot_find():
    tpl = ChatTemplate("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", "test")
    with pytest.raises(InputError, match="does not appear in the rendered conversation") as e:
        tpl.render([{"role": "assistant", "content": "abc"}], add_generation_prompt=False, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    with pytest.raises(InputError, match="no content to continue"):
        tpl.render([{"role": "assistant", "content": "  "}], add_generation_prompt=False, continue_final_message=True)


def test_server_continues_an_assistant_prefill(tiny_pair, tiny_server):
    """``continue_final_message`` / ``add_generation_prompt`` (vLLM's fields) reach the
    template: the reply continues the prefill, equal to a completion of the rendered text."""
    from serving import post

    from specrt import Engine, GenerationConfig

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f"}]
    body = dict(model="tiny", messages=conv, max_tokens=6, temperature=0, add_generation_prompt=False, continue_final_message=True)
    st, r, _ = post(tiny_server.port, body, path="/v1/chat/completions")
    assert st == 200, r
    e = Engine(tiny_pair[2])
    text = ChatTemplate(e.chat_template, "engine", {"bos_token": e.codec.tokenizer.id_to_token(e.manifest.bos_token_id)}).render(
        conv, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|assistant|>def f")
    want = e.generate(e.codec.encode(text, add_special_tokens=False), GenerationConfig(max_new_tokens=6)).text
    assert r["choices"][0]["message"]["content"] == want
    st, r, _ = post(tiny_server.port, dict(body, add_generation_prompt=True), path="/v1/chat/completions")
    assert st == 400 and r["error"]["param"] == "continue_final_message"


def test_bench_prompt_files_take_chats(tiny_pair, noisy_pair, tmp_path):
    """A ``messages`` line of a bench/tune prompt file is the engine template's rendering,
    tokenized without BOS (transformers' apply_chat_template(tokenize=True) rule); a plain
    ``prompt`` line is the text as given; an engine without a template refuses chats."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from specrt.runtime.chat import special_token_strings
    from specrt.runtime.lab.bench import load_prompts, prompt_tokens

    engine = Engine(tiny_pair[2])
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": CONVERSATION[1:]}) + "\n" + json.dumps({"prompt": "def f():"}) + "\n")
    chat, plain = load_prompts(p)
    (text,), _ = render_jinja_template(
        conversations=[CONVERSATION[1:]], chat_template=TINY_CHAT_TEMPLATE, add_generation_prompt=True, **special_token_strings(engine)
    )
    assert prompt_tokens(engine, chat) == engine.codec.tokenizer.encode(text, add_special_tokens=False).ids
    assert prompt_tokens(engine, plain) == engine.prompt_ids("def f():")
    with pytest.raises(InputError, match="has no chat template"):
        prompt_tokens(Engine(noisy_pair[1]), chat)
    p.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(InputError, match=r'p.jsonl:1: each line must be a JSON object with a non-empty "prompt" string or a "messages" list'):
        load_prompts(p)
